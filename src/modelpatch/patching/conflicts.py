"""Container/inner conflicts: one mapping replacing a wrapper class *and* a class the wrapper builds.

The classic case is BERT: ``".*Attention"`` matches ``BertAttention`` (a container whose
``__init__`` builds ``BertSelfAttention`` or ``BertCrossAttention``) and the inner classes too. The
container's replacement never builds the inner classes, so the inner replacement silently never runs
and the container loses submodules (``self``, ``output``) the checkpoint expects.

Which classes a container builds is read from the code of its ``__init__`` (names it loads, including
module-level tables such as ``GPT_NEO_ATTENTION_CLASSES`` whose values are classes), so the check also
works before anything is built (``modelpatch explain``).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .interception import defining_init
from .registry import PatchRule

__all__ = ["Conflict", "classes_built_by", "find_conflicts"]


@dataclass(frozen=True)
class Conflict:
    """``container_key`` replaces ``container``, whose original builds ``inner``, matched by ``inner_key``."""

    container: type
    container_key: str
    inner: type
    inner_key: str

    def message(self) -> str:
        advice = (
            "make the pattern narrower or use exact class names"
            if not (self.container_key.isidentifier() and self.inner_key.isidentifier())
            else "drop one of the two keys"
        )
        return (
            f"modelpatch: key {self.container_key!r} replaces the container {self.container.__name__} and key "
            f"{self.inner_key!r} also matches {self.inner.__name__}, which the original {self.container.__name__} "
            f"can build; the replacement of {self.container.__name__} built no {self.inner.__name__}, so that "
            f"replacement never ran and the submodules the original container holds are missing: {advice}."
        )


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


@functools.cache
def classes_built_by(container: type) -> frozenset[type]:
    """Classes that ``container.__init__`` may construct directly (by global name or module table)."""
    init = vars(container).get("__init__")
    code = getattr(defining_init(init), "__code__", None) if init is not None else None
    module = sys.modules.get(container.__module__)
    if code is None or module is None:
        return frozenset()
    found: set[type] = set()
    namespace = vars(module)
    for name in _code_names(code):
        value = namespace.get(name)
        values = (
            value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else [value]
        )
        found.update(v for v in values if isinstance(v, type) and v is not container)
    return frozenset(found)


def find_conflicts(
    resolved: Mapping[type, PatchRule], replaced: Iterable[type], built: set[type] | None = None
) -> list[Conflict]:
    """Conflicts among ``replaced`` containers and the classes ``resolved`` matches.

    Args:
        resolved: ``{class: rule}`` of the mapping.
        replaced: container classes that were (or would be) replaced.
        built: classes actually constructed during the build. An inner class that was built anyway
            (the container's replacement subclasses it and calls ``super().__init__``, or builds the
            inner class itself) is no conflict. ``None`` for a dry run: then a container whose
            replacement subclasses it is assumed to build what the original builds.
    """
    conflicts = []
    for container in replaced:
        container_rule = resolved.get(container)
        if container_rule is None:
            continue
        if built is None and issubclass(container_rule.replacement, container):
            continue
        for inner in sorted(classes_built_by(container), key=lambda c: c.__name__):
            inner_rule = resolved.get(inner)
            if inner_rule is not None and (built is None or inner not in built):
                conflicts.append(Conflict(container, container_rule.key, inner, inner_rule.key))
    return conflicts
