"""User-defined output recorders (:func:`register_output_recorder`), per model instance or class.

:func:`register_output_recorder` adds new ``output_<name>`` outputs. Their hooks are modelpatch's own (tagged,
picklable callables), installed on the matching modules at registration or, for a class-level registration, the first
time an instance runs; overwriting or unregistering removes them exactly. The registry (:mod:`.replacements`) reports
the name with a recorder that matches no module, so Transformers allocates the output list but installs no hook of its
own for it.

A model whose ``forward`` does not capture outputs itself (no ``@capture_outputs``: task heads such as
``*ForCausalLM``, which build their own output object from the base model's, as ``Qwen2MoeForCausalLM`` copies
``router_logits``) would drop the new field. A model registered as an instance gets a pair of tagged hooks (a
*relay*): the pre-hook opens a collection frame for the ``output_<name>=True`` it was called with (per thread /
asyncio task), the capture hooks of its modules also append there, and the forward hook puts the tuple into the
model's output (appended last when ``return_dict=False``). So ``lm(ids, output_<name>=True).<name>`` holds what
``lm.model`` captures (plus matching modules outside it).

Everything is stored in the instances' ``__dict__``, so it follows ``copy.deepcopy`` and ``pickle``."""

from __future__ import annotations

import threading
import weakref
from contextvars import ContextVar
from typing import Any

import torch.nn as nn
from transformers.utils import output_capturing as _capturing
from transformers.utils.output_capturing import OutputRecorder

from ..errors import ModelpatchKeyError, ModelpatchRuntimeError, ModelpatchTypeError, ModelpatchValueError
from ..lazy_imports import pretrained_model_class
from ..patching.provenance import provenance

__all__ = [
    "register_output_recorder",
    "unregister_output_recorder",
    "OutputRecorder",
    "require_extension",
    "user_recorders",
    "sync_hooks",
]

_lock = threading.RLock()
_USER_ATTR = "_modelpatch_output_recorders"  # {name: (OutputRecorder, ...)} registered on this instance
_HOOKED_ATTR = "_modelpatch_recorders_hooked"  # {name: recorders tuple} whose hooks are installed
_USER_CLASS: weakref.WeakKeyDictionary[type, dict[str, tuple]] = weakref.WeakKeyDictionary()


class _MatchesNoModule(nn.Module):
    """Recorder target for user outputs: Transformers allocates the output list, hooks are ours."""


NO_HOOK = OutputRecorder(target_class=_MatchesNoModule)


def as_list(specs) -> list:
    if specs is None:
        return []
    return list(specs) if isinstance(specs, list) else [specs]


def own_entries(module, attr: str) -> dict:
    return module.__dict__.get(attr) or {}


def user_recorders(model) -> dict[str, tuple]:
    """Class-level then instance-level user recorders for ``model`` (instance entries win)."""
    found: dict[str, tuple] = {}
    for klass in reversed(type(model).__mro__):
        found.update(_USER_CLASS.get(klass, {}))
    found.update(own_entries(model, _USER_ATTR))
    return found


def require_extension() -> None:
    """Raise unless Transformers' recorder registry is modelpatch's extension
    (:class:`~.replacements.InstanceAwareRegistry`, installed by :func:`~.replacements.install_registry_extension`).

    Raises:
        ModelpatchRuntimeError: the extension is uninstalled.
    """
    if not getattr(_capturing._CAN_RECORD_REGISTRY, "merges_modelpatch_recorders", False):
        raise ModelpatchRuntimeError(
            "modelpatch's Transformers integration is uninstalled; call modelpatch.apply.transformers.install()"
        )


def target_and_recorder(name: str, spec):
    """(target class or None, spec as an OutputRecorder) for one recorder spec in any accepted form."""
    if isinstance(spec, OutputRecorder):
        return spec.target_class, spec
    if isinstance(spec, type):
        return spec, OutputRecorder(target_class=spec, index=0 if "hidden_states" in name else 1)
    return None, spec  # a string: matched against module paths, unaffected by class replacement


# -- user recorders --------------------------------------------------------------------------------


