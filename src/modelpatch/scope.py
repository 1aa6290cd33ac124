"""Patch scopes: where a patch mapping is in force, and ``apply_patches``.

A :class:`PatchScope` is one activation of a patch mapping. Entering it adds it to the *current
context's* tuple of scopes (a :class:`contextvars.ContextVar`: one per thread, one per asyncio task);
exiting removes exactly that scope, whatever the order of exits (``ExitStack``, generators), so undo
is structural: there is nothing to restore in any module, and another thread never sees the scope.

Precedence when several scopes are active: explicit blocks (``apply_patches(...)``) before the
registry scope that ``from_pretrained``/``from_config`` open, innermost block first.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from transformers.utils import logging

from .catalog import CATALOG
from .interception import install_hook, uninstall_hook
from .registry import PatchMapping, PatchRule, build_patch_mapping, registered_patch_mapping

logger = logging.get_logger("modelpatch")

__all__ = ["PatchScope", "apply_patches", "active_scopes", "UnmatchedPatchKeyError", "Replacement", "provenance"]


class UnmatchedPatchKeyError(ValueError):
    """A strict build finished with patch keys that replaced nothing."""


@dataclass(frozen=True)
class Replacement:
    """Provenance of one replaced module instance."""

    original: type
    replacement: type
    key: str


# module instance -> Replacement, for every module built as a replacement (weak: no leak).
_PROVENANCE: "weakref.WeakKeyDictionary[object, Replacement]" = weakref.WeakKeyDictionary()
_PROVENANCE_LOCK = threading.Lock()


def provenance(module: object) -> Replacement | None:
    """How ``module`` was built, if it is a replacement built by modelpatch."""
    return _PROVENANCE.get(module)


_ACTIVE: ContextVar[tuple["PatchScope", ...]] = ContextVar("modelpatch_active_scopes", default=())

_LIVE_LOCK = threading.RLock()
_LIVE: set["PatchScope"] = set()  # entered and not yet exited, in any context


def active_scopes() -> tuple["PatchScope", ...]:
    """The scopes in force for the calling thread/task, outermost first."""
    return tuple(s for s in _ACTIVE.get() if not s.closed)


def _lookup(target: type):
    """The hook's question: is ``target`` replaced for the caller? Returns (replacement, on_built)."""
    scopes = _ACTIVE.get()
    if not scopes:
        return None
    for explicit in (True, False):
        for scope in reversed(scopes):
            if scope.explicit is explicit and not scope.closed:
                rule = scope.resolved.get(target)
                if rule is not None:
                    return rule.replacement, scope._recorder(target, rule)
    return None


def refresh_catalog() -> None:
    """Pick up modeling modules imported since the last look and extend every live scope to them."""
    if not CATALOG.may_have_changed():
        return
    with _LIVE_LOCK:
        new_classes = CATALOG.refresh()
        for scope in list(_LIVE):
            scope._extend(new_classes)


