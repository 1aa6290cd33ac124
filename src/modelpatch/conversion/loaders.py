"""Which layout a state dict or checkpoint is in, for a model that carries conversion rules, and what loading it
would do: the analysis behind ``model.load_state_dict`` in both layouts (:mod:`.statedict`) and behind the loaders
built on it or beside it (``load_sharded_checkpoint``, accelerate's ``load_checkpoint_in_model``,
``safetensors.torch.load_model``; their wrappers live in :mod:`modelpatch.integrations.loaders`).

Every key given for a model falls in exactly one class:

* the **model's layout**: a key of ``model.state_dict()`` (``qkv_proj.weight`` on a fused-QKV model), loaded as is;
* the **original layout**: a key the model's rules convert (``q_proj``/``k_proj``/``v_proj``), or rename, into keys
  of the model. A group given whole is converted; a group given in part is placed into its rows of the fused
  parameter (rules whose rows are known: ``Concatenate``, ``MergeModulelist``, both);
* **neither**: any other key (``unexpected_keys`` with ``strict=False``; :class:`StateDictLayoutError` with
  ``strict=True``).

The rules of ambiguity (:func:`analyse_state_dict` raises :class:`StateDictLayoutError` before any parameter is
written, naming both keys):

* the same rows named in both layouts (``qkv_proj.weight`` beside ``q_proj.weight``) raise **always**, even when
  the values agree: which one is meant cannot be told, and agreeing values would only hide the mistake until they
  do not. (A value that *is* the model's own parameter object, as ``torch.distributed.checkpoint``'s
  ``set_model_state_dict`` fills in for every key the checkpoint lacks, carries no values of its own and names no
  rows: it is not counted as given.)
* a tensor whose shape fits no layout (a model key of the wrong shape, or a group that converts to the wrong
  shape) raises, naming the key, both shapes and the layout.

Pure logic: nothing here writes a parameter (:class:`StateDictAnalysis` converts, :meth:`~StateDictAnalysis.
write_partial` is the one write, called by the hook), and nothing wraps a library function.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from .errors import ConversionError, ConversionShapeError, StateDictLayoutError
from .loading import model_key
from .manual import resolve_transforms
from .plan import ConversionGroup, build_plan, dtype_of, shape_of
from .reference import ReferenceShapes, state_shapes
from .state import ConversionState, get_state

__all__ = [
    "StateDictAnalysis",
    "analyse_state_dict",
    "analyse_checkpoint",
    "CheckpointConversion",
    "checkpoint_headers",
    "loads_in_parts",
    "original_names",
]

_PART_OPERATIONS = (["Concatenate"], ["MergeModulelist"], ["MergeModulelist", "Concatenate"])


def loads_in_parts(rule) -> bool:
    """Whether a group of ``rule`` given in part can be placed exactly into its rows of the fused parameter:
    one target and the operations ``Concatenate(dim)`` (q/k/v), ``MergeModulelist(dim)`` (experts) or
    ``MergeModulelist`` then ``Concatenate`` (per-expert gate/up)."""
    ops = [type(op).__name__ for op in getattr(rule, "operations", ())]
    return len(getattr(rule, "target_patterns", ())) == 1 and ops in _PART_OPERATIONS


@dataclass
class Placement:
    """One source of a group given in part: ``target`` is the view of the model's parameter ``key`` its rows take."""

    source: str
    key: str
    target: torch.Tensor
    tensor: Any


