"""One undo primitive for temporary changes to objects: :class:`UndoStack`.

Modelled on pytest's ``MonkeyPatch``: every change is pushed as ``(target, name, previous value or
ABSENT)`` and :meth:`UndoStack.undo` restores them in reverse order, deleting what was absent before.
Used as a context manager it undoes on any exit (normal, exception, ``KeyboardInterrupt``). Attributes
can be set through the object's own ``__setattr__`` (instances of ``nn.Module``: parameters, submodules)
or written raw into its ``__dict__`` (``raw=True``: class dictionaries, instance attributes that must
not go through ``nn.Module.__setattr__``), and dict items can be changed the same way. Two more kinds of
entry fold in what would otherwise be a hand-written save/restore pair: :meth:`UndoStack.callback` (any
clean-up call, as ``contextlib.ExitStack.callback``) and :meth:`UndoStack.wrap` (a wrapper installed on
another library's function, taken off only while it is still the one installed). :func:`context_set` (and
:meth:`UndoStack.set_context`) is the same for a ``contextvars.ContextVar``: set for a block in this thread / asyncio
task, reset on any exit.

modelpatch uses it wherever it changes an object for a while and must put it back exactly: the
``__init__`` hooks of class interception, router instances during routing record/replay, and the
``PreTrainedModel`` wrappers installed at import (whose ``uninstall()`` is an undo).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, MutableMapping
from contextvars import ContextVar
from typing import Any, NamedTuple, TypeVar

from .errors import ModelpatchRuntimeError, ModelpatchTypeError

__all__ = ["ABSENT", "UndoStack", "context_set"]

_K = TypeVar("_K")
_V = TypeVar("_V")
_F = TypeVar("_F", bound=Callable[..., Any])

# undo() runs again what callbacks pushed while it ran; a callback that pushes at every round never ends
MAX_UNDO_ROUNDS = 100


class _Absent:
    """Marker for "the attribute/key did not exist before the change"."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"

    def __reduce__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


