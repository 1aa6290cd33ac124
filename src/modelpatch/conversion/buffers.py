"""After a load: the non-persistent buffers a replacement's ``__init__`` adds get its values.

``from_pretrained`` builds the model on ``meta`` and re-creates every non-persistent buffer with ``torch.empty_like``
(zeros on the non-zero ranks of an FSDP ``cpu_ram_efficient_loading`` load); Transformers' own buffers are then filled
by the model's ``_init_weights`` (class-specific code, e.g. the rotary ``inv_freq``), but a buffer that a replacement
class adds is not: it would hold whatever that memory held. :func:`restore_nonpersistent_buffers` rebuilds each such
replacement with the arguments it was built with (parameters on ``meta``, buffers on the CPU) and copies its buffers;
a buffer the original class has under the same name (a subclass of a rotary embedding: ``inv_freq``) gets the
original's value, the one unpatched Transformers gives it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..patching.interception import unhooked_init
from ..patching.provenance import Replacement, provenance
from ..undo import context_set
from .errors import ConversionError

__all__ = ["restore_nonpersistent_buffers", "BufferRestoreError"]


class BufferRestoreError(ConversionError):
    """A replacement's non-persistent buffer could not be given the value its ``__init__`` computes."""


_PARAMS_ON_META: contextvars.ContextVar[bool] = contextvars.ContextVar("modelpatch_params_on_meta", default=False)


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or not _PARAMS_ON_META.get() or param.device.type == "meta":
        return None
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered in this context (this thread / task only) are moved to ``meta``; buffers stay real."""
    handle = register_module_parameter_registration_hook(_to_meta)  # type: ignore[arg-type]  # may return one
    try:
        with context_set(_PARAMS_ON_META, True):
            yield
    finally:
        handle.remove()


def _added_buffers(module: nn.Module) -> list[str]:
    """Non-persistent buffers of ``module``'s tree (relative names), not descending into nested replacements (each
    of them is rebuilt on its own: rebuilding this one outside the patch scopes builds their originals)."""
    found: list[str] = []
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, sub = stack.pop()
        for name in sub._non_persistent_buffers_set:
            if sub._buffers.get(name) is not None:
                found.append(prefix + name)
        for child_name, child in sub._modules.items():
            if child is not None and provenance(child) is None:
                stack.append((f"{prefix}{child_name}.", child))
    return found


def restore_nonpersistent_buffers(model: nn.Module) -> None:
    """Give the non-persistent buffers of each replacement module (its own and those of its submodules that are not
    replacements themselves) the value its ``__init__`` computes with the arguments it was built with, in the dtype
    and on the device the load gave them; a buffer its original class has under the same name gets the original
    class's value (what Transformers gives it unpatched).

    Called when ``from_pretrained`` returns. Costs one walk over the modules when no replacement has a non-persistent
    buffer; else one build per such replacement (parameters on ``meta``).

    Raises:
        BufferRestoreError: a buffer cannot be recomputed (the replacement's ``__init__`` fails with the arguments it
            was built with, the buffer comes out on ``meta`` or with another shape); names the module, class, buffer.
    """
    for path, module in model.named_modules():
        record = provenance(module)
        if record is None or record.via != "build":
            continue
        names = _added_buffers(module)
        if names:
            _restore(path, module, record, names)


def _fresh_buffers(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The buffers of ``cls(*args, **kwargs)`` built outside every patch scope, parameters on ``meta``."""

    def build() -> nn.Module:
        fresh: Any = cls.__new__(cls)  # type: ignore[call-overload]
        with torch.device("cpu"), _parameters_on_meta():
            unhooked_init(cls)(fresh, *args, **kwargs)
        return fresh

    return dict(contextvars.Context().run(build).named_buffers())


def _restore(path: str, module: nn.Module, record: Replacement, names: list[str]) -> None:
    """Buffers the original class has under the same name get the original's ``__init__`` value (what Transformers'
    ``_init_weights`` gives the classes it knows, whatever the subclass is called); the others the replacement's."""
    args, kwargs = record.arguments
    cls = record.replacement
    where = f"'{path}' ({cls.__qualname__} replacing {record.original.__qualname__})"
    targets = {name: module.get_buffer(name) for name in names}
    try:
        inherited = _fresh_buffers(record.original, args, kwargs)
    except Exception:  # noqa: BLE001 - then every buffer takes the replacement's value
        inherited = {}
    values = {
        name: inherited[name]
        for name, target in targets.items()
        if name in inherited and inherited[name].device.type != "meta" and inherited[name].shape == target.shape
    }
    if len(values) < len(targets):
        try:
            own = _fresh_buffers(cls, args, kwargs)
        except Exception as exc:
            raise BufferRestoreError(
                f"modelpatch: cannot compute the non-persistent buffer(s) {sorted(set(names) - set(values))} of "
                f"{where}: rebuilding it with the arguments it was built with ({len(args)} positional, keywords "
                f"{sorted(kwargs)}; parameters on meta) failed with {type(exc).__name__}: {exc}. from_pretrained "
                "leaves such buffers uninitialised; register them as persistent (saved with the checkpoint) or make "
                "the __init__ run again with these arguments."
            ) from exc
        for name, target in targets.items():
            if name in values:
                continue
            value = own.get(name)
            if value is None or value.device.type == "meta" or value.shape != target.shape:
                got = (
                    "no such buffer" if value is None else f"a {value.device.type} tensor of shape {tuple(value.shape)}"
                )
                raise BufferRestoreError(
                    f"modelpatch: cannot compute the non-persistent buffer '{name}' of {where}: rebuilding the module "
                    f"(parameters on meta) gave {got}, the model holds shape {tuple(target.shape)}. from_pretrained "
                    "leaves such buffers uninitialised; compute it from the constructor arguments, not from "
                    "parameters, or register it as persistent."
                )
            values[name] = value
    with torch.no_grad():
        for name, target in targets.items():
            if target.device.type != "meta":  # meta: offloaded, Transformers materialises it elsewhere
                target.copy_(values[name].to(dtype=target.dtype))