@dataclass
class StateDictAnalysis:
    """What a state dict (keys relative to the model) is, for one model. Built by :func:`analyse_state_dict`.

    Attributes:
        direct: ``{key}`` given in the model's layout (values not the model's own tensors).
        own_given: keys whose value is the model's own parameter/buffer object (present, naming no rows).
        renamed: ``{given key: model key}`` for keys only renamed by the rules (legacy layouts).
        converted: ``[(group, [(output name, model key)])]`` for groups given whole.
        placements: the sources of groups given in part (:class:`Placement`), already checked to fit.
        unexpected: keys in neither layout, in the order given.
        missing: model keys no given key provides (in the model's layout; see :meth:`missing_in_caller_layout`).
        shapes: ``{model key: shape}`` (also without the base-model prefix), the reference the groups convert to.
        shapes_given: ``{given key: shape}`` (``None`` for a value without one).
        plan: the conversion plan of the original-layout keys (``None`` when there are none).
    """

    model: Any
    direct: dict = field(default_factory=dict)
    own_given: set = field(default_factory=set)
    renamed: dict = field(default_factory=dict)
    converted: list = field(default_factory=list)
    placements: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    shapes: dict = field(default_factory=dict)
    shapes_given: dict = field(default_factory=dict)
    plan: Any = None

    @property
    def foreign(self) -> bool:
        """Whether any key is in the original layout (converted, renamed or placed)."""
        return bool(self.converted or self.renamed or self.placements)

    def source_keys(self) -> set[str]:
        """The given keys the rules consume (converted groups, placed parts, renamed keys)."""
        keys = {k for group, _ in self.converted for k in group.source_keys()}
        return keys | {p.source for p in self.placements} | set(self.renamed)

    def missing_in_caller_layout(self, keys: list[str] | None = None) -> list[str]:
        """:attr:`missing` (or ``keys`` of it), named in the layout the caller used: when any key was in the
        original layout, a missing converted parameter is named by its sources (``q_proj.weight``, not
        ``qkv_proj.weight``), less the sources given in part."""
        keys = list(self.missing) if keys is None else keys
        state = get_state(self.model)
        if not self.foreign or state is None or not keys:
            return keys
        return rename_missing(self.model, state, keys, {p.source for p in self.placements})

    def untied_missing(self) -> list[str]:
        """:attr:`missing` less the keys whose tensor shares its storage with a key that is provided (tied weights:
        ``lm_head.weight`` when ``embed_tokens.weight`` is given), as ``safetensors.torch.load_model`` counts them."""
        own = self.model.state_dict()
        lost = set(self.missing)

        def pointer(tensor):
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                return None
            return tensor.untyped_storage().data_ptr()

        given = {pointer(t) for k, t in own.items() if k not in lost} - {None}
        return [k for k in self.missing if pointer(own.get(k)) not in given or pointer(own.get(k)) is None]

    def convert(self) -> dict[str, torch.Tensor]:
        """``{model key: tensor}`` for every group given whole, converted from the tensors it was planned with (real
        tensors only)."""
        result: dict = {}
        with torch.no_grad():
            for group, outputs in self.converted:
                names = dict(outputs)
                for name, tensor in self.plan.convert_group(group, self.shapes).items():
                    result[names[name]] = tensor
        return result

    def convert_group(self, group: ConversionGroup, sources: dict) -> dict[str, torch.Tensor]:
        """``{model key: tensor}`` of one group of :attr:`converted`, from ``{source key: tensor}`` (consumed)."""
        names = dict(next(outputs for g, outputs in self.converted if g is group))
        with torch.no_grad():
            converted = self.plan.convert_group(group, self.shapes, sources=sources)
        return {names[name]: tensor for name, tensor in converted.items()}

    def write_partial(self) -> set[str]:
        """Copy every placed part into its rows (every placement was checked first). Returns the source keys."""
        with torch.no_grad():
            for placement in self.placements:
                placement.target.copy_(placement.tensor)
        return {p.source for p in self.placements}

    def strict_error(
        self, model_name: str, *, missing: bool = True, tied_count_as_given: bool = False
    ) -> StateDictLayoutError | None:
        """The error a strict load raises before anything is written (``None`` when there is none), worded like
        ``torch``'s (``Missing key(s) in state_dict: "k"``), with each unexpected key's shape and layout.

        ``missing=False``: only keys in neither layout count (accelerate's ``strict``); ``tied_count_as_given``: a
        missing key tied to a given one does not count (:meth:`untied_missing`)."""
        lost = []
        if missing:
            lost = self.missing_in_caller_layout(self.untied_missing() if tied_count_as_given else None)
        if not lost and not self.unexpected:
            return None
        lines = [f"Error(s) in loading state_dict for {model_name}:"]
        if lost:
            lines.append("\tMissing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in lost) + ".")
        if self.unexpected:
            described = ", ".join(f'"{k}" (shape {self.shapes_given.get(k)})' for k in self.unexpected)
            lines.append(
                f"\tUnexpected key(s) in state_dict: {described}: in neither the model's layout (its own "
                "state_dict() keys) nor the original layout its conversion rules convert from."
            )
        lines.append(
            "Nothing was loaded. Give the keys of one layout (model.state_dict() or the checkpoint's), or pass "
            "strict=False to load the rest and get these keys reported in the result."
        )
        return StateDictLayoutError("\n".join(lines), keys=lost + list(self.unexpected))


def _describe(key: str, value) -> str:
    try:
        return f"'{key}' {tuple(shape_of(value))}"
    except Exception:  # noqa: BLE001 - a value without a shape (extra state)
        return f"'{key}'"


def _fits(given, param) -> bool:
    """``torch``'s own shape rule of ``_load_from_state_dict`` (a 0-d parameter takes a 1-element 1-d tensor)."""
    try:
        given_shape = tuple(shape_of(given))
    except Exception:  # noqa: BLE001 - not a tensor: torch does not compare it
        return True
    if not isinstance(param, torch.Tensor) or torch.nn.parameter.is_lazy(param):
        return True
    shape = tuple(param.shape)
    return given_shape == shape or (shape == () and given_shape == (1,))


def _default_loader(model, key: str) -> bool:
    """Whether the module holding ``key`` loads it with ``torch``'s own ``_load_from_state_dict`` (quantized layers
    that load their own components are left to themselves)."""
    path = key.rpartition(".")[0]
    try:
        module = model.get_submodule(path) if path else model
    except AttributeError:
        return False
    return type(module)._load_from_state_dict is torch.nn.Module._load_from_state_dict


def analyse_state_dict(model, items: Iterable[tuple[str, Any]], own: Mapping | None = None) -> StateDictAnalysis:
    """Classify ``items`` (``(key relative to model, tensor)`` pairs; tensors may be ``meta`` for a dry analysis of a
    checkpoint's headers) for ``model``, plan the conversion of the original-layout keys and check everything that
    can be checked before a parameter is written.

    Args:
        model: a model that carries conversion state (its rules, then Transformers' built-in rules they leave).
        items: the state dict's entries (``torch.Tensor``, ``[out, in]`` etc., any dtype).
        own: ``model.state_dict(keep_vars=True)`` when the caller has it.

    Raises:
        StateDictLayoutError: the same rows given in both layouts (both keys named), whatever their values; a key
            of the model's layout with a shape that fits no layout.
        ConversionShapeError: a group converts to a tensor that does not fit its parameter.
        ConversionError: a group given in part whose rows cannot be told, or that do not fit.
    """
    own = model.state_dict(keep_vars=True) if own is None else own
    base = model.base_model_prefix
    analysis = StateDictAnalysis(model)
    foreign: list = []
    given: dict = {}
    for key, value in items:
        given[key] = value
        analysis.shapes_given[key] = _shape_or_none(value)
        if key in own:
            if value is own[key]:
                analysis.own_given.add(key)
            else:
                analysis.direct[key] = value
        elif model_key(key, own, base) is None:
            foreign.append((key, value))
        else:  # the key of a model parameter without (or with) the base-model prefix: torch reports it unexpected
            analysis.unexpected.append(key)
    analysis.shapes = state_shapes(((k, v.shape) for k, v in own.items() if isinstance(v, torch.Tensor)), base)
    if foreign:
        _plan_foreign(analysis, foreign, own, base)
    _check_both_layouts(analysis, given)
    for key, value in analysis.direct.items():
        if not _fits(value, own[key]) and _default_loader(model, key):
            raise StateDictLayoutError(
                f"{_describe(key, value)} is a key of the model's layout, but the model's '{key}' has shape "
                f"{tuple(own[key].shape)}; no layout of {type(model).__name__} has it in that shape (in the original "
                "layout its rows come from the keys the conversion rules name). Nothing was loaded.",
                keys=[key],
            )
    provided = set(analysis.direct) | analysis.own_given | set(analysis.renamed.values())
    provided |= {key for _, outputs in analysis.converted for _, key in outputs}
    analysis.missing = [k for k in own if k not in provided]
    order = {k: i for i, k in enumerate(given)}
    analysis.unexpected.sort(key=lambda k: order.get(k, len(order)))
    return analysis


def _shape_or_none(value):
    try:
        return tuple(shape_of(value))
    except Exception:  # noqa: BLE001 - a value without a shape (extra state)
        return None


def _load_rules(model) -> tuple[list, list]:
    """The rules a state dict is converted with: the model's (then Transformers' built-in converters they leave,
    after Transformers' renamings, as :func:`~modelpatch.conversion.load_converted_state_dict`), then those of the
    alternative layouts the model was not loaded from (``ConversionState.also_loads``)."""
    resolved, renamings = resolve_transforms(model, None)
    state = get_state(model)
    others = [r for r in (state.also_loads if state is not None else []) if all(r is not x for x in resolved.rules)]
    return resolved.rules + others, renamings


def _plan_foreign(analysis: StateDictAnalysis, foreign: list, own: Mapping, base: str) -> None:
    model = analysis.model
    rules, renamings = _load_rules(model)
    incomplete: list = []
    plan = build_plan(foreign, rules, key_renamings=renamings, incomplete=incomplete)
    dry = plan.dry_run(analysis.shapes)  # as from_pretrained: the model's own shapes (a fused parameter's size)
    targets: dict = {}
    for name, (shape, _, group) in dry.items():
        key = model_key(name, own, base)
        if key is None:
            continue  # not a parameter of this model: its sources stay unexpected keys, as torch reports them
        if tuple(shape) != tuple(analysis.shapes[key]):
            raise ConversionShapeError(key, shape, analysis.shapes[key], _from_sources(group))
        targets.setdefault(id(group), (group, []))[1].append((name, key))
    for _name, (_, _, group) in list(dry.items()):
        if id(group) not in targets and group.key in plan.groups:
            plan.unconvert(group, dry)
    analysis.converted = list(targets.values())
    analysis.plan = plan
    claimed: set = set()
    foreign_keys = dict(foreign)
    for name, obj in plan.passthrough.items():  # renamed keys (Transformers' legacy renamings) and unconverted keys
        if name in foreign_keys and foreign_keys[name] is obj:
            source = name
        else:
            source = next((k for k, o in foreign if o is obj and k not in claimed), None)
        if source is None:
            continue
        claimed.add(source)
        key = model_key(name, own, base)
        if key is None or key == source:
            analysis.unexpected.append(source)
        else:
            analysis.renamed[source] = key
    for group in incomplete:
        if _group_target(group, own, base) is None:  # e.g. a layer the model does not have
            analysis.unexpected.extend(group.source_keys())
            incomplete = [g for g in incomplete if g is not group]
    state = get_state(model)
    analysis.placements = _placements(model, incomplete, own, base, state)


def _from_sources(group: ConversionGroup) -> str:
    """The rule and the original-layout keys of ``group`` with their shapes, for a shape error."""
    sources = ", ".join(_describe(k, o) for items in group.sources.values() for k, o in items)
    return f"{group.rule!r}, from {sources} in the original layout"


def _group_target(group: ConversionGroup, own: Mapping, base: str) -> str | None:
    targets = group.rule.target_patterns
    if len(targets) != 1:
        return None
    return model_key(group.prefix + targets[0] + group.suffix, own, base)


def _check_both_layouts(analysis: StateDictAnalysis, given: dict) -> None:
    """Raise when a model key is named in the model's layout and produced from the original layout too."""
    claims: dict[str, list[str]] = {}
    for group, outputs in analysis.converted:
        for _, key in outputs:
            claims.setdefault(key, []).extend(group.source_keys())
    for placement in analysis.placements:
        claims.setdefault(placement.key, []).append(placement.source)
    for source, key in analysis.renamed.items():
        claims.setdefault(key, []).append(source)
    twice = [(key, sources) for key, sources in claims.items() if key in analysis.direct]
    if twice:
        key, sources = twice[0]
        more = [k for k, _ in twice[1:]]
        also = f" (and {len(more)} more: {more[:5]}{' ...' if len(more) > 5 else ''})" if more else ""
        raise StateDictLayoutError(
            f"'{key}' is given twice: in the model's layout and from {sources} in the original layout, which name "
            f"the same rows{also}. Which one is meant cannot be told (this is refused even when the values agree); "
            "give one of them. Nothing was loaded.",
            keys=[k for pair in twice for k in (pair[0], *pair[1])],
        )
    for key, sources in claims.items():
        if len(set(sources)) < len(sources) or (key in analysis.renamed.values() and len(sources) > 1):
            raise StateDictLayoutError(
                f"'{key}' is given more than once in the original layout (from {sources}); give one of them. "
                "Nothing was loaded.",
                keys=[key, *sources],
            )


def _source_index(pattern: str, key: str) -> int | None:
    """The module-list index ``*`` stands for in ``pattern`` within ``key`` (``experts.*.w1`` in ``...experts.3.w1``)."""
    if "*" not in pattern:
        return None
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    return int(found.group(1)) if found else None


def _placements(model, incomplete: list, own: Mapping, base: str, state: ConversionState | None) -> list[Placement]:
    """Where each source of the groups given in part goes in its fused parameter (as vLLM's ``weight_loader``
    places it): the rows of ``Concatenate(dim)`` (q/k/v), the slice of ``MergeModulelist(dim)`` (one expert), both
    (per-expert gate/up). The rest of the parameter keeps its values, as a plain ``load_state_dict`` of a partial
    dict does.

    Raises:
        ConversionError: any other rule given only part of its sources (it cannot be placed exactly); or the rows a
            source would take are unknown or do not fit.
    """
    placed: list[Placement] = []
    references = ReferenceShapes(state.recorded_shapes if state is not None else {}, model)
    for group in incomplete:
        key = _group_target(group, own, base)
        if key is None or not loads_in_parts(group.rule):
            raise ConversionError(
                f"{group.rule!r}: only {list(group.source_keys())} of the sources of '{group.key}' were given; this "
                "rule's layout cannot be loaded in parts. Give all its sources in one load_state_dict call. Nothing "
                "was loaded."
            )
        ops = [type(op).__name__ for op in group.rule.operations]
        param = own[key]
        concat = group.rule.operations[-1].dim if ops[-1] == "Concatenate" else None
        stack = group.rule.operations[0].dim if ops[0] == "MergeModulelist" else None
        inner = None if concat is None else concat - (1 if stack is not None and stack <= concat else 0)
        patterns = list(group.rule.source_patterns)
        offsets, start = {}, 0
        for pattern in patterns:
            offsets[pattern] = start
            if inner is None:
                continue
            given = group.sources.get(pattern)
            if given:
                size = shape_of(given[0][1])[inner]
            else:
                name = group.prefix + pattern + group.suffix
                shape = None if "*" in pattern else references.get(name)
                rest = [p for p in patterns if p != pattern and not group.sources.get(p)]
                if shape is None and not rest:
                    others = sum(shape_of(group.sources[p][0][1])[inner] for p in patterns if p != pattern)
                    size = param.shape[concat] - others
                elif shape is None:
                    raise ConversionError(
                        f"{group.rule!r}: the rows of {pattern!r} in '{key}' are unknown (its size is not recorded); "
                        "give all the sources of the group in one call. Nothing was loaded."
                    )
                else:
                    size = shape[concat]
            start += int(size)
        for pattern, pairs in group.sources.items():
            for source_key, tensor in pairs:
                target = param.data
                if stack is not None:
                    index = _source_index(pattern, source_key)
                    if index is None or index >= target.shape[stack]:
                        raise ConversionError(f"'{source_key}': no row of '{key}' for it. Nothing was loaded.")
                    target = target.select(stack, index)
                shape = tuple(shape_of(tensor))
                if inner is not None:
                    if offsets[pattern] + shape[inner] > target.shape[inner]:
                        raise ConversionShapeError(key, shape, tuple(target.shape), _from_sources(group))
                    target = target.narrow(inner, offsets[pattern], shape[inner])
                if tuple(target.shape) != shape:
                    raise ConversionShapeError(key, shape, tuple(target.shape), _from_sources(group))
                placed.append(Placement(source_key, key, target, tensor))
    return placed


def original_names(model, state: ConversionState, keys: list[str]) -> dict[str, tuple[str, ...]]:
    """``{model key: original-layout keys}`` for those ``keys`` that the model's rules convert (names only: the
    reverse rules run on ``meta`` tensors). Keys of groups that cannot be reversed alone are left out."""
    resolved, _ = resolve_transforms(model, None)
    reversed_rules = [rule.reverse_transform() for rule in resolved.rules]
    own = model.state_dict()
    meta = [(key, torch.empty(own[key].shape, dtype=own[key].dtype, device="meta")) for key in keys if key in own]
    incomplete: list = []
    try:
        plan = build_plan(meta, reversed_rules, reverse=True, incomplete=incomplete)
        dry = plan.dry_run(ReferenceShapes(state.recorded_shapes, model))
    except ConversionError:
        return {}
    result: dict[str, list[str]] = {}
    for name, (_, _, group) in dry.items():
        for source in group.source_keys():
            result.setdefault(source, []).append(name)
    return {key: tuple(names) for key, names in result.items()}


def rename_missing(model, state: ConversionState, missing: list[str], written: set[str]) -> list[str]:
    """``missing`` model keys, each that the rules convert replaced by its original-layout sources (less
    ``written``, the sources given in part)."""
    names = original_names(model, state, list(missing))
    result: list[str] = []
    for key in missing:
        if key in names:
            result += [source for source in names[key] if source not in written]
        else:
            result.append(key)
    return result


# -- checkpoints on disk ------------------------------------------------------------------------------------------


def checkpoint_headers(files: Iterable[str | os.PathLike]) -> dict[str, tuple[str, torch.Tensor]]:
    """``{key: (file, meta tensor)}`` of every tensor of checkpoint ``files`` (``.safetensors``: the header only;
    ``.bin``/``.pt``: ``torch.load`` onto ``meta``), without reading tensor data.

    Raises:
        ConversionError: a key is stored in two files.
    """
    headers: dict = {}
    for file in files:
        file = os.fspath(file)
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    part = handle.get_slice(key)
                    headers.setdefault(key, []).append((file, _meta(part)))
        else:
            for key, tensor in torch.load(file, map_location="meta", weights_only=True).items():
                headers.setdefault(key, []).append((file, tensor))
    result = {}
    for key, entries in headers.items():
        if len(entries) > 1:
            raise ConversionError(f"'{key}' is stored in {[f for f, _ in entries]}; a checkpoint names each key once")
        result[key] = entries[0]
    return result


def _meta(part) -> torch.Tensor:
    return torch.empty(tuple(part.get_shape()), dtype=dtype_of(part), device="meta")


def analyse_checkpoint(model, files: Iterable[str | os.PathLike]) -> tuple[StateDictAnalysis, dict[str, str]]:
    """:func:`analyse_state_dict` of a checkpoint's headers (no tensor read). Returns the analysis and
    ``{key: file}``. Raises as :func:`analyse_state_dict` and :func:`checkpoint_headers`."""
    headers = checkpoint_headers(files)
    analysis = analyse_state_dict(model, [(key, meta) for key, (_, meta) in headers.items()])
    return analysis, {key: file for key, (file, _) in headers.items()}


def _read_tensor(file: str, key: str, cache: dict) -> torch.Tensor:
    if file.endswith(".safetensors"):
        with safe_open(file, framework="pt", device="cpu") as handle:
            return handle.get_tensor(key)
    if file not in cache:
        cache[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    return cache[file][key]


class CheckpointConversion:
    """A checkpoint on disk given in the original layout, converted file by file into the model's layout for a
    loader that reads one file at a time (accelerate's ``load_checkpoint_in_model``): :meth:`convert_file` returns a
    file's tensors with every group converted whole. A group split across files is converted once, when the first
    of its files is loaded (the sources other files hold are read then), and every file that holds one of its
    sources delivers its converted tensors (so no file's dict comes back empty; a loader writes them again, with
    the same values); they are let go after the last of those files.

    Built from the headers (:func:`analyse_checkpoint`), so every check of :func:`analyse_state_dict` has run
    before the first tensor is read. Groups the checkpoint gives only in part stay as they are (the
    ``load_state_dict`` hook places them; a loader that writes parameters one by one must refuse them: see
    :attr:`partial`).
    """

    def __init__(self, model, files: Iterable[str | os.PathLike]):
        self.files = [os.path.realpath(os.fspath(f)) for f in files]
        self.analysis, file_of = analyse_checkpoint(model, self.files)
        self.file_of = file_of
        self._pending: dict[int, set[str]] = {
            id(group): {file_of[s] for s in group.source_keys()} for group, _ in self.analysis.converted
        }
        self._outputs: dict[int, dict] = {}

    @property
    def partial(self) -> list[str]:
        """Keys of groups the checkpoint gives only in part."""
        return [p.source for p in self.analysis.placements]

    def convert_file(self, file: str | os.PathLike, tensors: dict) -> dict:
        """``tensors`` (all of ``file``'s) in the model's layout: groups converted (on the device of their first
        source in this file), renamed keys renamed, other keys as they are. ``file`` not of this checkpoint:
        ``tensors`` unchanged."""
        file = os.path.realpath(os.fspath(file))
        if file not in self.files:
            return tensors
        out = dict(tensors)
        cache: dict = {}
        for group, _ in self.analysis.converted:
            pending = self._pending[id(group)]
            if file not in pending:
                continue
            sources = group.source_keys()
            if id(group) not in self._outputs:
                here = [out[s] for s in sources if s in out]
                device = here[0].device if here else torch.device("cpu")
                collected = {}
                for source in sources:
                    tensor = out[source] if source in out else _read_tensor(self.file_of[source], source, cache)
                    collected[source] = tensor.to(device)
                self._outputs[id(group)] = self.analysis.convert_group(group, collected)
            for source in sources:
                out.pop(source, None)
            out.update(self._outputs[id(group)])
            pending.discard(file)
            if not pending:
                del self._outputs[id(group)]
        for source, key in self.analysis.renamed.items():
            if source in out:
                out[key] = out.pop(source)
        return out
