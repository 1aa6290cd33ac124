"""Class interception: how an original class constructs its replacement, for the asking code only.

``transformers.monkey_patching`` rebinds module globals (``modeling_llama.LlamaAttention = Custom``)
for the whole process while a model is built; every other thread sees the patch, an exception leaks
it, and the model's own ``isinstance(module, LlamaAttention)`` checks suddenly test for ``Custom``.

modelpatch never rebinds anything. While at least one scope targets a class, that class gets a
``__new__`` (the *hook*) that asks the caller's scopes (a :class:`contextvars.ContextVar`, so per
thread and per asyncio task) whether it is replaced:

* not replaced -> the class's own ``__new__`` runs, as if the hook were not there;
* replaced by a subclass of the original -> an uninitialised replacement instance is returned and
  Python's ``type.__call__`` runs the replacement's ``__init__`` with the original arguments;
* replaced by an unrelated class -> ``replacement(*args, **kwargs)`` is built and returned as is
  (``type.__call__`` skips ``__init__`` for an object that is not an instance of the original).

Because the construction itself is intercepted, it does not matter how modeling code reaches the class
(module global, a module-level table such as GPT-Neo's ``GPT_NEO_ATTENTION_CLASSES``, an attribute).

What stays behind: a class that some scope once targeted keeps its (inert) hook for the rest of the
process. Outside every scope the hook only reads an empty context variable and allocates exactly as
the class's own ``__new__`` would; module attributes, class identity, ``isinstance`` and
``inspect.signature`` are unchanged. (Removing a ``__new__`` again is not possible in CPython without
breaking the class: ``del cls.__new__`` leaves the type's ``tp_new`` slot pointing at the generic
slot function, after which ``object.__new__`` rejects constructor arguments.)
"""

from __future__ import annotations

import copyreg
import inspect
import sys
import threading
from collections.abc import Callable
from contextvars import ContextVar

__all__ = ["install_hook", "hooked_classes", "original_new"]

# (original class -> replacement) pairs whose replacement is being constructed in this context: the
# replacement may build the original it wraps, which must then be the original.
_BUILDING: ContextVar[frozenset] = ContextVar("modelpatch_building", default=frozenset())

_lock = threading.Lock()
_hooked: dict[type, None] = {}
# ``copy``/``pickle`` allocate through ``cls.__new__(cls)`` from these functions: never a construction.
_UNPICKLING_CODE = {copyreg.__newobj__.__code__, copyreg.__newobj_ex__.__code__}

Lookup = Callable[[type], "tuple[type, Callable[[object], None]] | None"]


def _is_hook(candidate: object) -> bool:
    func = getattr(candidate, "__func__", candidate)
    return getattr(func, "_modelpatch_hook", False)


def original_new(cls: type, args: tuple, kwargs: dict) -> object:
    """Allocate ``cls`` with the first ``__new__`` in its MRO that is not a modelpatch hook."""
    for klass in cls.__mro__:
        new = vars(klass).get("__new__")
        if new is None or _is_hook(new):
            continue
        if new is object.__new__:
            return object.__new__(cls)
        func = new.__func__ if isinstance(new, staticmethod) else new
        return func(cls, *args, **kwargs)
    return object.__new__(cls)


def _make_hook(target: type, lookup: Lookup):
    def __new__(cls, *args, **kwargs):
        if cls is target and target not in _BUILDING.get() and sys._getframe(1).f_code not in _UNPICKLING_CODE:
            found = lookup(target)
            if found is not None:
                replacement, on_built = found
                if issubclass(replacement, target):
                    obj = original_new(replacement, args, kwargs)  # type.__call__ runs replacement.__init__
                else:
                    token = _BUILDING.set(_BUILDING.get() | {target})
                    try:
                        obj = replacement(*args, **kwargs)
                    finally:
                        _BUILDING.reset(token)
                on_built(obj)
                return obj
        return original_new(cls, args, kwargs)

    __new__._modelpatch_hook = True
    __new__.__qualname__ = f"{target.__qualname__}.__new__"
    try:  # keep inspect.signature(target) what it was: it prefers a class's own __new__ over __init__
        __new__.__signature__ = inspect.signature(target.__init__)
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        pass
    return staticmethod(__new__)


def install_hook(target: type, lookup: Lookup) -> None:
    """Make ``target`` consult ``lookup`` on construction (idempotent; the hook stays, inert)."""
    if target in _hooked:
        return
    with _lock:
        if target in _hooked:
            return
        type.__setattr__(target, "__new__", _make_hook(target, lookup))
        _hooked[target] = None


def hooked_classes() -> list[type]:
    """Classes that carry a hook (for tests and diagnostics)."""
    return list(_hooked)
