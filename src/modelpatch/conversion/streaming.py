"""The original layout one conversion group at a time: the one path behind ``save_pretrained`` and
:func:`~modelpatch.iter_original_state_dict`.

A model's in-memory layout can differ from its checkpoint layout in two stages, and the way back runs them in the
order saving always did (see :mod:`.saving`), each first planned over key names, then converted group by group:

A. **built-in stage**, :class:`BuiltinStage`: Transformers' ``revert_weight_conversion`` (``core_model_loading``)
   split into its two loops. The key loop runs as Transformers runs it (keys in ``dot_natural_key`` order, the
   reversed transforms in reverse order, at most one converter per key, renamings on the other keys, one entry per
   renamed key), so the groups, the stateful renamings (``GroupWeightRename``) and every output are those of the
   original; the conversion loop becomes lazy: a group is converted, with Transformers' own ``convert``, when its
   turn comes, and the converter holds no tensor afterwards.
B. **user stage**, :func:`iter_reverted`: the reverse of the model's own rules (:func:`.plan.build_plan` with
   ``reverse=True``, converters in load priority, renamings undone last-applied first) over the names stage A will
   produce, known before anything is converted from a run of stage A's converter groups on ``meta`` tensors. A
   group of stage B is converted as soon as the last of its sources has come out of stage A.

What is held at any moment: the outputs of the stage-A group being handed out, the stage-A outputs waiting for the
rest of their stage-B group (in practice the model's own tensors: the two stages touch different parameters), and
the outputs of one stage-B group. A tensor is handed out once and not kept; a key no rule touches comes out as the
state dict's own tensor (no copy).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import core_model_loading as _tcml

from .errors import ConversionError
from .plan import Plan, build_plan
from .reference import ReferenceShapes
from .state import ConversionState

__all__ = ["BuiltinStage", "OriginalLayoutIterator", "transformers_conversions", "reversed_user_rules", "iter_reverted"]


def transformers_conversions(model) -> list | None:
    """The transforms ``revert_weight_conversion`` reverses for ``model``: ``model._weight_conversions`` (set by
    ``from_pretrained``), else ``get_model_conversion_mapping(model, add_legacy=False)`` without ``PrefixChange``
    (a model built from scratch is not re-saved with legacy renamings nor with a prefix it never had); ``None`` when
    there is none."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = get_model_conversion_mapping(model, add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, _tcml.PrefixChange)] or None
    return conversions


@dataclass
class _Entry:
    """One entry of Transformers' ``conversion_mapping``: a reversed converter (deep-copied, no tensor added yet), or
    ``None`` for keys that are only renamed; ``items`` are the ``add_tensor`` arguments, in the order Transformers
    adds them."""

    name: str
    converter: Any
    items: list = field(default_factory=list)


