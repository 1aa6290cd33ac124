"""Patch scopes: where a patch mapping is in force (the machinery behind ``apply_patches``).

A :class:`PatchScope` is one activation of a patch mapping. Entering it adds it to the *current
context's* tuple of scopes (a :class:`contextvars.ContextVar`: one per thread, one per asyncio task);
exiting removes exactly that scope, whatever the order of exits (``ExitStack``, generators), so undo
is structural: there is nothing to restore in any module, and another thread never sees the scope.

Precedence when several scopes are active: explicit blocks (``apply_patches(...)``) before the
registry scope that ``from_pretrained``/``from_config`` open, innermost block first.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from transformers.utils import logging

from ..errors import ModelpatchRuntimeError, ModelpatchTypeError
from .catalog import CATALOG
from .conflicts import Conflict, find_conflicts
from .interception import install_hook, uninstall_hook
from .keys import Resolution, names_a_known_class, resolve_classes, unmatched_key_hint
from .provenance import Replacement, build_record, provenance, set_provenance
from .registry import PatchMapping, PatchRule, UnmatchedPatchKeyError
from .upstream import in_fusion_discovery

if TYPE_CHECKING:
    from transformers import PreTrainedModel


logger = logging.get_logger("modelpatch")

__all__ = ["PatchScope", "active_scopes", "UnmatchedPatchKeyError", "refresh_catalog"]


_STATS_LOCK = threading.Lock()

_F = TypeVar("_F", bound=Callable[..., Any])


_ACTIVE: ContextVar[tuple[PatchScope, ...]] = ContextVar("modelpatch_active_scopes", default=())

_LIVE_LOCK = threading.RLock()
_LIVE: set[PatchScope] = set()  # entered and not yet exited, in any context


def active_scopes() -> tuple[PatchScope, ...]:
    """The scopes in force for the calling thread/task, outermost first."""
    return tuple(s for s in _ACTIVE.get() if not s.closed)


def _lookup(target: type) -> tuple[type, Callable[[object, tuple[Any, ...], dict[str, Any]], None]] | None:
    """The hook's question: is ``target`` replaced for the caller? Returns (replacement, on_built)."""
    scopes = _ACTIVE.get()
    if not scopes or in_fusion_discovery():  # Transformers' fusion discovery must see its own classes
        return None
    for scope in scopes:
        scope._saw(target)  # noqa: SLF001 - same module: the interception hook reports to its scopes
    for explicit in (True, False):
        for scope in reversed(scopes):
            if scope.explicit is explicit and not scope.closed:
                rule = scope.resolved.get(target)
                if rule is not None:
                    return rule.replacement, scope._recorder(target, rule)  # noqa: SLF001 - same module: the interception hook reports to its scopes
    return None


def refresh_catalog(modules: tuple[str, ...] | None = None) -> None:
    """Pick up modeling modules imported, replaced or re-executed since the last look and extend every live
    scope to the classes found in them.

    Args:
        modules: look for replaced or re-executed modules among these only (the modules a scope's classes
            come from; new imports are always seen); ``None`` looks at every catalogued module (done whenever
            a ``PreTrainedModel`` is built inside a scope).
    """
    if not CATALOG.may_have_changed(modules):
        return
    with _LIVE_LOCK:
        new_classes = CATALOG.refresh()
        for scope in list(_LIVE):
            scope._extend(resolve_classes(scope.mapping, new_classes))  # noqa: SLF001 - same module: the interception hook reports to its scopes


CATALOG.on_stale = refresh_catalog


