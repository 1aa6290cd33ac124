"""Key grouping and tensor conversion, lazy for loading and eager for saving.

A *plan* maps checkpoint keys to rule groups: all keys feeding one converted parameter (e.g. ``q_proj``/``k_proj``/
``v_proj`` of one layer, or every expert of one layer) form a group, keyed like Transformers does by the key renamed
with the rule's first target pattern. Renamings chain first, then at most one converter (reverse order on save).

* :meth:`Plan.dry_run` runs every group on ``meta`` tensors: output names and shapes are known before any byte is
  read, so shape errors are raised before the model is touched.
* :meth:`Plan.lazy_outputs` returns :class:`LazyConverted` placeholders that Transformers' loader materialises with
  ``obj[...]`` (exactly as it does for safetensors slices), one group at a time, from its own worker threads.
* :meth:`Plan.convert_all` converts eagerly (saving, offline conversion of in-memory tensors).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import core_model_loading as _tcml

from .errors import ConversionError
from .pages import release_pages
from .placement import fill, placed_shape, placement
from .rules import match_rule

__all__ = [
    "ConversionRow",
    "ConversionGroup",
    "Plan",
    "build_plan",
    "LazyConverted",
    "shape_of",
    "dtype_of",
    "load_tensor",
]

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class ConversionRow:
    """One application of a rule: which checkpoint keys it read and which keys it produced.

    ``direction`` is ``"load"``, ``"save"`` or ``"offline"``; ``registered_as`` the registry name (``None`` for
    rules passed directly).
    """

    direction: str
    registered_as: str | None
    rule: str
    source_keys: tuple[str, ...]
    target_keys: tuple[str, ...]

    def as_dict(self) -> dict:
        """Plain JSON-friendly dict (keys as lists)."""
        return {
            "direction": self.direction,
            "registered_as": self.registered_as,
            "rule": self.rule,
            "source_keys": list(self.source_keys),
            "target_keys": list(self.target_keys),
        }


def shape_of(obj) -> tuple[int, ...]:
    """Shape of a tensor, a safetensors slice or a :class:`LazyConverted`, without reading data."""
    if isinstance(obj, (torch.Tensor, LazyConverted)):
        return tuple(obj.shape)
    return tuple(obj.get_shape())


def dtype_of(obj) -> torch.dtype:
    """The dtype of a tensor, a lazily converted tensor or a safetensors slice (its header's dtype)."""
    if isinstance(obj, (torch.Tensor, LazyConverted)):
        return obj.dtype
    return _ST_DTYPES.get(obj.get_dtype(), torch.float32)


def is_safetensors_slice(obj) -> bool:
    """Whether ``obj`` is a slice of a file opened with ``safetensors.safe_open`` (its data not read yet)."""
    return type(obj).__name__ == "PySafeSlice" and hasattr(obj, "get_shape")


def load_tensor(obj) -> torch.Tensor:
    """Materialise a tensor-like (tensor, safetensors slice, :class:`LazyConverted`, or zero-arg callable)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if callable(obj) and not hasattr(obj, "get_shape"):
        return obj()
    return obj[...]


@dataclass
class ConversionGroup:
    """One target key of a load plan: the rule producing it and the source tensors collected for it so far."""

    key: str
    rule: Any
    prefix: str
    suffix: str
    sources: dict = field(default_factory=lambda: defaultdict(list))
    # checkpoint key -> the name the rule matched (after the renamings that ran before it), where they differ
    matched_names: dict = field(default_factory=dict)

    def source_keys(self) -> tuple[str, ...]:
        """Checkpoint keys of the group, in the rule's source-pattern order."""
        if not self.sources:
            return ()
        order = [p for p in self.rule.source_patterns if p in self.sources]
        return tuple(k for p in order for k, _ in self.sources[p])


def _dry_signature(group: ConversionGroup, reference_shapes) -> tuple:
    """Everything the output shapes of a group depend on (the rule, source shapes/dtypes, reference sizes)."""
    sources = tuple((p, tuple((shape_of(o), dtype_of(o)) for _, o in items)) for p, items in group.sources.items())
    targets = getattr(group.rule, "target_patterns", ())
    references = tuple(
        reference_shapes.get(group.prefix + t + group.suffix) if reference_shapes is not None else None for t in targets
    )
    return (id(group.rule), sources, references)


def _run_group(
    group: ConversionGroup, collected: dict, reference_shapes, with_names: bool = True
) -> dict[str, torch.Tensor]:
    """Run the group's rule. Keys are full names, or (``with_names=False``) relative to ``group.prefix/suffix``."""
    rule = group.rule
    if not isinstance(rule, _tcml.WeightConverter):
        (tensors,) = collected.values()
        key = group.key if with_names else group.key[len(group.prefix) : len(group.key) - len(group.suffix)]
        return {key: tensors[0]}
    tensors = collected
    sources = {_storage_ptr(t) for ts in collected.values() for t in ts} - {None}
    for op in rule.operations:
        try:
            tensors = op.convert(
                tensors,
                source_patterns=rule.source_patterns,
                target_patterns=rule.target_patterns,
                full_layer_name=group.key,
                reference_shapes=reference_shapes,
                model=None,
                config=None,
            )
        except ConversionError:
            raise
        except Exception as exc:
            raise ConversionError(
                f"{op!r} of {rule!r} failed on '{group.key}' (from {group.source_keys()}): {exc}"
            ) from exc
    prefix, suffix = (group.prefix, group.suffix) if with_names else ("", "")
    return {prefix + k + suffix: _own_storage(v[0] if isinstance(v, list) else v, sources) for k, v in tensors.items()}


def _own_storage(tensor: torch.Tensor, sources: set[int | None]) -> torch.Tensor:
    """``tensor`` if it is contiguous and alone in a storage no source uses, else a contiguous copy: operations may
    return views (a ``Chunk`` followed by a ``SplitModulelist`` copies the data once, here), but a converted tensor
    must neither pin a larger tensor (a parameter holding one expert of a stacked tensor) nor share memory with
    another (safetensors refuses it)."""
    pointer = _storage_ptr(tensor)
    if pointer is None:  # meta, or a tensor subclass without storage (quantized weights): left to its own ops
        return tensor
    if (
        tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        and pointer not in sources
    ):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _storage_ptr(tensor) -> int | None:
    """Address of ``tensor``'s storage, ``None`` for meta tensors and tensor subclasses without one."""
    if not isinstance(tensor, torch.Tensor) or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if tensor.device.type == "meta":
        return None
    return tensor.untyped_storage().data_ptr()


class _GroupRunner:
    """Converts one group on first request and hands out its outputs one by one (thread-safe).

    ``fused``: ``(placement, name, shape, dtype)`` for a group whose rule only places its sources into its one output
    (:mod:`.placement`): the output is allocated once, in ``dtype``, and each source copied into its block as it is
    read, instead of materialising and concatenating them.
    """

    def __init__(
        self, group: ConversionGroup, reference_shapes, release_mapped_sources: bool, fused: tuple | None = None
    ):
        self._group, self._refs, self._release, self._fused = group, reference_shapes, release_mapped_sources, fused
        self._lock = threading.Lock()
        self._outputs: dict | None = None

    def take(self, name: str) -> torch.Tensor:
        with self._lock:
            if self._outputs is None:
                group = self._group
                if self._fused is not None:
                    where, out_name, shape, dtype = self._fused
                    ordered = [group.sources[p] for p in group.rule.source_patterns if p in group.sources]
                    items = [item for items in ordered for item in items]
                    out, tensors = fill(where, [[o for _, o in its] for its in ordered], shape, dtype, load_tensor)
                    self._outputs = {out_name: out}
                else:
                    collected = {p: [load_tensor(o) for _, o in items] for p, items in group.sources.items()}
                    items = [item for items in group.sources.values() for item in items]
                    tensors = [tensor for tensors in collected.values() for tensor in tensors]  # ops may empty it
                    self._outputs = _run_group(group, collected, self._refs)
                mapped = [t for (_, obj), t in zip(items, tensors) if self._release and is_safetensors_slice(obj)]
                release_pages(mapped, self._outputs.values())  # read once: only the converted copy stays resident
                group.sources = {}  # release the source tensors
            return self._outputs.pop(name)


def _placed_output(group: ConversionGroup) -> list | None:
    """The dry run's ``[(raw key, shape, dtype)]`` of a group whose rule only places its sources of one dtype, computed
    from their shapes (no meta operations); ``None`` for any other group (and where the shapes do not fit)."""
    lengths = {len(items) for items in group.sources.values()}
    if len(lengths) != 1 or list(group.sources) != [p for p in group.rule.source_patterns if p in group.sources]:
        return None
    where = placement(group.rule, len(group.sources), lengths.pop())
    dtypes = {dtype_of(o) for items in group.sources.values() for _, o in items}
    if where is None or len(dtypes) != 1:
        return None
    shape = placed_shape(where, [[shape_of(o) for _, o in items] for items in group.sources.values()])
    return None if shape is None else [(group.rule.target_patterns[0], shape, dtypes.pop())]


def _fused_output(group: ConversionGroup, outputs: list, cast: dict) -> tuple | None:
    """``fused`` for :class:`_GroupRunner`: ``outputs`` are the group's ``(name, shape, dtype)`` from the dry run;
    ``cast`` the dtype the consumer casts each output to. ``None`` unless the rule only places its sources
    (:func:`~.placement.placement`) and they all have the output's dtype (``torch.cat`` would promote otherwise)."""
    if len(outputs) != 1:
        return None
    name, shape, dtype = outputs[0]
    lengths = {len(items) for items in group.sources.values()}
    if len(lengths) != 1:
        return None
    where = placement(group.rule, len(group.sources), lengths.pop())
    if where is None or any(dtype_of(o) != dtype for items in group.sources.values() for _, o in items):
        return None
    target = cast.get(name, dtype)
    if not (dtype.is_floating_point and target.is_floating_point):
        target = dtype
    return where, name, shape, target


class LazyConverted:
    """Placeholder for a converted tensor; ``obj[...]`` converts its group (once) and returns the tensor.

    Exposes ``shape``/``dtype`` (from the meta dry run), ``get_shape()`` like a safetensors slice and
    ``is_floating_point()`` like a tensor. ``obj[...]`` hands the tensor over (the loader reads each key once);
    any other index keeps it, so that several slices can be read (tensor parallelism's strided shards read one
    slice per block: a fused ``qkv_proj``'s rows of q, of k and of v).
    """

    __slots__ = ("_runner", "name", "shape", "dtype", "_kept", "_lock")

    def __init__(self, runner: _GroupRunner, name: str, shape, dtype):
        self._runner, self.name, self.shape, self.dtype = runner, name, torch.Size(shape), dtype
        self._kept: torch.Tensor | None = None
        self._lock = threading.Lock()

    def get_shape(self):
        return list(self.shape)

    def is_floating_point(self) -> bool:
        """Like ``Tensor.is_floating_point`` (a pre-quantized load asks it of every checkpoint tensor)."""
        return self.dtype.is_floating_point

    def __getitem__(self, item):
        with self._lock:
            tensor = self._kept
            if tensor is None:
                tensor = self._runner.take(self.name)
            if item is Ellipsis:
                self._kept = None
                return tensor
            self._kept = tensor
        return tensor[item]

    def __repr__(self):
        return f"LazyConverted({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


@dataclass
class Plan:
    """Result of :func:`build_plan`. ``passthrough`` maps (possibly renamed) keys to untouched tensor-likes."""

    groups: dict
    passthrough: dict
    renamed: list
    fired: set
    reverse: bool
    renamings: list
    produced: dict = field(default_factory=dict)
    references: object = None

    def _finish_name(self, name: str) -> str:
        if not self.reverse:
            return name
        for rule in self.renamings:
            match = match_rule(rule, name)
            if match is not None:
                name = match.renamed_key
        return name

    def dry_run(self, reference_shapes=None) -> dict[str, tuple[tuple[int, ...], torch.dtype, ConversionGroup]]:
        """Run every group on meta tensors. Returns ``{output_name: (shape, dtype, group)}``.

        Raises:
            ConversionError: an operation cannot be applied, or two groups produce the same key.
        """
        self.references = reference_shapes  # reused by lazy_outputs: real tensors are split like the dry run
        out: dict = {}
        cache: dict[tuple, list] = {}
        for group in self.groups.values():
            signature = _dry_signature(group, reference_shapes)
            if signature not in cache:  # layers of one model usually share shapes: run the meta ops once per shape
                placed = _placed_output(group)  # placing only: the shape without the meta ops
                if placed is None:
                    collected = {
                        p: [torch.empty(shape_of(o), dtype=dtype_of(o), device="meta") for _, o in items]
                        for p, items in group.sources.items()
                    }
                    raw = _run_group(group, collected, reference_shapes, with_names=False)
                    placed = [(k, tuple(t.shape), t.dtype) for k, t in raw.items()]
                cache[signature] = placed
            for raw_key, shape, dtype in cache[signature]:
                name = self._finish_name(group.prefix + raw_key + group.suffix)
                if name in out or name in self.passthrough:
                    raise ConversionError(f"{group.rule!r} produces '{name}', which another key/rule also produces")
                out[name] = (shape, dtype, group)
        return out

    def unconvert(self, group: ConversionGroup, dry: dict) -> None:
        """Take ``group`` out of the plan: its sources pass through unconverted under their checkpoint keys (and its
        outputs leave ``dry``)."""
        del self.groups[group.key]
        for items in group.sources.values():
            for key, obj in items:
                self.passthrough[key] = obj
        for name in [n for n, (_, _, g) in dry.items() if g is group]:
            del dry[name]

    def lazy_outputs(
        self, dry: dict, release_mapped_sources: bool = False, cast: dict | None = None
    ) -> dict[str, LazyConverted]:
        """Lazy placeholders for every converted key of a forward plan (one shared runner per group), converted
        with the reference shapes given to :meth:`dry_run`.

        ``release_mapped_sources``: once a group is converted, give the pages of its safetensors-slice sources back
        to the kernel (:mod:`.pages`). Only for file handles nobody else holds (the loader's own, or opened here):
        a page a caller had modified through another tensor of the same handle would revert to the file.

        ``cast``: ``{output name: dtype}``, the floating dtype the consumer casts each output to (``from_pretrained``:
        the parameter's dtype). A group whose rule only places its sources (``Concatenate``; :mod:`.placement`) is
        read straight into one output allocated in that dtype, so ``obj[...]`` returns it already cast (the same
        values as converting, then casting). Other outputs keep their converted dtype.
        """
        if self.reverse:
            raise ConversionError("lazy conversion is only available for loading (reverse=False)")
        outputs = defaultdict(list)
        for name, (shape, dtype, g) in dry.items():
            outputs[id(g)].append((name, shape, dtype))
        runners = {
            id(g): _GroupRunner(
                g, self.references, release_mapped_sources, _fused_output(g, outputs[id(g)], cast or {})
            )
            for g in self.groups.values()
        }
        return {name: LazyConverted(runners[id(g)], name, shape, dtype) for name, (shape, dtype, g) in dry.items()}

    def convert_all(self, reference_shapes=None, materialize_passthrough: bool = False) -> dict:
        """Convert every group eagerly; returns ``{key: tensor}`` including the passthrough keys. Afterwards
        ``self.produced`` maps each output key to ``(shape, dtype, group)`` like :meth:`dry_run`."""
        result, self.produced = {}, {}
        for group in self.groups.values():
            result.update(self.convert_group(group, reference_shapes))
        for name, obj in self.passthrough.items():
            result[name] = load_tensor(obj) if materialize_passthrough else obj
        return result

    def convert_group(self, group: ConversionGroup, reference_shapes=None, sources: dict | None = None) -> dict:
        """Convert one group now; returns ``{key: tensor}`` (final names) and adds them to ``self.produced``.

        ``sources``: ``{source key: tensor}`` to take the group's tensors from (each is removed from it), for a plan
        built over placeholders; by default each tensor-like of the group is materialised (:func:`load_tensor`).
        """
        if sources is None:
            collected = {p: [load_tensor(o) for _, o in items] for p, items in group.sources.items()}
        else:
            collected = {p: [sources.pop(k) for k, _ in items] for p, items in group.sources.items()}
        result = {}
        for name, tensor in _run_group(group, collected, reference_shapes).items():
            name = self._finish_name(name)
            result[name] = tensor
            self.produced[name] = (tuple(tensor.shape), tensor.dtype, group)
        return result

    def rows(self, direction: str, owner: dict, dry: dict | None = None) -> list[ConversionRow]:
        """Report rows: one per group and one per renamed key."""
        produced = defaultdict(list)
        for name, (_, _, group) in (dry or {}).items():
            produced[id(group)].append(name)
        rows = [
            ConversionRow(direction, owner.get(id(g.rule)), repr(g.rule), g.source_keys(), tuple(produced[id(g)]))
            for g in self.groups.values()
        ]
        rows += [ConversionRow(direction, owner.get(id(r)), repr(r), (s,), (t,)) for r, s, t in self.renamed]
        return rows


def build_plan(
    items,
    rules: list,
    reverse: bool = False,
    key_renamings=(),
    keep_unconverted_keys: bool = False,
    incomplete: list | None = None,
) -> Plan:
    """Group ``(key, tensor_like)`` pairs by rule.

    Load order (``reverse=False``): every matching renaming in turn, then the first matching converter. Save order
    (``reverse=True``, rules already reversed): the first matching converter, renamings applied to its outputs.

    ``key_renamings`` are Transformers' own renamings for the model (the ``WeightRenaming`` entries of what
    ``from_pretrained`` computed, legacy layouts and ``key_mapping=`` included): applied to every key before the
    rules match, as Transformers applies its renamings before its converters, so converted keys come out in the
    model's namespace. With ``keep_unconverted_keys`` a key no rule touches stays under its checkpoint name (for
    ``from_pretrained``, which renames it itself exactly as in a vanilla load).

    ``incomplete``: a list that receives, instead of an error, the groups missing a source or with module lists of
    different lengths (their source keys stay out of the plan): a state dict loaded in parts (one shard at a time).

    Raises:
        ConversionError: a many-to-one group misses one of its sources, or the module lists of a group have
            different lengths (e.g. an expert missing from the checkpoint).
    """
    renamings = [r for r in rules if not isinstance(r, _tcml.WeightConverter)]
    converters = [r for r in rules if isinstance(r, _tcml.WeightConverter)]
    groups: dict = {}
    passthrough: dict = {}
    renamed: list = []
    fired: set = set()
    for key, obj in items:
        new_key = _tcml.apply_renamings(key, key_renamings) if key_renamings else key
        user_renamed = False
        if not reverse:
            for rule in renamings:
                match = match_rule(rule, new_key)
                if match is not None:
                    fired.add(id(rule))
                    renamed.append((rule, new_key, match.renamed_key))
                    new_key, user_renamed = match.renamed_key, True
        for rule in converters:
            match = match_rule(rule, new_key)
            if match is not None:
                fired.add(id(rule))
                group = groups.setdefault(
                    match.renamed_key, ConversionGroup(match.renamed_key, rule, match.prefix, match.suffix)
                )
                group.sources[match.source_pattern].append((key, obj))
                if new_key != key:
                    group.matched_names[key] = new_key
                break
        else:
            if reverse:
                for rule in renamings:
                    match = match_rule(rule, new_key)
                    if match is not None:
                        fired.add(id(rule))
                        new_key = match.renamed_key
            if keep_unconverted_keys and not user_renamed:
                new_key = key
            if new_key in passthrough:
                raise ConversionError(f"Two checkpoint keys are renamed to '{new_key}'")
            passthrough[new_key] = obj
    natural = _tcml.dot_natural_key  # experts.10 after experts.9; only the keys a rule took are sorted
    groups = dict(sorted(groups.items(), key=lambda kv: natural(kv[0])))
    renamed.sort(key=lambda row: natural(row[1]))
    _check_groups(groups, incomplete)
    return Plan(groups, passthrough, renamed, fired, reverse, renamings)


def _check_groups(groups: dict, incomplete: list | None) -> None:
    """Sort each group's sources in natural key order and check it is complete (see :func:`build_plan`): a group
    missing a source or with module lists of different lengths moves to ``incomplete``, or raises without it."""
    natural = _tcml.dot_natural_key
    for key, group in list(groups.items()):
        patterns = group.rule.source_patterns
        missing = [p for p in patterns if p not in group.sources]
        lengths = {p: len(v) for p, v in group.sources.items()}
        if incomplete is not None and (missing or len(set(lengths.values())) > 1):
            incomplete.append(groups.pop(key))
            continue
        if missing:
            raise ConversionError(
                f"{group.rule!r}: '{group.key}' is missing source(s) {missing}; found only {list(group.source_keys())}"
            )
        group.sources = {p: sorted(group.sources[p], key=lambda kv: natural(kv[0])) for p in patterns}
        if len(set(lengths.values())) > 1:
            raise ConversionError(f"{group.rule!r}: '{group.key}' has module lists of different lengths {lengths}")