class _Frame:
    """One running ``forward`` of a relayed model (see the module docstring) and what it collects."""

    __slots__ = ("collected", "owner")

    def __init__(self, owner: nn.Module, names):
        self.owner = owner
        self.collected: dict[str, list] = {name: [] for name in names}


_FRAMES: ContextVar[tuple[_Frame, ...]] = ContextVar("modelpatch_output_frames", default=())


class _CaptureHook:
    """Forward hook appending ``output[index]`` (or a non-tuple output) to the active ``output_<name>``: the
    list of the running ``@capture_outputs`` forward, and that of every relayed model whose forward is running."""

    def __init__(self, name: str, index: int):
        self.name = name
        self.index = index

    def __call__(self, module, args, output):
        collected = _capturing._active_collector.get()  # noqa: SLF001 - Transformers' output-capturing collector: no public accessor
        frames = _FRAMES.get()
        if not frames and (collected is None or self.name not in collected):
            return
        value = output[self.index] if isinstance(output, tuple) else output
        if value is None:
            return
        if collected is not None and self.name in collected:
            collected[self.name].append(value)
        for frame in frames:
            bucket = frame.collected.get(self.name)
            if bucket is not None:
                bucket.append(value)


def _requested(model: nn.Module, name: str, kwargs: dict) -> bool:
    """Whether a forward called with ``kwargs`` asks for ``output_<name>`` (the argument, else the config), as
    ``@capture_outputs`` reads it."""
    flag = f"output_{name}"
    if flag in kwargs:
        return bool(kwargs[flag])
    return bool(getattr(getattr(model, "config", None), flag, False))


class _RelayStart:
    """Forward pre-hook of a relayed model: opens a frame for the user outputs the call asks for."""

    def __call__(self, module, args, kwargs):
        frames = tuple(f for f in _FRAMES.get() if f.owner is not module)  # one left by a KeyboardInterrupt
        names = [name for name in user_recorders(module) if _requested(module, name, kwargs)]
        if names:
            frames += (_Frame(module, names),)
        if frames != _FRAMES.get():  # closed by _RelayFinish (a forward hook, no token to reset): see there
            _FRAMES.set(frames)


class _RelayFinish:
    """Forward hook of a relayed model (also run when ``forward`` raises): closes its frame and puts each
    collected tuple into the output, unless the output already holds that field."""

    def __call__(self, module, args, kwargs, output):
        frames = _FRAMES.get()
        frame = next((f for f in reversed(frames) if f.owner is module), None)
        if frame is None:
            return None
        _FRAMES.set(tuple(f for f in frames if f is not frame))
        if output is None:  # forward raised
            return None
        for name, values in frame.collected.items():
            if isinstance(output, dict):  # a ModelOutput
                if output.get(name) is None:
                    output[name] = tuple(values)
            elif isinstance(output, tuple):  # return_dict=False: appended last, as to_tuple() places a new field
                output = output + (tuple(values),)
        return output


def _captures_outputs(model_or_class) -> bool:
    """Whether the ``forward`` of ``model_or_class`` is decorated with Transformers' ``@capture_outputs`` (which
    fills ``output_<name>`` fields from the registry itself), looking through ``functools.wraps`` wrappers."""
    func = getattr(model_or_class, "forward", None)
    for _ in range(32):
        if func is None:
            return False
        if getattr(func, "__code__", None) is _CAPTURE_WRAPPER_CODE:
            return True
        func = getattr(func, "__wrapped__", None)
    return False


# every function decorated with @capture_outputs (with or without arguments) runs this one code object
_CAPTURE_WRAPPER_CODE = _capturing.capture_outputs(lambda self: None).__code__


def _install_relay(model: nn.Module) -> None:
    """Give ``model`` (a model that does not capture outputs itself) the relay hooks (idempotent)."""
    if any(isinstance(hook, _RelayStart) for hook in model._forward_pre_hooks.values()):
        return
    model.register_forward_pre_hook(_RelayStart(), with_kwargs=True)
    model.register_forward_hook(_RelayFinish(), with_kwargs=True, always_call=True)