class UndoStack:
    """A stack of temporary changes to objects, undone in reverse order.

    Example::

        with UndoStack() as undo:
            undo.setattr(router, "forward", replay_forward)   # router.forward is back after the block
            undo.setitem(config.__dict__, "use_cache", False)

    Every method records the previous state *before* changing anything, so a change that raises leaves
    nothing to undo for it. Undo puts every value back where it was: the same position in a dict (and in an
    ``nn.Module``'s tables, whose order is the order of ``parameters()`` / ``state_dict()``), the same table of a
    module (parameter, buffer, persistent or not, submodule, plain attribute), or absent.

    Thread safety: changes may be pushed from several threads at once, and :meth:`undo` may run in any thread,
    with one limit: an entry of :meth:`set_context` must be undone in the context (thread / asyncio task) that set
    it, as ``ContextVar.reset`` requires; undone elsewhere it raises :class:`~modelpatch.errors.ModelpatchRuntimeError`
    naming the variable (after every other entry has been undone). The stack can be undone, then reused.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes: list[tuple[str, object, object, object]] = []

    # -- changes ---------------------------------------------------------------------------------------
    def setattr(self, target: object, name: str, value: object, *, raw: bool = False) -> None:
        """Set ``target.name = value``; undo restores the previous value or deletes the attribute.

        The previous value is the target's *own* one (its ``__dict__``, or for an ``nn.Module`` its
        parameters, buffers and submodules): an attribute that was only inherited from the class (a
        method such as ``forward``) is undone by deleting the instance attribute, never by copying the
        bound method onto the instance.

        ``raw=True`` reads and writes ``vars(target)`` directly (``type.__setattr__`` for classes,
        ``object.__setattr__`` for instances), bypassing a custom ``__setattr__``; the previous value is
        then the one *in the object's own dict*, so an inherited attribute is undone by deleting the own one.

        A name the class defines as a data descriptor (a ``property`` with a setter, such as
        ``PretrainedConfig.num_labels``) is read with ``getattr`` and undone by setting the previous value back
        through the descriptor.

        On an ``nn.Module`` the value may change kind (a buffer replaced by a parameter, a plain attribute by a
        submodule): undo puts the previous value back in the table that held it, at its position, and takes the
        name out of the others.

        Raises:
            AttributeError: ``name`` is a data descriptor whose current value cannot be read (nothing is set).
        """
        if raw:
            previous = type(target) if name == "__class__" else vars(target).get(name, ABSENT)
            _raw_set(target, name, value)
            kind = "raw"
        else:
            kind, previous = _record_own(target, name)
            setattr(target, name, value)
        with self._lock:
            self._changes.append((kind, target, name, previous))

    def setattrs_raw(self, target: object, values: dict[str, object]) -> None:
        """``setattr(target, name, value, raw=True)`` for every item of ``values``, in order, recorded as one batch
        (what a block does to each module it drives, at every block). Not for classes or ``__class__``.

        Raises:
            TypeError: ``target`` is a class (use :meth:`setattr`).
        """
        if isinstance(target, type):
            raise TypeError(f"setattrs_raw sets instance attributes; {target!r} is a class: use setattr")
        own = vars(target)
        batch = []
        try:
            for name, value in values.items():
                previous = own.get(name, ABSENT)
                object.__setattr__(target, name, value)
                batch.append(("raw", target, name, previous))
        finally:  # what was set is undone with the rest
            with self._lock:
                self._changes.extend(batch)

    def delattr(self, target: object, name: str, *, raw: bool = False) -> None:
        """Delete ``target.name`` (which must exist); undo sets it back (an ``nn.Module``'s parameter, buffer or
        submodule at its position in its table).

        Raises:
            AttributeError: ``target`` has no such own attribute (``raw=True``: none in ``vars(target)``).
        """
        if raw:
            previous = vars(target).get(name, ABSENT)
            if previous is ABSENT:
                raise AttributeError(f"{_describe(target)} has no attribute {name!r} in its own dict to delete")
            _raw_del(target, name)
            kind = "raw"
        else:
            if _own_value(target, name) is ABSENT:
                raise AttributeError(f"{type(target).__name__!r} object has no own attribute {name!r} to delete")
            kind, previous = _record_own(target, name)
            delattr(target, name)
        with self._lock:
            self._changes.append((kind, target, name, previous))

    def setitem(self, mapping: MutableMapping[_K, _V], key: _K, value: _V) -> None:
        """Set ``mapping[key] = value``; undo restores the previous value (at its position in the mapping's order,
        should the key have been deleted meanwhile) or deletes the key."""
        previous = mapping.get(key, ABSENT)
        index = None if previous is ABSENT else _index(mapping, key)
        mapping[key] = value
        with self._lock:
            self._changes.append(("item", mapping, key, (previous, index)))

    def delitem(self, mapping: MutableMapping[_K, Any], key: _K) -> None:
        """Delete ``mapping[key]`` if present; undo sets it back at its position in the mapping's order."""
        if key not in mapping:
            return
        index = _index(mapping, key)
        previous = mapping.pop(key)
        with self._lock:
            self._changes.append(("item", mapping, key, (previous, index)))

    def callback(self, fn: _F, /, *args: Any, **kwargs: Any) -> _F:
        """Call ``fn(*args, **kwargs)`` when the stack is undone, in its place among the other entries (the last
        pushed runs first), as ``contextlib.ExitStack.callback`` does. Returns ``fn``."""
        with self._lock:
            self._changes.append(("call", fn, args, kwargs))
        return fn

    def set_context(self, var: ContextVar[_V], value: _V) -> None:
        """Set the context variable ``var`` to ``value`` now (this thread / asyncio task) and reset it to what it held
        before at undo, in its place among the other entries (``var.set`` then ``var.reset(token)``).

        The reset must run in the same context (thread / asyncio task) as this call: a ``ContextVar`` token cannot be
        used in another one. Undone elsewhere, this entry raises :class:`~modelpatch.errors.ModelpatchRuntimeError`
        naming ``var`` (the variable keeps ``value`` in this context); the other entries are undone all the same.
        """
        self.callback(_reset_context, var, var.set(value))

    def enter_context(self, manager: Any) -> Any:
        """Enter the context manager ``manager`` now and exit it at undo, in its place among the other entries (as
        ``contextlib.ExitStack.enter_context``, except that its ``__exit__`` is always called with ``None`` s: the
        undo runs after the ``with`` body, whatever ended it). Returns what ``__enter__`` returned."""
        result = manager.__enter__()
        self.callback(manager.__exit__, None, None, None)
        return result

    def wrap(
        self,
        owner: object,
        name: str,
        wrapper: object = None,
        *,
        factory: Callable[[Any], object] | None = None,
        raw: bool = False,
    ) -> Any:
        """Install a wrapper at ``owner.name``; undo puts the original back only if the wrapper is still there.

        Give the wrapper itself, or ``factory``: called with the original, it returns the wrapper (exactly one of
        the two). Without ``raw`` the original is ``getattr(owner, name)`` (a bound method for an instance) and
        undo restores the owner's own value as :meth:`setattr` does (an inherited attribute: the own one is
        deleted). ``raw=True`` reads and writes ``vars(owner)`` (a class dictionary: a ``classmethod`` or plain
        function object is replaced as it is stored, not as attribute access binds it; an inherited attribute is
        not there to wrap).

        "Still ours": another library may install its own wrapper on top after this one (typically a function that
        calls what it found, i.e. ours). If at undo ``owner.name`` is no longer the object installed here, undo
        leaves it as it is: restoring the original would drop the other wrapper, while leaving it keeps its chain
        valid (it still reaches the original through ours). If the other party takes its wrapper off first, ours is
        on top again and undo restores the original.

        Returns:
            The original (what ``owner.name`` held before), for the wrapper to call.

        Raises:
            ModelpatchTypeError: neither or both of ``wrapper`` and ``factory`` given.
            AttributeError: ``owner`` has no attribute ``name`` (nothing to wrap); nothing is changed.
        """
        if (wrapper is None) == (factory is None):
            raise ModelpatchTypeError(f"UndoStack.wrap({name!r}): give exactly one of wrapper= and factory=")
        original = vars(owner).get(name, ABSENT) if raw else getattr(owner, name, ABSENT)
        if original is ABSENT:
            raise AttributeError(f"{_describe(owner)} has no attribute {name!r} to wrap")
        own = ("raw", original) if raw else _record_own(owner, name)
        installed = factory(original) if factory is not None else wrapper
        if raw:
            _raw_set(owner, name, installed)
        else:
            setattr(owner, name, installed)
        with self._lock:
            self._changes.append(("wrap", owner, name, (installed, own)))
        return original

    # -- undo ------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._changes)

    def undo(self) -> None:
        """Restore every change and run every callback in reverse order; the stack is empty afterwards.

        Every entry is undone even if one of them raises; the first error is raised at the end. What a callback
        pushes while undo runs is undone too (after the entries already there), round after round until the stack is
        empty.

        Raises:
            ModelpatchRuntimeError: callbacks still push entries after ``MAX_UNDO_ROUNDS`` (100) rounds; the entries
                left are kept on the stack, not run. Also raised by a :meth:`set_context` entry undone in another
                context.
        """
        error: BaseException | None = None
        for _ in range(MAX_UNDO_ROUNDS):
            with self._lock:
                changes, self._changes = self._changes, []
            if not changes:
                break
            for kind, target, name, previous in reversed(changes):
                try:
                    _restore(kind, target, name, previous)
                except BaseException as exc:  # noqa: BLE001 - keep undoing the rest; the first error is raised below
                    error = error or exc
        else:
            with self._lock:
                left = len(self._changes)
            if left:
                error = error or ModelpatchRuntimeError(
                    f"UndoStack.undo: callbacks still pushed changes after {MAX_UNDO_ROUNDS} rounds of undo (a callback "
                    f"that pushes a change at every undo?); {left} entries are left on the stack, not undone"
                )
        if error is not None:
            raise error

    def __enter__(self) -> UndoStack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def __getstate__(self) -> dict[str, Any]:
        """The changes without the lock (``copy.deepcopy`` / ``pickle`` of an object holding the stack)."""
        with self._lock:
            return {"_changes": list(self._changes)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._changes = list(state["_changes"])


@contextlib.contextmanager
def context_set(var: ContextVar[_V], value: _V) -> Iterator[_V]:
    """``with context_set(var, value):`` the context variable ``var`` holds ``value`` inside the block, in this thread
    / asyncio task only; on any exit it is reset to what it held before (``ContextVar.reset`` with the token of the
    ``set``). Yields ``value``.

    The block must be entered and exited in the same context (thread / asyncio task): a ``ContextVar`` token cannot be
    reset in another one.

    Raises:
        ModelpatchRuntimeError: the block is exited in another context than the one that entered it (names ``var``).
    """
    token = var.set(value)
    try:
        yield value
    finally:
        _reset_context(var, token)


def _reset_context(var: ContextVar[Any], token: Any) -> None:
    try:
        var.reset(token)
    except ValueError as error:  # "<Token ...> was created in a different Context": a token is bound to its context
        raise ModelpatchRuntimeError(
            f"cannot reset the context variable {var.name!r} here: it was set in another context (thread / asyncio "
            f"task), and must be reset (undone) in the context that set it ({error})"
        ) from error


# nn.Module keeps parameters, buffers and submodules in three tables outside the attribute dict. undo.py is at the
# bottom layer and does not import torch: a module is recognised by these tables (duck typing).
_MODULE_TABLES = ("_parameters", "_buffers", "_modules")


class _Slot(NamedTuple):
    """Where a module held an attribute: its value, the table ("__dict__" or one of ``_MODULE_TABLES``), the position
    in that table and, for a buffer, whether it was persistent (not in ``_non_persistent_buffers_set``)."""

    value: object
    table: str
    position: int
    persistent: bool


def _is_module(target: object) -> bool:
    own = getattr(target, "__dict__", None)
    return (
        not isinstance(target, type)
        and isinstance(own, dict)
        and all(isinstance(own.get(table), dict) for table in _MODULE_TABLES)
    )


def _module_table(target: object, table: str) -> dict[str, Any]:
    own: dict[str, Any] = vars(target)
    return own if table == "__dict__" else own[table]


def _module_slot(target: object, name: str) -> _Slot | Any:
    """Where the module ``target`` holds ``name`` now (looked up as ``nn.Module`` does: its dict first), or ABSENT."""
    for table in ("__dict__", *_MODULE_TABLES):
        values = _module_table(target, table)
        if name in values:
            persistent = name not in vars(target).get("_non_persistent_buffers_set", ())
            return _Slot(values[name], table, _index(values, name), table != "_buffers" or persistent)
    return ABSENT


def _restore_module(target: object, name: str, previous: _Slot | Any) -> None:
    """Put ``previous`` back in its table at its position and take ``name`` out of every other table (all of them
    when it was absent, which is a no-op when it still is)."""
    for table in ("__dict__", *_MODULE_TABLES):
        if previous is ABSENT or table != previous.table:
            _module_table(target, table).pop(name, None)
    non_persistent = vars(target).get("_non_persistent_buffers_set")
    if isinstance(non_persistent, set):
        if previous is not ABSENT and previous.table == "_buffers" and not previous.persistent:
            non_persistent.add(name)
        else:
            non_persistent.discard(name)
    if previous is not ABSENT:
        _insert_at(_module_table(target, previous.table), name, previous.value, previous.position)


def _record_own(target: object, name: str) -> tuple[str, object]:
    """The kind of entry and the previous state to record before ``setattr`` / ``delattr`` (not raw) of ``name``."""
    if name != "__class__" and _is_module(target) and not _is_data_descriptor(target, name):
        return "module", _module_slot(target, name)
    previous = _own_value(target, name)
    if previous is ABSENT and _is_data_descriptor(target, name):
        previous = _descriptor_value(target, name)
    return "attr", previous


def _index(mapping: MutableMapping[Any, Any], key: object) -> int:
    return list(mapping).index(key)


def _insert_at(mapping: MutableMapping[Any, Any], key: object, value: object, index: int | None) -> None:
    """``mapping[key] = value``, with a key that is not there inserted at position ``index`` of the mapping's order
    (the keys after it are taken out and put back after it)."""
    if key in mapping or index is None or index >= len(mapping):
        mapping[key] = value
        return
    after = [(other, mapping.pop(other)) for other in list(mapping)[index:]]
    mapping[key] = value
    for other, other_value in after:
        mapping[other] = other_value


def _own_value(target: object, name: str) -> object:
    if name == "__class__":
        return type(target)
    own = getattr(target, "__dict__", None)
    if own is None:  # __slots__ objects: no inheritance question to answer
        return getattr(target, name, ABSENT)
    if name in own:
        return own[name]
    for store in ("_parameters", "_buffers", "_modules"):  # nn.Module keeps these outside __dict__
        table = own.get(store)
        if isinstance(table, dict) and name in table:
            return table[name]
    return ABSENT


def _is_data_descriptor(target: object, name: str) -> bool:
    """Whether the class of ``target`` defines ``name`` as a data descriptor (``__set__``: a property)."""
    if isinstance(target, type):
        return False  # class attributes: the metaclass rarely defines descriptors; set and deleted as own values
    for klass in type(target).__mro__:
        if name in vars(klass):
            return hasattr(type(vars(klass)[name]), "__set__")
    return False


def _descriptor_value(target: object, name: str) -> object:
    try:
        return getattr(target, name)
    except AttributeError as error:
        raise AttributeError(
            f"cannot record the previous value of {type(target).__name__}.{name} (a data descriptor) to undo "
            f"setting it: reading it raised {error}"
        ) from error


def _raw_set(target: object, name: str, value: object) -> None:
    if isinstance(target, type):
        type.__setattr__(target, name, value)
    else:
        object.__setattr__(target, name, value)


def _raw_del(target: object, name: str) -> None:
    if isinstance(target, type):
        type.__delattr__(target, name)
    else:
        object.__delattr__(target, name)


def _describe(owner: object) -> str:
    if isinstance(owner, type):
        return f"class {owner.__qualname__}"
    module_name = getattr(owner, "__name__", None)
    if isinstance(module_name, str):
        return f"{type(owner).__name__} {module_name!r}"
    return f"{type(owner).__name__!r} object"


def _restore(kind: str, target: Any, name: Any, previous: Any) -> None:
    if kind == "call":
        target(*name, **previous)
    elif kind == "wrap":
        installed, (own_kind, own) = previous
        current = vars(target).get(name, ABSENT) if own_kind == "raw" else _own_value(target, name)
        if current is not installed:  # another wrapper on top (or already restored): leave it, see wrap()
            return
        _restore(own_kind, target, name, own)
    elif kind == "module":
        _restore_module(target, name, previous)
    elif kind == "item":
        value, index = previous
        if value is ABSENT:
            target.pop(name, None)
        else:
            _insert_at(target, name, value, index)
    elif kind == "raw":
        if previous is ABSENT:
            if name in vars(target):
                _raw_del(target, name)
        else:
            _raw_set(target, name, previous)
    elif previous is ABSENT:
        if _own_value(target, name) is not ABSENT:  # deleted meanwhile (or only inherited): absent already
            delattr(target, name)
    else:
        setattr(target, name, previous)