class PatchScope:
    """One activation of a patch mapping; a context manager (see :func:`apply_patches`).

    Attributes:
        mapping: the validated :class:`~modelpatch.registry.PatchMapping` in force.
        explicit: ``True`` for ``apply_patches`` blocks, ``False`` for the registry scope that
            ``from_pretrained``/``from_config`` open.
        strict: raise :class:`UnmatchedPatchKeyError` on exit when a key replaced nothing.
        resolved: ``{original class: rule}`` for every catalogued class the mapping matches.
        fired: ``{key: number of modules replaced}``.
    """

    def __init__(self, mapping: PatchMapping, *, explicit: bool, strict: bool = False, label: str = "apply_patches"):
        self.mapping = mapping
        self.explicit = explicit
        self.strict = strict
        self.label = label
        self.resolved: dict[type, PatchRule] = {}
        self.fired: dict[str, int] = {}
        self.replaced_originals: dict[type, PatchRule] = {}
        self.models_built = 0  # PreTrainedModel constructions seen inside the scope
        self.closed = False
        self._entered = False
        self._hooked: list[type] = []

    # -- resolution -------------------------------------------------------------------------------
    def _matches(self, classes) -> dict[type, PatchRule]:
        replacements = {rule.replacement for rule in self.mapping.rules}
        found = {}
        for cls in classes:
            if cls in replacements:  # a replacement is never itself replaced (no chains, no cycles)
                continue
            rule = self.mapping.resolve(cls.__name__)
            if rule is not None and rule.replacement is not cls:
                found[cls] = rule
        return found

    def _extend(self, classes) -> None:
        if self.closed:
            return
        for cls, rule in self._matches(classes).items():
            if cls not in self.resolved:
                install_hook(cls, _lookup)
                self._hooked.append(cls)
                self.resolved[cls] = rule

    def _recorder(self, original: type, rule: PatchRule):
        def on_built(module: object) -> None:
            with _PROVENANCE_LOCK:
                _PROVENANCE[module] = Replacement(original, rule.replacement, rule.key)
                self.fired[rule.key] = self.fired.get(rule.key, 0) + 1
                self.replaced_originals[original] = rule

        return on_built

    # -- results ----------------------------------------------------------------------------------
    @property
    def unmatched_keys(self) -> tuple[str, ...]:
        """Keys that replaced no module while this scope was active."""
        return tuple(k for k in self.mapping.keys if k not in self.fired)

    # -- context manager --------------------------------------------------------------------------
    def __enter__(self) -> "PatchScope":
        if self._entered:
            raise RuntimeError("A PatchScope can be entered only once; call apply_patches() again")
        self._entered = True
        with _LIVE_LOCK:
            try:
                refresh_catalog()
                self._extend(_cached_catalog_matches(self.mapping))
                _LIVE.add(self)
            except BaseException:
                self._release()
                raise
        _ACTIVE.set(_ACTIVE.get() + (self,))
        return self

    def _release(self) -> None:
        self.closed = True
        with _LIVE_LOCK:
            _LIVE.discard(self)
            hooked, self._hooked = self._hooked, []
            for cls in hooked:
                uninstall_hook(cls)

    def __exit__(self, exc_type, exc, tb) -> None:
        _ACTIVE.set(tuple(s for s in _ACTIVE.get() if s is not self))
        self._release()
        if exc_type is None:
            self.finish()

    def finish(self) -> None:
        """Warn about (or, when strict, raise for) keys that replaced nothing, and about conflicts."""
        from .conflicts import warn_conflicts

        warn_conflicts(self)
        unmatched = self.unmatched_keys
        if not unmatched or not (self.fired or self.models_built):
            return  # nothing was built: nothing to judge
        message = (
            f"modelpatch: patch key(s) {list(unmatched)} replaced no module during {self.label}; "
            "check the class name (case-sensitive) or the pattern"
        )
        if self.strict:
            raise UnmatchedPatchKeyError(message)
        logger.warning(message)


_MATCH_CACHE: "weakref.WeakKeyDictionary[PatchMapping, tuple[int, list[type]]]" = weakref.WeakKeyDictionary()


def _cached_catalog_matches(mapping: PatchMapping) -> list[type]:
    """Catalogued classes that ``mapping`` may match, cached per mapping snapshot and catalog version."""
    cached = _MATCH_CACHE.get(mapping)
    if cached is not None and cached[0] == CATALOG.version:
        return cached[1]
    candidates: list[type] = []
    for rule in mapping.rules:
        if rule.is_exact:
            candidates.extend(CATALOG.classes_named(rule.key))
    if any(not r.is_exact for r in mapping.rules):
        candidates.extend(c for c in CATALOG.all_classes() if any(r.matches(c.__name__) for r in mapping.rules))
    _MATCH_CACHE[mapping] = (CATALOG.version, candidates)
    return candidates


def apply_patches(mapping: Mapping[str, type] | None = None, *, strict: bool = False) -> PatchScope:
    """Context manager: build models with class replacements inside the block, originals outside.

    Args:
        mapping: ``{key: replacement}`` to apply inside the block only, without touching the registry.
            ``None`` applies the registry (:func:`~modelpatch.register_patch_mapping`) as it is now.
        strict: on a normal exit, raise :class:`UnmatchedPatchKeyError` if a key replaced no module
            (otherwise a warning naming the key is logged).

    Returns:
        A :class:`PatchScope`; ``with apply_patches() as scope`` gives access to ``scope.fired`` and
        ``scope.unmatched_keys``.

    Raises:
        TypeError, ValueError: ``mapping`` is invalid (see :func:`~modelpatch.register_patch_mapping`).

    Only the calling thread or asyncio task sees the replacements; on exit (normal, exception, or out
    of order) nothing remains to undo. Modules built inside the block keep their replacements.
    """
    resolved = registered_patch_mapping() if mapping is None else build_patch_mapping(mapping)
    return PatchScope(resolved, explicit=True, strict=strict)
