"""Container/inner conflicts: one mapping replacing a wrapper class *and* a class the wrapper builds.

The founding document's BERT warning: ``".*Attention"`` matches ``BertAttention`` (a container whose
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

from transformers.utils import logging

from .registry import PatchRule

logger = logging.get_logger("modelpatch")

__all__ = ["Conflict", "classes_built_by", "find_conflicts", "warn_conflicts"]


@dataclass(frozen=True)
class Conflict:
    """``container_key`` replaces ``container``, whose original builds ``inner``, matched by ``inner_key``."""

    container: type
    container_key: str
    inner: type
    inner_key: str

    def message(self) -> str:
        return (
            f"modelpatch: key {self.container_key!r} replaces the container {self.container.__name__} and key "
            f"{self.inner_key!r} also matches {self.inner.__name__}, which the original {self.container.__name__} "
            f"builds; the replacement of {self.container.__name__} does not build {self.inner.__name__}, so that "
            f"replacement never runs. Use a narrower key (e.g. '.*SelfAttention$') or an exact class name."
        )


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


@functools.lru_cache(maxsize=None)
def classes_built_by(container: type) -> frozenset[type]:
    """Classes that ``container.__init__`` may construct directly (by global name or module table)."""
    init = vars(container).get("__init__")
    code = getattr(init, "__code__", None)
    module = sys.modules.get(container.__module__)
    if code is None or module is None:
        return frozenset()
    found = set()
    namespace = vars(module)
    for name in _code_names(code):
        value = namespace.get(name)
        values = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else [value]
        found.update(v for v in values if isinstance(v, type) and v is not container)
    return frozenset(found)


def find_conflicts(resolved: Mapping[type, PatchRule], replaced: Iterable[type]) -> list[Conflict]:
    """Conflicts among ``replaced`` containers and the classes ``resolved`` matches."""
    conflicts = []
    for container in replaced:
        container_rule = resolved.get(container)
        if container_rule is None:
            continue
        for inner in sorted(classes_built_by(container), key=lambda c: c.__name__):
            inner_rule = resolved.get(inner)
            if inner_rule is not None:
                conflicts.append(Conflict(container, container_rule.key, inner, inner_rule.key))
    return conflicts


def warn_conflicts(scope) -> list[Conflict]:
    """Log one warning per conflict found among the classes ``scope`` actually replaced."""
    conflicts = find_conflicts(scope.resolved, list(scope.replaced_originals))
    for conflict in conflicts:
        logger.warning(conflict.message())
    return conflicts