class PatchScope:
    """One activation of a patch mapping; a context manager (see :func:`apply_patches`).

    Attributes:
        mapping: the validated :class:`~modelpatch.patching.registry.PatchMapping` in force.
        explicit: ``True`` for ``apply_patches`` blocks, ``False`` for the registry scope that
            ``from_pretrained``/``from_config`` open.
        strict: raise :class:`UnmatchedPatchKeyError` on exit when a key replaced nothing.
        resolved: ``{original class: rule}`` for every catalogued class the mapping matches.
        fired: ``{key: number of modules replaced}``.

    After the block, :attr:`unmatched_keys` holds the keys that replaced nothing and name no class that exists
    (typos: a warning, or :class:`UnmatchedPatchKeyError` when strict), :attr:`not_applicable_keys` those that
    name classes this build did not use (another model family: logged at INFO, never an error), and
    :attr:`outranked_keys` those whose classes another key or an enclosing block replaced.

    Also usable as a decorator (each call of the decorated function runs in a fresh scope with the same
    mapping), like ``transformers.monkey_patching.apply_patches``.
    """

    def __init__(
        self,
        mapping: PatchMapping,
        *,
        explicit: bool,
        strict: bool = False,
        label: str = "apply_patches",
        companions: tuple[Callable[[], contextlib.AbstractContextManager[object]], ...] = (),
    ) -> None:
        self.mapping = mapping
        self.companions = tuple(companions)
        self._exit_stack = contextlib.ExitStack()
        self.explicit = explicit
        self.strict = strict
        self.label = label
        self.resolved: dict[type, PatchRule] = {}
        self.fired: dict[str, int] = {}
        self.replaced_originals: dict[type, PatchRule] = {}
        self.candidates: dict[type, tuple[str, ...]] = {}  # class -> every key that matches it
        self.constructed: set[type] = set()  # matched classes whose construction was seen
        self.matched: set[str] = set()  # keys that matched a constructed class
        self.models: weakref.WeakSet[PreTrainedModel] = weakref.WeakSet()  # PreTrainedModels built inside
        self.models_built = 0
        self.closed = False
        self._classified: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self._entered = False
        self._hooked: list[type] = []

    # -- resolution -------------------------------------------------------------------------------
    def _extend(self, resolved: Resolution) -> None:
        """Target the classes of ``resolved`` (see :func:`resolve_classes`) not targeted yet."""
        if self.closed:
            return
        for cls, (rule, keys) in resolved.items():
            if cls in self.resolved:
                continue
            install_hook(cls, _lookup)
            self._hooked.append(cls)
            self.resolved[cls] = rule
            self.candidates[cls] = keys

    def _saw(self, target: type) -> None:
        """A class this scope may match is being constructed (whoever ends up replacing it)."""
        keys = self.candidates.get(target)
        if keys is not None and not self.closed:
            self.constructed.add(target)
            self.matched.update(keys)

    def _recorder(self, original: type, rule: PatchRule) -> Callable[[object, tuple[Any, ...], dict[str, Any]], None]:
        def on_built(module: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            set_provenance(module, Replacement(original, rule.replacement, rule.key, (args, dict(kwargs))))
            with _STATS_LOCK:
                self.fired[rule.key] = self.fired.get(rule.key, 0) + 1
                self.replaced_originals[original] = rule

        return on_built

    def record_built_model(self, model: PreTrainedModel) -> None:
        """A ``PreTrainedModel`` is being constructed inside this scope (called by modelpatch's wrapper of
        ``PreTrainedModel.__init__``, :mod:`modelpatch.apply.transformers`; not for users)."""
        self.models.add(model)
        self.models_built += 1

    # -- results ----------------------------------------------------------------------------------
    def _unbuilt_keys(self) -> tuple[str, ...]:
        """Keys that matched no class constructed while this scope was active."""
        return tuple(k for k in self.mapping.keys if k not in self.matched)

    def _classify_unbuilt(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(unmatched, not applicable)``: the unbuilt keys that name no class Transformers or loaded remote
        code defines, and those that do (fixed once the scope has finished)."""
        if self._classified is not None:
            return self._classified
        unbuilt = self._unbuilt_keys()
        rules = {r.key: r for r in self.mapping.rules}
        known = [k for k in unbuilt if names_a_known_class(rules[k])]
        classified = (tuple(k for k in unbuilt if k not in known), tuple(known))
        if self.closed:
            self._classified = classified
        return classified

    @property
    def unmatched_keys(self) -> tuple[str, ...]:
        """Keys that matched no class constructed while this scope was active and name no class that exists
        (typos): not a catalogued class, nor a class of any Transformers modeling module, imported or not."""
        return self._classify_unbuilt()[0]

    @property
    def not_applicable_keys(self) -> tuple[str, ...]:
        """Keys that matched no class constructed while this scope was active but name classes that exist: of
        another model family (a registry serving several families), or a class this model does not use."""
        return self._classify_unbuilt()[1]

    @property
    def outranked_keys(self) -> tuple[str, ...]:
        """Keys that matched a constructed class but lost to another key or an enclosing block."""
        return tuple(k for k in self.mapping.keys if k in self.matched and k not in self.fired)

    def conflicts(self) -> list[Conflict]:
        """Container/inner conflicts among the classes this scope replaced (see :mod:`modelpatch.patching.conflicts`)."""
        return find_conflicts(self.resolved, list(self.replaced_originals), built=self.constructed)

    # -- context manager --------------------------------------------------------------------------
    def __enter__(self) -> PatchScope:
        if self._entered:
            raise ModelpatchRuntimeError("A PatchScope can be entered only once; call apply_patches() again")
        self._entered = True
        with _LIVE_LOCK:
            try:
                resolved, watched = _cached_resolution(self.mapping)
                version = CATALOG.version
                refresh_catalog(watched)
                if CATALOG.version != version:
                    resolved = _resolve_catalog(self.mapping)
                self._extend(resolved)
                _LIVE.add(self)
            except BaseException:
                self._release()
                raise
        try:
            for companion in self.companions:
                self._exit_stack.enter_context(companion())
        except BaseException:
            self._exit_stack.close()
            self._release()
            raise
        # not a token reset on exit: scopes opened with start() may stop in any order, so exit removes this one
        _ACTIVE.set(_ACTIVE.get() + (self,))
        return self

    def start(self) -> PatchScope:
        """Enter the scope without a ``with`` block (like ``unittest.mock.patch(...).start()``); pair with
        :meth:`stop`. The scope is in force in the calling thread / asyncio task until then."""
        return self.__enter__()

    def stop(self) -> None:
        """Exit a scope opened with :meth:`start` (runs the same checks as a normal ``with`` exit).

        Raises:
            ModelpatchRuntimeError: the scope was never started, or is already stopped (a ``RuntimeError``).
            UnmatchedPatchKeyError: as on the exit of a strict ``with`` block.
        """
        if not self._entered or self.closed:
            raise ModelpatchRuntimeError("PatchScope.stop(): the scope is not started (or already stopped)")
        self.__exit__(None, None, None)

    def __call__(self, func: _F) -> _F:
        """Decorate ``func`` (a plain or ``async`` function): each call runs inside a fresh copy of this block.

        Raises:
            TypeError: ``func`` is a generator or async generator function: the block would stay open in the
                caller's context between two ``yield``s (open the block inside the body instead, around the work).
        """
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise ModelpatchTypeError(
                f"apply_patches cannot decorate the generator function {func.__qualname__}: the block would stay "
                "open in the caller between yields; use `with apply_patches(...)` around the work inside it"
            )

        def fresh() -> PatchScope:
            return PatchScope(
                self.mapping,
                explicit=self.explicit,
                strict=self.strict,
                label=self.label,
                companions=self.companions,
            )

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def run_patched_async(*args: Any, **kwargs: Any) -> Any:
                with fresh():  # entered in the task running the coroutine: other tasks do not see it
                    return await func(*args, **kwargs)

            return cast(_F, run_patched_async)  # same signature as ``func``

        @functools.wraps(func)
        def run_patched(*args: Any, **kwargs: Any) -> Any:
            with fresh():
                return func(*args, **kwargs)

        return cast(_F, run_patched)  # same signature as ``func``

    def _release(self) -> None:
        self.closed = True
        with _LIVE_LOCK:
            _LIVE.discard(self)
            hooked, self._hooked = self._hooked, []
            for cls in hooked:
                uninstall_hook(cls)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _ACTIVE.set(tuple(s for s in _ACTIVE.get() if s is not self))
        try:
            self._exit_stack.__exit__(exc_type, exc, tb)
        finally:
            self._release()
        if exc_type is None:
            self.finish()

    def finish(self) -> None:
        """Record results on the models built, warn about conflicts and about keys that matched no class that
        exists (raise :class:`UnmatchedPatchKeyError` instead when strict); log keys of classes that exist but
        were not built (another model family) at INFO, unless this is an explicit block none of whose keys
        applied to what it built (a recipe for another family: warning, or the error when strict).

        Raises:
            UnmatchedPatchKeyError: strict scope, and a key names no class that exists, or none of the keys of an
                explicit block applied, or a key names a class whose module was first imported inside the scope
                with no model built after the import.
        """
        conflicts = self.conflicts()
        for conflict in conflicts:
            logger.warning(conflict.message())
        unbuilt = self._unbuilt_keys()
        built_something = bool(self.fired or self.models_built or self.constructed)
        unmatched, not_applicable = self._classify_unbuilt() if unbuilt and built_something else ((), ())
        for model in list(self.models):
            record = build_record(model)
            if record is not None:
                record.unmatched = tuple(k for k in record.keys if k in unmatched)
                record.not_applicable = tuple(k for k in record.keys if k in not_applicable)
                record.conflicts = tuple(conflicts)
        for key in self.outranked_keys:
            logger.info(
                f"modelpatch: key {key!r} matched classes during {self.label} but other keys or an enclosing block replaced them"
            )
        if not built_something:
            self._report_late_imports(unbuilt)
            return  # nothing was built: nothing to judge
        if not (unmatched or not_applicable):
            return
        built_names = self._built_class_names()
        nothing_applies = ""
        if not_applicable:
            hints = "".join(unmatched_key_hint(key, built_names) for key in not_applicable)
            if self.explicit and not self.matched:
                # a block whose keys all belong elsewhere (a recipe for another family): the build is vanilla
                nothing_applies = (
                    f"modelpatch: no patch key of {self.label} applies to what it built: key(s) {list(not_applicable)} "
                    f"name classes that exist (another model family, or classes this model does not use) but none "
                    f"was built{hints}"
                )
            else:
                logger.info(
                    f"modelpatch: patch key(s) {list(not_applicable)} not applicable to {self.label}: they name "
                    f"classes that exist (another model family, or classes this model does not use) but none was "
                    f"built{hints}"
                )
        messages = []
        if unmatched:
            hints = "".join(unmatched_key_hint(key, built_names) for key in unmatched)
            messages.append(
                f"modelpatch: patch key(s) {list(unmatched)} matched no class built during {self.label}, nor any "
                f"module class of Transformers or of loaded remote code; check the class name (case-sensitive) or "
                f"the pattern{hints}"
            )
        if nothing_applies:
            messages.append(nothing_applies)
        if messages and self.strict:
            raise UnmatchedPatchKeyError("\n".join(messages))
        for message in messages:
            logger.warning(message)

    def _built_class_names(self) -> set[str]:
        """Names of the original classes of the modules in the models built inside this scope (empty when none
        was built: layers constructed directly)."""
        names = set()
        for model in list(self.models):
            for module in model.modules():
                found = provenance(module)
                names.add(found.original.__name__ if found is not None else type(module).__name__)
        return names

    def _report_late_imports(self, unmatched: tuple[str, ...]) -> None:
        """Keys naming classes whose module was first imported inside the block, with no model built after the
        import: a module of that class built directly was not replaced (the catalogue is refreshed when a model is
        built, not on every import)."""
        if not unmatched:
            return
        refresh_catalog(())  # imports only: the entry looked for modules that ran again
        late = sorted(
            {
                key
                for cls, (_, keys) in _resolve_catalog(self.mapping).items()
                if cls not in self.resolved
                for key in keys
                if key in unmatched
            }
        )
        if not late:
            return
        message = (
            f"modelpatch: patch key(s) {late} name classes whose module was first imported inside {self.label}, "
            "after the block was entered; modules of them built directly were not replaced. Import the module "
            "before entering the block"
        )
        if self.strict:
            raise UnmatchedPatchKeyError(message)
        logger.warning(message)


_RESOLUTION_CACHE: dict[tuple[tuple[str, type], ...], tuple[int, Resolution, tuple[str, ...] | None]] = {}
_RESOLUTION_CACHE_SIZE = 256


def _resolve_catalog(mapping: PatchMapping) -> Resolution:
    """:func:`resolve_classes` over the whole catalogue, cached by the mapping's content and the catalogue version
    (a block re-entered with an equal mapping, e.g. in a loop, does not scan the catalogue again)."""
    return _cached_resolution(mapping)[0]


def _cached_resolution(mapping: PatchMapping) -> tuple[Resolution, tuple[str, ...] | None]:
    """``(resolved, watched)``: :func:`resolve_classes` over the catalogue, and the modules whose replacement or
    re-execution a scope entry with ``mapping`` must notice: those defining a catalogued class named by an exact
    key, or ``None`` (every catalogued module) when ``mapping`` has a pattern or an exact key naming no
    catalogued class (a module executed again may define new matching classes). Modules that run again
    elsewhere are found when a model is built (see :func:`refresh_catalog`)."""
    key = mapping.content_key
    cached = _RESOLUTION_CACHE.get(key)
    if cached is not None and cached[0] == CATALOG.version:
        return cached[1], cached[2]
    watched: tuple[str, ...] | None
    if all(r.is_exact for r in mapping.rules):
        named = [CATALOG.classes_named(r.key) for r in mapping.rules]
        classes = [c for found in named for c in found]
        watched = tuple(sorted({c.__module__ for c in classes})) if all(named) else None
    else:
        classes = CATALOG.all_classes()
        watched = None
    resolved = resolve_classes(mapping, classes)
    if len(_RESOLUTION_CACHE) >= _RESOLUTION_CACHE_SIZE:
        _RESOLUTION_CACHE.clear()
    _RESOLUTION_CACHE[key] = (CATALOG.version, resolved, watched)
    return resolved, watched
