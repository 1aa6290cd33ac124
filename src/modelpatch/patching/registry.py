"""The patch mapping: validated rules, key resolution, and the process-wide registry.

A *patch mapping* maps keys to replacement classes. A key that is a plain Python identifier
(``"LlamaAttention"``) is an **exact class name** and matches only a class whose ``__name__`` is that
string. Any other key (``".*Attention$"``, ``"^Llama\\d+MLP$"``) is a **regular expression** matched
with :func:`re.search` against the class name. Resolution of a class name:

1. an exact key equal to the name wins over every pattern;
2. otherwise the first registered pattern that matches wins.

This differs from ``transformers.monkey_patching`` on purpose: there an identifier key is also tried
as a regex, so ``"LlamaAttention"`` also hits ``DiffLlamaAttention`` and breaks that model.

The registry is process-wide, except inside :func:`isolated_patch_registry` (the CLI's in-process sandbox): there
the current thread / asyncio task reads and writes a registry of its own, and every other context keeps seeing the
process-wide one.
"""

from __future__ import annotations

import difflib
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch.nn as nn
from transformers import __version__ as transformers_version
from transformers.utils import logging

from ..errors import ModelpatchError, ModelpatchTypeError, ModelpatchValueError
from ..undo import context_set
from .catalog import CATALOG, known_class_names

logger = logging.get_logger("modelpatch")

__all__ = [
    "PatchRule",
    "PatchMapping",
    "build_patch_mapping",
    "register_patch_mapping",
    "unregister_patch_mapping",
    "clear_patch_mapping",
    "get_patch_mapping",
    "registered_patch_mapping",
    "set_strict_patching",
    "is_strict_patching",
    "on_clear",
    "isolated_patch_registry",
    "unknown_class_key_message",
    "unknown_key_hint",
    "closest_class_names",
]


class UnmatchedPatchKeyError(ModelpatchError, ValueError):
    """A strict build finished with patch keys that matched no class that was built, or a strict registration
    got a key spelled like a class that none is (:func:`unknown_class_key_message`)."""


@dataclass(frozen=True)
class PatchRule:
    """One entry of a patch mapping.

    Attributes:
        key: the key as the user wrote it.
        replacement: the replacement class (an ``nn.Module`` subclass).
        pattern: the compiled regular expression, or ``None`` when ``key`` is an exact class name.
    """

    key: str
    replacement: type
    pattern: re.Pattern[str] | None

    @property
    def is_exact(self) -> bool:
        return self.pattern is None

    def matches(self, class_name: str) -> bool:
        """Whether this rule applies to a class called ``class_name``."""
        if self.pattern is None:
            return class_name == self.key
        return self.pattern.search(class_name) is not None


def _make_rule(key: object, replacement: object) -> PatchRule:
    """Validate one ``key -> replacement`` pair; raises ``TypeError``/``ValueError`` naming the key."""
    if not isinstance(key, str):
        raise ModelpatchTypeError(
            f"Patch mapping key {key!r} must be a str (a class name or a regex), got {type(key).__name__}"
        )
    if not isinstance(replacement, type):
        raise ModelpatchTypeError(
            f"Replacement for {key!r} must be a class, got {type(replacement).__name__} ({replacement!r})"
        )
    if not issubclass(replacement, nn.Module):
        raise ModelpatchTypeError(
            f"Replacement for {key!r} must be a subclass of torch.nn.Module, got {replacement.__qualname__} "
            f"(bases: {[c.__name__ for c in replacement.__mro__[1:]]})"
        )
    if key == "":
        raise ModelpatchValueError("Patch mapping key '' is empty: as a regex it would match every class")
    if key.isidentifier():
        return PatchRule(key, replacement, None)
    try:
        compiled = re.compile(key)
    except re.error as exc:
        raise ModelpatchValueError(f"Patch mapping key {key!r} is not a valid regular expression: {exc}") from None
    return PatchRule(key, replacement, compiled)


