"""Class interception: how an original class constructs its replacement, for the asking code only.

``transformers.monkey_patching`` rebinds module globals (``modeling_llama.LlamaAttention = Custom``)
for the whole process while a model is built; every other thread sees the patch, an exception leaks
it, and the model's own ``isinstance(module, LlamaAttention)`` checks suddenly test for ``Custom``.

modelpatch never rebinds a module attribute. While at least one scope targets a class, that class's
``__init__`` is wrapped by a *hook* that asks the caller's scopes (a :class:`contextvars.ContextVar`,
so per thread and per asyncio task) whether the class is replaced:

* not replaced -> the original ``__init__`` runs, untouched;
* replaced -> the freshly allocated instance becomes an instance of the replacement
  (``__class__`` assignment; both are plain ``nn.Module`` subclasses) and the replacement's
  ``__init__`` runs with the original arguments. A subclass replacement's ``super().__init__`` then
  reaches the original ``__init__`` as usual; an unrelated replacement may even build the original
  class it wraps (that inner construction is not intercepted again).

Because construction itself is intercepted, it does not matter how modeling code reaches the class
(module global, a module-level table such as GPT-Neo's ``GPT_NEO_ATTENTION_CLASSES``, an attribute).
``copy``/``pickle`` never call ``__init__``, so they are never redirected. Hooks are reference
counted; when the last scope that needs a hook exits, the class's ``__dict__`` is restored exactly
(the original function object, or no ``__init__`` entry if the class had none).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from ..errors import ModelpatchTypeError
from ..undo import UndoStack, context_set
from .upstream import is_upstream_fused, record_fusion_conflict

__all__ = ["install_hook", "uninstall_hook", "hooked_classes", "unhooked_init", "defining_init"]

# Original classes whose replacement is being built in this context: a replacement may build the
# original it wraps, which must then be the original.
_BUILDING: ContextVar[frozenset] = ContextVar("modelpatch_building", default=frozenset())

_lock = threading.Lock()
# target -> [refcount, UndoStack holding the hook's installation, target.__init__ before hooking]
_hooks: dict[type, list] = {}

Lookup = Callable[[type], "tuple[type, Callable[[object, tuple[Any, ...], dict[str, Any]], None]] | None"]


def _make_hook(target: type, lookup: Lookup, original_init):
    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        if type(self) is target and target not in _BUILDING.get():
            found = lookup(target)
            if found is not None:
                replacement, on_built = found
                try:
                    object.__setattr__(self, "__class__", replacement)
                except TypeError as exc:
                    raise ModelpatchTypeError(
                        f"modelpatch cannot build {replacement.__qualname__} in place of {target.__qualname__}: "
                        f"{exc} (a replacement must be a plain nn.Module subclass without __slots__)"
                    ) from None
                try:
                    with context_set(_BUILDING, _BUILDING.get() | {target}):
                        unhooked_init(replacement)(self, *args, **kwargs)
                except BaseException as exc:
                    if hasattr(exc, "add_note"):
                        exc.add_note(
                            f"modelpatch: raised while building {replacement.__qualname__} in place of "
                            f"{target.__qualname__}; a replacement is called with the original's arguments "
                            f"({len(args)} positional, keywords {sorted(kwargs)})"
                        )
                    raise
                on_built(self, args, kwargs)
                return
        elif type(self) is not target and target not in _BUILDING.get() and is_upstream_fused(type(self)):
            # Transformers' fusion (fusion_config) builds its Fused<target> subclass in target's place: a scope
            # replacing target would be silently lost; the running build raises it when it ends
            found = lookup(target)
            if found is not None:
                record_fusion_conflict(target, found[0], type(self))
        original_init(self, *args, **kwargs)

    __init__._modelpatch_hook = True  # type: ignore[attr-defined]  # noqa: SLF001 - our own mark on a function object
    return __init__


def unhooked_init(cls: type):
    """``cls.__init__`` as defined, skipping a modelpatch hook on ``cls`` itself (a replacement that is
    also a target in some scope is built as itself, so swaps such as A -> B, B -> A work)."""
    entry = _hooks.get(cls)
    return entry[2] if entry is not None else cls.__init__  # type: ignore[misc]  # the class's own, unbound


# Free variables under which a decorator's ``__init__`` wrapper keeps the ``__init__`` it wraps without
# ``functools.wraps``: the ``kernels`` library's ``use_kernelized_func`` (Transformers decorates attention classes
# with it when ``kernels`` is installed) replaces ``cls.__init__`` by ``new_init(self, *args, **kwargs)``.
_WRAPPED_INIT_NAMES = ("orig_init",)


def defining_init(init: Callable[..., Any]) -> Callable[..., Any]:
    """The ``__init__`` function that defines the signature and the code of ``init``: through ``functools.wraps``
    (``__wrapped__``, modelpatch's hooks included) and through decorators that keep the wrapped ``__init__`` in a
    closure without it (:data:`_WRAPPED_INIT_NAMES`). ``init`` itself when it wraps nothing."""
    seen: set[int] = set()
    while id(init) not in seen:
        seen.add(id(init))
        inner = getattr(init, "__wrapped__", None)
        code = getattr(init, "__code__", None)
        if inner is None and code is not None and init.__closure__ is not None:
            cells = dict(zip(code.co_freevars, init.__closure__))
            for name in _WRAPPED_INIT_NAMES:
                try:
                    candidate = cells[name].cell_contents if name in cells else None
                except ValueError:  # an empty cell
                    candidate = None
                if callable(candidate):
                    inner = candidate
                    break
        if inner is None:
            return init
        init = inner
    return init


def install_hook(target: type, lookup: Lookup) -> None:
    """Make ``target`` consult ``lookup`` on construction (reference counted)."""
    with _lock:
        entry = _hooks.get(target)
        if entry is not None:
            entry[0] += 1
            return
        original_init = target.__init__  # type: ignore[misc]  # the class's own, unbound
        undo = UndoStack()
        undo.setattr(target, "__init__", _make_hook(target, lookup, original_init), raw=True)
        _hooks[target] = [1, undo, original_init]


def uninstall_hook(target: type) -> None:
    """Drop one reference; the last one restores ``target.__dict__`` exactly."""
    with _lock:
        entry = _hooks.get(target)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] > 0:
            return
        del _hooks[target]
        entry[1].undo()  # the class __dict__ as before: its own __init__ back, or none if it had none


def hooked_classes() -> dict[type, int]:
    """Classes that currently carry a hook, with the number of scopes that need it."""
    with _lock:
        return {cls: entry[0] for cls, entry in _hooks.items()}