class BuiltinStage:
    """Stage A for one state dict (see the module docstring): :attr:`entries` in Transformers' order,
    :meth:`convert` one entry at a time.

    Source: ``transformers.core_model_loading.revert_weight_conversion`` (5.23), whose first loop is
    ``__init__`` and whose second loop is :meth:`convert` applied to each entry in turn.
    """

    def __init__(self, model, state_dict: dict, conversions: list | None):
        self.model = model
        self.renamings: list = []
        self.entries: list[_Entry] = []
        if conversions is None:  # Transformers returns the state dict as it is
            self.entries = [_Entry(key, None, [(key, key, tensor)]) for key, tensor in state_dict.items()]
            return
        reverse = [conversion.reverse_transform() for conversion in conversions[::-1]]
        self.renamings = [t for t in reverse if isinstance(t, _tcml.WeightRenaming)]
        converters = [t for t in reverse if isinstance(t, _tcml.WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        entries: dict[str, _Entry] = {}
        for key, tensor in sorted(state_dict.items(), key=lambda kv: _tcml.dot_natural_key(kv[0])):
            renamed, pattern = _tcml.apply_converters(key, converters)
            if pattern is not None:
                entry = entries.get(renamed)
                if entry is None:
                    entry = entries[renamed] = _Entry(renamed, copy.deepcopy(by_pattern[pattern]))
            else:
                renamed = _tcml.apply_renamings(key, self.renamings)
                entry = entries.setdefault(renamed, _Entry(renamed, None))
                pattern = key
            entry.items.append((key, pattern, tensor))
        self.entries = list(entries.values())

    @property
    def converts(self) -> bool:
        """Whether any entry runs a converter (else every output name is known from the key loop)."""
        return any(entry.converter is not None for entry in self.entries)

    def _transform(self, entry: _Entry, tensors) -> Any:
        if entry.converter is None:
            transform = _tcml.WeightRenaming(entry.items[0][0], entry.name)
        else:
            transform = entry.converter
        for (key, pattern, _), tensor in zip(entry.items, tensors):
            transform.add_tensor(entry.name, key, pattern, tensor)
        return transform

    def convert(self, entry: _Entry, renamings: list | None = None, meta: bool = False) -> dict[str, torch.Tensor]:
        """``{original-layout name: tensor}`` of one entry; the entry gives up its tensors (not with ``meta``: a dry
        run on ``meta`` tensors of a copy, with the renamings given, which keeps ``self`` as it was)."""
        renamings = self.renamings if renamings is None else renamings
        if entry.converter is None and len(entry.items) == 1 and _plain(entry.name):
            # what WeightRenaming(key, name).convert() returns, without compiling a pattern per key
            if meta:
                return {entry.name: entry.items[0][2]}
            ((key, pattern, tensor),) = entry.items
            entry.items = [(key, pattern, None)]
            return {entry.name: tensor}
        if meta:
            entry = _Entry(entry.name, copy.deepcopy(entry.converter), entry.items)
            tensors = [torch.empty_like(t, device="meta") for _, _, t in entry.items]
        else:
            tensors = [t for _, _, t in entry.items]
            entry.items = [(key, pattern, None) for key, pattern, _ in entry.items]
        transform = self._transform(entry, tensors)
        del tensors
        realized = transform.convert(entry.name, model=self.model, config=self.model.config)
        result = {}
        for name, value in realized.items():
            value = value[0] if isinstance(value, list) else value
            if isinstance(transform, _tcml.WeightConverter):
                name = _tcml.apply_renamings(name, renamings)
            result[name] = value
        return result

    def output_names(self) -> list[list[str]] | None:
        """The names each entry will produce (a dry run of the converters on ``meta`` tensors, with copies of the
        stateful renamings), or ``None`` when an operation cannot run on ``meta`` tensors."""
        renamings = copy.deepcopy(self.renamings)
        names = []
        for entry in self.entries:
            if entry.converter is None:
                names.append([entry.name] if len(entry.items) == 1 else list(self.convert(entry, renamings, True)))
                continue
            try:
                names.append(list(self.convert(entry, renamings, meta=True)))
            except Exception:  # noqa: BLE001 - an op that needs data: the caller converts stage A first
                return None
        return names


class OriginalLayoutIterator:
    """Iterator of ``(name, tensor)`` in the original layout (what :func:`iter_reverted` returns).

    Attributes:
        groups: conversion groups planned (Transformers' converter groups and groups of the user rules; a key that
            is only renamed or passed through is not a group).
        converted: groups converted so far (a group is converted when its first output is requested).
        sources: ``{name handed out: (model-layout keys it was made from, whether an operation made it)}``, filled
            as names are handed out (``False``: the key was passed through or only renamed); what
            :mod:`.optimizer` follows to move per-parameter state with the weights.
    """

    def __init__(self, groups: int):
        self.groups = groups
        self.converted = 0
        self.sources: dict[str, tuple[tuple[str, ...], bool]] = {}
        self._items: Iterator[tuple[str, torch.Tensor]] = iter(())

    def feed(self, items: Iterator[tuple[str, torch.Tensor]]) -> OriginalLayoutIterator:
        """Hand out ``(name, tensor)`` pairs from ``items`` (a generator that fills the attributes as it goes).
        Returns ``self``."""
        self._items = items
        return self

    def __iter__(self) -> OriginalLayoutIterator:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._items)

    def __repr__(self) -> str:
        return f"<OriginalLayoutIterator: {self.converted} of {self.groups} conversion groups converted>"


def _plain(name: str) -> bool:
    """Whether ``WeightRenaming(key, name)`` keeps ``name`` as its target (no anchor, group or lookaround)."""
    return not name.startswith("^") and "(" not in name


def reversed_user_rules(state: ConversionState) -> tuple[list, dict]:
    """The reverse of ``state.rules`` in save order, with ``{id(reversed rule): registry name}``: converters keep their
    load priority (the rule that won a key at load wins it back), renamings undo last-applied first."""
    converters = [r for r in state.rules if isinstance(r, _tcml.WeightConverter)]
    renamings = [r for r in state.rules if not isinstance(r, _tcml.WeightConverter)]
    reversed_rules, owner = [], {}
    for rule in converters + renamings[::-1]:
        reverse = rule.reverse_transform()
        reversed_rules.append(reverse)
        owner[id(reverse)] = state.owner.get(id(rule))
    return reversed_rules, owner


def _drain(outputs: dict, seen: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Hand out the items of ``outputs`` in order, each removed before it is handed out (nothing keeps it here)."""
    while outputs:
        name = next(iter(outputs))
        _once(name, seen)
        yield name, outputs.pop(name)


def _once(name: str, seen: set[str]) -> None:
    if name in seen:
        raise ConversionError(f"Two groups of the reverse conversion produce '{name}'")
    seen.add(name)


def iter_reverted(
    model, state_dict: dict, conversions: list | None, state: ConversionState | None
) -> OriginalLayoutIterator:
    """``(name, tensor)`` of ``state_dict`` (model layout) in the original layout: stage A with Transformers'
    ``conversions`` (see :func:`transformers_conversions`), then stage B with ``state``'s rules (``None``: none).

    Everything that can fail on names alone (a stage-B group missing a source, two keys renamed alike) fails here,
    before the iterator is returned; the conversions run as it is consumed. Once it is exhausted,
    ``state.save_rows`` holds the report rows of stage B.

    Raises:
        ConversionError: a stage-B group is incomplete or ambiguous, two groups produce the same name (here or while
            iterating), or an operation fails (while iterating).
    """
    stage_a = BuiltinStage(model, state_dict, conversions)
    converters = sum(entry.converter is not None for entry in stage_a.entries)
    if state is None:
        result = OriginalLayoutIterator(converters)
        result.feed(_stream_a(stage_a, result))
        return result
    names = stage_a.output_names() if stage_a.converts else [[e.name] for e in stage_a.entries]
    eager = None
    if names is None:  # an op of stage A needs data: convert stage A first, then stream stage B
        eager = [stage_a.convert(entry) for entry in stage_a.entries]
        names = [list(outputs) for outputs in eager]
    seen: set[str] = set()
    for name in (n for group in names for n in group):
        _once(name, seen)
    rules, owner = reversed_user_rules(state)
    plan = build_plan(((n, n) for group in names for n in group), rules, reverse=True)
    result = OriginalLayoutIterator(converters + len(plan.groups))
    result.converted = converters if eager is not None else 0
    result.feed(_stream_b(model, stage_a, eager, names, plan, owner, state, result))
    return result


def _entry_sources(entry: _Entry) -> tuple[tuple[str, ...], bool]:
    return tuple(key for key, _, _ in entry.items), entry.converter is not None


def _stream_a(stage_a: BuiltinStage, progress: OriginalLayoutIterator) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for entry in stage_a.entries:
        progress.converted += entry.converter is not None
        outputs = stage_a.convert(entry)
        progress.sources.update(dict.fromkeys(outputs, _entry_sources(entry)))
        yield from _drain(outputs, seen)


def _stream_b(
    model, stage_a, eager, names, plan: Plan, owner, state, progress: OriginalLayoutIterator
) -> Iterator[tuple[str, torch.Tensor]]:
    references = ReferenceShapes(state.recorded_shapes, model)
    final = {source: name for name, source in plan.passthrough.items()}
    group_of = {key: group for group in plan.groups.values() for items in group.sources.values() for key, _ in items}
    waiting = {id(group): sum(map(len, group.sources.values())) for group in plan.groups.values()}
    arrived: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    origin: dict[str, tuple[str, ...]] = {}  # stage-A output waiting in a group -> its model-layout keys
    plan.produced = {}
    for index, expected in enumerate(names):
        entry = stage_a.entries[index]
        if eager is None:
            progress.converted += entry.converter is not None
            outputs = stage_a.convert(entry)
        else:
            outputs, eager[index] = eager[index], {}
        keys, operated = _entry_sources(entry)
        if set(outputs) != set(expected):
            raise ConversionError(
                f"Transformers' built-in reverse conversion produced {list(outputs)}, not {expected} as planned"
            )
        for name in expected:
            if name in final:
                _once(final[name], seen)
                progress.sources[final[name]] = (keys, operated)
                yield final[name], outputs.pop(name)
                continue
            group = group_of[name]
            arrived[name] = outputs.pop(name)
            origin[name] = keys
            waiting[id(group)] -= 1
            if waiting[id(group)] == 0:
                progress.converted += 1
                made = tuple(dict.fromkeys(k for source in group.source_keys() for k in origin.pop(source)))
                converted = plan.convert_group(group, reference_shapes=references, sources=arrived)
                progress.sources.update(dict.fromkeys(converted, (made, True)))
                yield from _drain(converted, seen)
    state.save_rows = plan.rows("save", owner, plan.produced)