@dataclass(frozen=True, eq=False)
class PatchMapping:
    """An immutable, ordered, validated patch mapping.

    Built with :func:`build_patch_mapping`; the registry hands out one snapshot per change, so a build
    that started with a snapshot keeps using it even if the registry changes meanwhile.
    """

    rules: tuple[PatchRule, ...]
    _exact: dict[str, PatchRule] = field(init=False, repr=False)
    _patterns: tuple[PatchRule, ...] = field(init=False, repr=False)
    content_key: tuple[tuple[str, type], ...] = field(init=False, repr=False)
    keys: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_exact", {r.key: r for r in self.rules if r.is_exact})
        object.__setattr__(self, "_patterns", tuple(r for r in self.rules if not r.is_exact))
        # ((key, replacement), ...): equal for mappings with equal content (resolution caches use it)
        object.__setattr__(self, "content_key", tuple((r.key, r.replacement) for r in self.rules))
        object.__setattr__(self, "keys", tuple(r.key for r in self.rules))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def resolve(self, class_name: str) -> PatchRule | None:
        """The rule that applies to ``class_name`` (exact key first, then the first matching pattern)."""
        rule = self._exact.get(class_name)
        if rule is not None:
            return rule
        for rule in self._patterns:
            if rule.pattern is not None and rule.pattern.search(class_name) is not None:
                return rule
        return None

    def as_dict(self) -> dict[str, type]:
        return {r.key: r.replacement for r in self.rules}


EMPTY_MAPPING = PatchMapping(())


def build_patch_mapping(mapping: Mapping[str, type] | PatchMapping) -> PatchMapping:
    """Validate ``mapping`` into a :class:`PatchMapping`.

    Raises:
        TypeError: ``mapping`` is not a mapping; a key is not a ``str``; a value is not a class or not an
            ``nn.Module`` subclass (the message names the key).
        ValueError: a key is empty or an invalid regular expression (the message names the key and the
            :mod:`re` error).
    """
    if isinstance(mapping, PatchMapping):
        return mapping
    if not isinstance(mapping, Mapping):
        raise ModelpatchTypeError(
            f"A patch mapping must be a dict of key -> replacement class, got {type(mapping).__name__}"
        )
    return PatchMapping(tuple(_make_rule(k, v) for k, v in mapping.items()))