def _remove_relay(model: nn.Module) -> None:
    for hooks, kind, extras in (
        (model._forward_pre_hooks, _RelayStart, ("_forward_pre_hooks_with_kwargs",)),
        (model._forward_hooks, _RelayFinish, ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    ):
        for handle_id, hook in list(hooks.items()):
            if isinstance(hook, kind):
                del hooks[handle_id]
                for extra in extras:
                    getattr(model, extra, {}).pop(handle_id, None)


def _is_or_replaces(module: nn.Module, target: type) -> bool:
    """``module`` is a ``target``, or a replacement of one that does not wrap a ``target`` (whose own hook
    already captures), like the built-in recorders follow replacements (:func:`patch_output_recorders`)."""
    if isinstance(module, target):
        return True
    found = provenance(module)
    return (
        found is not None
        and issubclass(found.original, target)
        and not any(isinstance(m, target) for m in module.modules())
    )


def _matches(rec: OutputRecorder, path: str, module: nn.Module) -> bool:
    if not _is_or_replaces(module, rec.target_class):
        return False
    return rec.layer_name is None or f".{rec.layer_name.strip('.')}." in f".{path}."


def _remove_hooks(model: nn.Module, name: str) -> None:
    for module in model.modules():
        for handle_id, hook in list(module._forward_hooks.items()):
            if isinstance(hook, _CaptureHook) and hook.name == name:
                del module._forward_hooks[handle_id]


def sync_hooks(model: nn.Module, user: dict[str, tuple]) -> None:
    """Make the installed hooks of ``model`` match ``user`` (cheap when nothing changed)."""
    hooked = own_entries(model, _HOOKED_ATTR)
    if all(hooked.get(name) == recorders for name, recorders in user.items()):
        return
    with _lock:
        hooked = dict(own_entries(model, _HOOKED_ATTR))
        for name, recorders in user.items():
            if hooked.get(name) == recorders:
                continue
            _remove_hooks(model, name)
            for path, module in model.named_modules():
                for rec in recorders:
                    if _matches(rec, path, module):
                        module.register_forward_hook(_CaptureHook(name, rec.index))
            hooked[name] = recorders
        model.__dict__[_HOOKED_ATTR] = hooked


def _builtin_names(model_or_class) -> set[str]:
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    names = set(getattr(cls, "_can_record_outputs", None) or {})
    names |= set(dict.get(_capturing._CAN_RECORD_REGISTRY, str(cls)) or {})
    return names


def register_output_recorder(model_or_class, name: str, recorder, *, overwrite: bool = False) -> None:
    """Let ``model(..., output_<name>=True)`` return the outputs ``recorder`` captures, as a tuple.

    Args:
        model_or_class: a ``PreTrainedModel`` instance (applies to it and its sub-models: a task head such as
            ``*ForCausalLM`` returns the field too) or a ``PreTrainedModel`` subclass whose ``forward`` captures
            outputs itself (a base model class such as ``Qwen2MoeModel``; applies to every instance, built before
            or after; a head wrapping such an instance returns the field when the head instance is registered).
        name: the output name; ``output_<name>=True`` turns capture on and ``outputs.<name>`` holds it.
        recorder: an ``OutputRecorder(target_class, index=...)``, an ``nn.Module`` subclass (index 1)
            or a list of those. A module output that is a tuple contributes ``output[index]``; any other
            output is taken whole.
        overwrite: replace an existing registration of ``name`` (its hooks are removed).

    Raises:
        TypeError: ``model_or_class`` is neither a ``PreTrainedModel`` nor a subclass of it; it is a class whose
            ``forward`` does not capture outputs (a task head or an abstract base: its instances could not return
            the field; register on an instance, or on the base model's class); a recorder is not an
            ``OutputRecorder`` with a target class or an ``nn.Module`` subclass.
        ValueError: ``name`` is not a Python identifier, is an output Transformers already records for
            this model (``hidden_states``, ``attentions``, ...), or is registered and ``overwrite`` is false.

    Unlike writing into Transformers' private registry, the entry survives building other models of the
    same class, and ``copy.deepcopy``/``pickle`` of the model. Shapes are those of the recorded module outputs,
    one entry per module call in call order (e.g. ``(num_tokens, top_k)`` per layer for a router's selected
    experts). With ``return_dict=False`` a head appends the tuple last. ``generate`` rejects unknown
    ``output_*`` arguments.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ModelpatchValueError(f"Output recorder name {name!r} must be a Python identifier (used as output_<name>)")
    specs: list = []
    for spec in as_list(recorder):
        target, rec = target_and_recorder(name, spec)
        if target is None or not (isinstance(target, type) and issubclass(target, nn.Module)):
            raise ModelpatchTypeError(
                f"Recorder {spec!r} for output {name!r} must be an OutputRecorder or nn.Module subclass"
            )
        specs.append(rec)
    recorders = tuple(specs)
    owners: list[Any]
    pretrained = pretrained_model_class()
    if isinstance(model_or_class, pretrained):
        owners = [m for m in model_or_class.modules() if isinstance(m, pretrained)]
    elif isinstance(model_or_class, type) and issubclass(model_or_class, pretrained):
        owners = [model_or_class]
        if not _captures_outputs(model_or_class):
            raise ModelpatchTypeError(
                f"register_output_recorder({model_or_class.__name__}, {name!r}, ...): the forward of "
                f"{model_or_class.__name__} does not capture outputs itself (a task head or an abstract base class), "
                "so its instances could not return the field; register on a model instance "
                "(register_output_recorder(model, ...) also covers the head wrapping a base model) or on the class "
                "of the base model (e.g. type(model.model))"
            )
    else:
        raise ModelpatchTypeError(
            f"register_output_recorder needs a PreTrainedModel instance or subclass, got {model_or_class!r}"
        )
    for owner in owners:
        if name in _builtin_names(owner):
            raise ModelpatchValueError(
                f"{name!r} is an output {getattr(owner, '__name__', type(owner).__name__)} already records; "
                "choose another name"
            )
    require_extension()
    with _lock:
        if isinstance(model_or_class, type):
            existing = _USER_CLASS.get(model_or_class, {})
            if name in existing and not overwrite:
                raise ModelpatchValueError(
                    f"Output recorder {name!r} is already registered for {model_or_class.__name__}; pass overwrite=True"
                )
            _USER_CLASS[model_or_class] = {**existing, name: recorders}
            return
        taken = [o for o in owners if name in own_entries(o, _USER_ATTR)]
        if taken and not overwrite:
            raise ModelpatchValueError(
                f"Output recorder {name!r} is already registered on this model; pass overwrite=True"
            )
        for owner in owners:
            owner.__dict__[_USER_ATTR] = {**own_entries(owner, _USER_ATTR), name: recorders}
            if not _captures_outputs(owner):
                _install_relay(owner)
        sync_hooks(model_or_class, {name: recorders})


def unregister_output_recorder(model_or_class, name: str) -> None:
    """Remove an entry added by :func:`register_output_recorder` and its hooks.

    Raises:
        KeyError: ``name`` is not registered for ``model_or_class``.
    """
    with _lock:
        if isinstance(model_or_class, type):
            entries = _USER_CLASS.get(model_or_class, {})
            if name not in entries:
                raise ModelpatchKeyError(f"No output recorder {name!r} registered for {model_or_class.__name__}")
            _USER_CLASS[model_or_class] = {k: v for k, v in entries.items() if k != name}
            return  # hooks left on instances are inert: the registry no longer reports the name
        owners = [m for m in model_or_class.modules() if name in own_entries(m, _USER_ATTR)]
        if not owners:
            raise ModelpatchKeyError(f"No output recorder {name!r} registered for {type(model_or_class).__name__}")
        for owner in owners:
            owner.__dict__[_USER_ATTR] = {k: v for k, v in own_entries(owner, _USER_ATTR).items() if k != name}
            if not owner.__dict__[_USER_ATTR]:
                _remove_relay(owner)
        _remove_hooks(model_or_class, name)
        for module in model_or_class.modules():
            if name in own_entries(module, _HOOKED_ATTR):
                module.__dict__[_HOOKED_ATTR] = {
                    k: v for k, v in own_entries(module, _HOOKED_ATTR).items() if k != name
                }
