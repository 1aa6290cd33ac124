"""Conversion rules: :class:`WeightRenaming` and :class:`WeightConverter`.

They subclass Transformers' ``WeightRenaming`` / ``WeightConverter`` (same constructor, same ``scope_prefix`` handling,
same ``reverse_transform``), with two differences:

* patterns match on **module-path boundaries**: a pattern starting with a name character only matches at the start
  of the key or right after a ``.``, so ``experts.`` never matches inside ``shared_experts.`` (Transformers'
  unanchored search once split ``shared_experts`` into thousands of keys on save);
* the replacement is spliced at the matched position (Transformers replaces the first *textual* occurrence).

Source patterns name checkpoint keys (after Transformers-style renamings), target patterns name parameters of the
patched model. ``*`` stands for a module index (``mlp.experts.*.gate_proj.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from transformers import core_model_loading as _tcml

from ..errors import ModelpatchTypeError
from .errors import ConversionError
from .ops import as_modelpatch_op, check_operation

__all__ = [
    "Layout",
    "LayoutWeightConverter",
    "LayoutWeightRenaming",
    "rule_layout",
    "WeightConverter",
    "WeightRenaming",
    "RuleMatch",
    "match_rule",
    "pattern_regex",
    "as_modelpatch_rule",
    "original_patterns",
]


def original_patterns(rule) -> tuple[list[str], list[str]]:
    """``(source patterns, target patterns)`` of a Transformers ``WeightConverter`` / ``WeightRenaming`` (or ours) as
    they were written, before Transformers compiled them into its matching regexes.

    Transformers keeps them in the private ``_original_source_patterns`` / ``_original_target_patterns``; this is the
    one place modelpatch reads them, so a rename upstream is one change here."""
    return list(rule._original_source_patterns), list(rule._original_target_patterns)  # noqa: SLF001 - the one accessor of Transformers' pattern attributes (no public form)


_NAME_START = re.compile(r"[A-Za-z0-9_]")


def pattern_regex(pattern: str) -> str:
    """Regex text for one source pattern, anchored on module-path boundaries (see module docstring)."""
    body = pattern.replace("*.", r".*\.")
    if re.search(r"[a-zA-Z0-9]$", body):
        body += r"(?!\w)"
    if _NAME_START.match(body):
        body = r"(?<![^.])" + body
    return body


class _BoundaryMatching:
    __slots__ = ()

    def _compile_boundaries(self: Any) -> None:
        branches = [
            f"(?P<g{i}>{pattern_regex(p)})"
            for i, p in sorted(enumerate(self.source_patterns), key=lambda item: -len(item[1]))
        ]
        self.compiled_sources = re.compile("|".join(branches))

    def rename_source_key(self: Any, source_key: str) -> tuple[str, str | None]:
        match = match_rule(self, source_key)
        if match is None:
            return source_key, None
        self._was_used = True
        return match.renamed_key, match.source_pattern


class WeightRenaming(_BoundaryMatching, _tcml.WeightRenaming):
    """Rename checkpoint keys: ``WeightRenaming(source_patterns, target_patterns)`` (one pattern each, regex allowed,
    ``\\1`` back-references as in Transformers). The tensor itself is unchanged."""

    __slots__ = ()

    def __init__(self, source_patterns, target_patterns):
        super().__init__(source_patterns=source_patterns, target_patterns=target_patterns)
        if len(self.source_patterns) != 1 or len(self.target_patterns) != 1:
            raise ConversionError(f"WeightRenaming takes one source and one target pattern, got {self!r}")
        self._compile_boundaries()


class WeightConverter(_BoundaryMatching, _tcml.WeightConverter):
    """Convert checkpoint tensors with ``operations`` applied in order.

    ``WeightConverter(source_patterns, target_patterns, operations)``: one-to-one, many-to-one (e.g. q/k/v → qkv with
    ``Concatenate``) or one-to-many (e.g. fused experts → per-expert with ``Chunk`` + ``SplitModulelist``).
    Transformers' operations are replaced by the modelpatch equivalents (exact inverses).

    Raises:
        ConversionError: many-to-many patterns, or no operation.
        TypeError: ``operations`` is not a list, or holds an operation class instead of an instance
            (``[Concatenate]`` instead of ``[Concatenate(dim=0)]``).
    """

    __slots__ = ()

    def __init__(self, source_patterns, target_patterns, operations, **kwargs):
        if isinstance(operations, type):
            check_operation(operations)  # names the class and the instance to write instead
        if isinstance(operations, _tcml.ConversionOps):
            raise ModelpatchTypeError(
                f"operations must be a list, got one operation: write operations=[{operations!r}]"
            )
        if isinstance(operations, (str, bytes)) or not isinstance(operations, Iterable):
            raise ModelpatchTypeError(f"operations must be a list of operation instances, got {operations!r}")
        operations = [as_modelpatch_op(op) for op in operations]
        try:
            super().__init__(source_patterns, target_patterns, operations, **kwargs)
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
        self._compile_boundaries()

    def __repr__(self):
        return (
            f"WeightConverter(source_patterns={original_patterns(self)[0]}, "
            f"target_patterns={original_patterns(self)[1]}, operations={self.operations})"
        )


@dataclass(frozen=True)
class Layout:
    """One of several checkpoint layouts that rules of one recipe accept for the same parameters.

    A recipe may load a parameter from checkpoints in different layouts (per-expert tensors, or the fused experts
    tensors of ``save_pretrained(..., save_original_format=False)``): its rules for each layout carry a
    :class:`Layout` of one ``group``. What a load reverses on save is then decided by the checkpoint: the layouts
    of the group whose rules fired (all rules of those layouts are kept, the other layouts' rules are dropped);
    when no rule of the group fired, and for a model that was built rather than loaded, the ``default`` layout.
    A layout that did not fire does not warn "matched no checkpoint key" when another layout of its group fired.

    Attributes:
        group: name shared by the alternative layouts (e.g. ``"qwen3_moe-experts"``).
        name: this layout (e.g. ``"per-expert"``, ``"fused"``).
        default: the layout written when nothing was loaded (at most one per group).
    """

    group: str
    name: str
    default: bool = False


class LayoutWeightRenaming(WeightRenaming):
    """A :class:`WeightRenaming` that belongs to one checkpoint :class:`Layout` (keyword ``layout``)."""

    __slots__ = ("layout",)

    def __init__(self, source_patterns, target_patterns, *, layout: Layout | None = None):
        super().__init__(source_patterns, target_patterns)
        self.layout = layout

    def copy(self, source_patterns, target_patterns, **kwargs):
        new = super().copy(source_patterns, target_patterns, **kwargs)
        new.layout = self.layout  # the reverse of a rule belongs to its layout too
        return new


class LayoutWeightConverter(WeightConverter):
    """A :class:`WeightConverter` that belongs to one checkpoint :class:`Layout` (keyword ``layout``)."""

    __slots__ = ("layout",)

    def __init__(self, source_patterns, target_patterns, operations, *, layout: Layout | None = None, **kwargs):
        super().__init__(source_patterns, target_patterns, operations, **kwargs)
        self.layout = layout

    def copy(self, source_patterns, target_patterns, **kwargs):
        new = super().copy(source_patterns, target_patterns, **kwargs)
        new.layout = self.layout  # the reverse of a rule belongs to its layout too
        return new

    def __repr__(self):
        return super().__repr__()[:-1] + f", layout={getattr(self.layout, 'name', None)!r})"


def rule_layout(rule) -> Layout | None:
    """The :class:`Layout` of ``rule``, or ``None`` for a rule that applies to every layout."""
    layout = getattr(rule, "layout", None)
    return layout if isinstance(layout, Layout) else None


@dataclass(frozen=True)
class RuleMatch:
    """Where a rule matched a key: ``key == prefix + <matched text> + suffix``; ``renamed_key`` has the rule's first
    target pattern in place of the matched text."""

    prefix: str
    suffix: str
    source_pattern: str
    renamed_key: str


def match_rule(rule: _tcml.WeightTransform, key: str) -> RuleMatch | None:
    """Match ``rule`` (modelpatch or Transformers transform, honouring its ``scope_prefix``) against ``key``."""
    matched = rule._scoped_match(key)
    if matched is None:
        return None
    prefix_dot, key_to_match, m = matched
    group = next(name for name, val in m.groupdict().items() if val is not None)
    replacement = rule.target_patterns[0]
    if r"\1" in replacement:
        replacement = replacement.replace(r"\1", m.group(rule.compiled_sources.groupindex[group] + 1))
    prefix = (prefix_dot or "") + key_to_match[: m.start()]
    suffix = key_to_match[m.end() :]
    return RuleMatch(prefix, suffix, rule.source_patterns[int(group[1:])], prefix + replacement + suffix)


def as_modelpatch_rule(rule) -> WeightRenaming | WeightConverter:
    """Accept a modelpatch rule as is; rebuild a plain Transformers ``WeightRenaming``/``WeightConverter`` as the
    modelpatch equivalent (boundary matching, exact inverses).

    Raises:
        TypeError: ``rule`` is not a weight transform.
    """
    if isinstance(rule, (WeightRenaming, WeightConverter)):
        return rule
    rebuilt: WeightRenaming | WeightConverter | None
    if type(rule) is _tcml.WeightRenaming:
        rebuilt = WeightRenaming(*original_patterns(rule))
    elif type(rule) is _tcml.WeightConverter:
        rebuilt = WeightConverter(
            *original_patterns(rule),
            list(rule.operations),
            force_cpu=getattr(rule, "force_cpu", False),
        )
    else:
        rebuilt = None
    if rebuilt is not None:
        # what the user set on the Transformers rule keeps applying (a rule scoped to a sub-model stays scoped)
        rebuilt.scope_prefix = getattr(rule, "scope_prefix", None)
        rebuilt.base_model_prefix = getattr(rule, "base_model_prefix", None)
        return rebuilt
    raise ModelpatchTypeError(f"expected a WeightRenaming or WeightConverter, got {type(rule).__name__}: {rule!r}")