class _Registry:
    """The process-wide registry. Every method is atomic: it validates everything, then changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: dict[str, PatchRule] = {}
        self._snapshot: PatchMapping = EMPTY_MAPPING
        self._cleared: set[str] = set()  # keys removed by clear(): unregistering them later is a no-op
        self.strict = False

    def snapshot(self) -> PatchMapping:
        return self._snapshot  # replaced wholesale under the lock, so a read is always consistent

    def _publish(self, rules: dict[str, PatchRule]) -> None:
        self._rules = rules
        self._snapshot = PatchMapping(tuple(rules.values())) if rules else EMPTY_MAPPING

    def register(self, mapping: Mapping[str, type] | PatchMapping, overwrite: bool) -> None:
        new = build_patch_mapping(mapping)
        with self._lock:
            if not overwrite:
                taken = [r.key for r in new.rules if r.key in self._rules]
                if taken:
                    raise ModelpatchValueError(
                        f"Patch mapping key(s) {taken} already registered "
                        f"(to {[self._rules[k].replacement.__qualname__ for k in taken]}); pass overwrite=True to replace"
                    )
            rules = dict(self._rules)
            for rule in new.rules:
                rules[rule.key] = rule
                self._cleared.discard(rule.key)
            self._publish(rules)

    def unregister(self, keys: Iterable[str], missing_ok: bool = False) -> None:
        keys = [keys] if isinstance(keys, str) else list(keys)
        with self._lock:
            unknown = [k for k in keys if k not in self._rules and not missing_ok and k not in self._cleared]
            if unknown:
                raise ModelpatchValueError(
                    f"Patch mapping key(s) {unknown} are not registered; registered keys: {list(self._rules)}"
                )
            self._cleared.difference_update(keys)
            self._publish({k: r for k, r in self._rules.items() if k not in set(keys)})

    def clear(self) -> None:
        with self._lock:
            self._cleared.update(self._rules)
            self._publish({})


_REGISTRY = _Registry()
_ISOLATED: ContextVar[_Registry | None] = ContextVar("modelpatch_isolated_patch_registry", default=None)


def _registry() -> _Registry:
    """The registry the current context reads and writes: its own inside :func:`isolated_patch_registry`."""
    isolated = _ISOLATED.get()
    return _REGISTRY if isolated is None else isolated


@contextmanager
def isolated_patch_registry() -> Iterator[None]:
    """Inside the block, the current thread / asyncio task (and only it) sees an empty patch registry with
    registry-wide strict mode off; registrations made inside go to that registry and are gone after the block.
    Other threads and tasks keep reading and writing the process-wide registry meanwhile, unchanged.

    What the CLI's in-process sandbox (:class:`modelpatch.cli.sandbox.CommandSandbox`) enters around a command.
    """
    with context_set(_ISOLATED, _Registry()):
        yield


def closest_class_names(key: str, n: int = 3) -> list[str]:
    """Up to ``n`` names of known module classes (of the installed Transformers, imported or not, or of loaded remote
    code) spelled closest to ``key``: the same name in another case first, then :func:`difflib.get_close_matches`
    (ratio >= 0.7); ``[]`` when none is close."""
    known = sorted(known_class_names())
    same_but_case = [name for name in known if name.lower() == key.lower() and name != key]
    close = [name for name in difflib.get_close_matches(key, known, n=n, cutoff=0.7) if name not in same_but_case]
    return [*same_but_case, *close][:n]


def _suggestions(key: str) -> tuple[list[str], bool]:
    """``(names to suggest for key, whether they differ from it only in case)``: the one close match when it is the
    same name in another case or spelled nearly alike (ratio >= 0.92), else :func:`closest_class_names`."""
    close = closest_class_names(key)
    same_but_case = bool(close) and close[0].lower() == key.lower()
    if close and (same_but_case or difflib.SequenceMatcher(None, key, close[0]).ratio() >= 0.92):
        return close[:1], same_but_case
    return close, False


def _names_no_known_class(key: str) -> bool:
    """Whether the exact key or pattern ``key`` names / matches no module class of the installed Transformers
    (imported or not) nor of loaded remote code."""

    def unknown() -> bool:
        if key.isidentifier():
            return key not in known_class_names() and not CATALOG.classes_named(key)
        try:
            pattern = re.compile(key)
        except re.error:
            return False
        return not any(pattern.search(name) for name in (*CATALOG.names(), *known_class_names()))

    if not unknown():
        return False
    CATALOG.refresh_if_stale()  # remote code imported since the catalogue's last look
    return unknown()


def unknown_key_hint(key: str) -> str:
    """``""`` when ``key`` names (exact key) or matches (pattern) a known module class; otherwise a short phrase
    saying it names none, with the closest class names when any are close (``"no class of Transformers 5.23.0 is
    named so; closest: 'LlamaAttention'"``). How the CLI words a patch key that replaced nothing."""
    if not _names_no_known_class(key):
        return ""
    if not key.isidentifier():
        return f"matches no module class of Transformers {transformers_version}"
    close = _suggestions(key)[0]
    closest = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"no module class of Transformers {transformers_version} is named so{closest}"


def unknown_class_key_message(key: str) -> str | None:
    """A message naming ``key`` when it names (exact key) or matches (pattern) no module class a patch can replace (a
    module class of the installed Transformers, imported or not, or of loaded remote code), with the closest known
    class names when any are close (:func:`closest_class_names`): a typo such as ``'LlamaAtention'``, or a name far
    from any class such as ``'LlamaAttn'``. ``None`` for a key that names or matches a known class. A key naming no
    known class may still be a class of remote code loaded later, which the message says."""
    if not _names_no_known_class(key):
        return None
    if not key.isidentifier():
        return (
            f"modelpatch: patch key {key!r} matches no module class of the installed Transformers "
            f"{transformers_version} nor of loaded remote code. The key replaces nothing unless remote code loaded "
            "later defines such a class"
        )
    close, same_but_case = _suggestions(key)
    suggestion = (
        f": did you mean {' or '.join(map(repr, close))}?"
        + (" (class names are case-sensitive)" if same_but_case else "")
        if close
        else "."
    )
    return (
        f"modelpatch: patch key {key!r} names no module class of the installed Transformers {transformers_version} "
        f"nor of loaded remote code{suggestion} The key replaces nothing unless remote code loaded later defines that "
        "class"
    )


def register_patch_mapping(mapping: Mapping[str, type], overwrite: bool = False, *, strict: bool = False) -> None:
    """Register class replacements that every later ``from_pretrained``/``from_config`` build applies.

    Args:
        mapping: ``{key: replacement_class}``. A key that is a Python identifier is an exact class name;
            any other key is a regular expression matched with :func:`re.search` against class names.
            Exact keys win over patterns; among patterns the first registered wins.
        overwrite: replace keys that are already registered instead of raising.
        strict: a key that names (exact key) or matches (pattern) no known module class (see
            :func:`unknown_class_key_message`: a typo, a name far from any class, a class of remote code not
            loaded yet) raises instead of logging a warning (registry-wide strict mode, :func:`set_strict_patching`,
            does too).

    Raises:
        TypeError: a value is not a class or not an ``nn.Module`` subclass (names the key).
        ValueError: a key is an invalid regular expression (names the key and the ``re`` error), or is
            already registered and ``overwrite`` is false.
        UnmatchedPatchKeyError: ``strict`` (or strict mode) and a key names / matches no known module class (such
            as ``'LlamaAtention'`` or ``'LlamaAttn'``); the message names the closest known class names.

    A call that raises leaves the registry exactly as it was.
    """
    registry = _registry()
    validated = build_patch_mapping(mapping)  # type and pattern errors first
    messages = [m for m in map(unknown_class_key_message, validated.keys) if m is not None]
    if messages and (strict or registry.strict):
        raise UnmatchedPatchKeyError("\n".join(messages) + " (strict); nothing was registered")
    registry.register(validated, overwrite)
    for message in messages:
        logger.warning(message)


def unregister_patch_mapping(keys: Iterable[str], *, missing_ok: bool = False) -> None:
    """Remove exactly ``keys`` (as written at registration) from the registry.

    Keys that were registered and then removed by :func:`clear_patch_mapping` are already unregistered: naming them
    is a no-op, so clean-up code works whichever clean-up runs first.

    Args:
        keys: one key or an iterable of keys.
        missing_ok: also accept keys that were never registered.

    Raises:
        ValueError: a key was never registered and ``missing_ok`` is false; nothing is removed then.
    """
    _registry().unregister(keys, missing_ok)


def clear_patch_mapping() -> None:
    """Remove every registered class replacement and every registered checkpoint conversion rule.

    Conversion rules are cleared too because they exist for the replacement classes: a ``qwen2_moe``
    rule left behind (as ``transformers.monkey_patching`` leaves it) makes every later vanilla load
    leave its experts randomly initialised. Transformers' built-in rules are never touched. (The
    conversion layer registers its clean-up with :func:`on_clear`; this module does not import it.)
    """
    _registry().clear()
    for callback in list(_CLEAR_CALLBACKS):
        callback()


_CLEAR_CALLBACKS: list[Callable[[], None]] = []


def on_clear(callback: Callable[[], None]) -> None:
    """Call ``callback()`` (no arguments) after every :func:`clear_patch_mapping` (idempotent per callback).

    How layers above the patch registry (the conversion rule registry) clear their own user state with it
    without this module importing them.
    """
    if callback not in _CLEAR_CALLBACKS:
        _CLEAR_CALLBACKS.append(callback)


def get_patch_mapping() -> dict[str, type]:
    """A copy of the registry: ``{key: replacement_class}`` in registration order."""
    return _registry().snapshot().as_dict()


def registered_patch_mapping() -> PatchMapping:
    """The registry's current immutable snapshot."""
    return _registry().snapshot()


def set_strict_patching(enabled: bool = True) -> bool:
    """Registry-wide strict mode: a registered key that replaces nothing during a build raises.

    Returns the previous setting, so callers can restore it.
    """
    registry = _registry()
    previous, registry.strict = registry.strict, bool(enabled)
    return previous


def is_strict_patching() -> bool:
    """Whether registry-wide strict mode is on (see :func:`set_strict_patching`)."""
    return _registry().strict
