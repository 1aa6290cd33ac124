"""DeepSpeed ZeRO-3: loading a patched model that ``from_pretrained`` builds under ``deepspeed.zero.Init``.

With ZeRO-3 switched on before the load (``TrainingArguments(deepspeed=...)``, or ``HfDeepSpeedConfig``),
``from_pretrained`` builds the model under ``deepspeed.zero.Init`` (every parameter partitioned as soon as its module
is built: ``param.shape`` is ``(0,)``, the real shape is ``param.ds_shape``) and loads it with Transformers' own
ZeRO-3 loader, ``_load_state_dict_into_zero3_model``, instead of ``convert_and_load_state_dict_in_model``: only rank
0 reads the checkpoint values (the other ranks get ``meta`` tensors of the same shapes), and each module's
parameters are gathered, filled on rank 0 and partitioned again. That loader silently drops checkpoint keys the
model does not have and re-initialises the parameters it did not fill.

:func:`convert_checkpoint` converts the checkpoint with the model's user rules before that loader runs (on rank 0
on the real tensors, on the other ranks on the meta tensors, so every rank has the same keys and shapes), leaving the
built-in transforms the user rules do not replace to the loader, and returns the keys the loader will not read, so
that :func:`~.unloaded.check_replacements_loaded` refuses a replacement left with ``__init__`` values exactly as after
a plain load. :func:`tensor_shape` reads the full shape of a partitioned parameter (reference modules that recipes
build on the ``meta`` device to read shapes are partitioned too).

Per-expert modules multiply ZeRO-3's per-parameter collectives (each a round trip of every rank; 192 expert
linears in a 4-layer, 16-expert model). :class:`~modelpatch.recipes.LinearExperts` is a DeepSpeed leaf module
(``_z3_leaf``): fetched whole in training; :func:`batched_zero_init` broadcasts its parameters once when
``zero.Init`` builds it, and :func:`load_leaf_modules` loads each leaf module with one broadcast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator

import torch
from transformers import core_model_loading as _tcml

from ..undo import UndoStack
from .compose import ResolvedRules, compose_builtins, transforms_in_force
from .errors import ConversionError
from .loading import model_key, prepare, transformers_renamings
from .state import ConversionState  # noqa: F401 - named in docstrings

__all__ = [
    "tensor_shape",
    "zero3_state_shapes",
    "convert_checkpoint",
    "unread_keys",
    "ZeroLoadInfo",
    "check_gathered",
    "batched_zero_init",
    "load_leaf_modules",
]


def tensor_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The full shape of ``tensor``: ``ds_shape`` for a ZeRO-3 partitioned parameter, else ``tensor.shape``."""
    shape = getattr(tensor, "ds_shape", None)
    return tuple(tensor.shape if shape is None else shape)


def zero3_state_shapes(model) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as ``meta`` tensors of the full shapes (``ds_shape`` of partitioned parameters)."""
    return {
        k: torch.empty(tensor_shape(v), dtype=v.dtype, device="meta")
        for k, v in model.state_dict(keep_vars=True).items()
    }


@dataclasses.dataclass
class ZeroLoadInfo:
    """What the ZeRO-3 loader did not fill (``missing_keys``) or read (``unexpected_keys``), in the shape of
    Transformers' ``LoadStateDictInfo`` that :func:`~.unloaded.check_replacements_loaded` reads."""

    missing_keys: set
    unexpected_keys: set
    mismatched_keys: set = dataclasses.field(default_factory=set)


def unread_keys(model, keys, transforms: list, model_state: dict) -> set[str]:
    """The keys of ``keys`` that Transformers' ZeRO-3 loader drops: after the renamings and converters of
    ``transforms`` (as ``_apply_weight_conversions_to_state_dict`` applies them), not a key of the model, with or
    without its ``base_model_prefix``."""
    renamings = [t for t in transforms if isinstance(t, _tcml.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, _tcml.WeightConverter)]
    prefix = model.base_model_prefix
    unread = set()
    with _usage_marks_kept(transforms):  # a look-ahead: the loader must find the transforms as they were
        for key in keys:
            renamed, _ = _tcml.rename_source_key(
                key, renamings, converters, base_model_prefix=prefix, meta_state_dict=model_state
            )
            if model_key(renamed, model_state, prefix) is None:
                unread.add(key)
    return unread


def _usage_marks_kept(transforms: list) -> UndoStack:
    """An undo stack (enter it) that puts back what renaming records on the transforms (``_was_used``, read on save;
    a group renaming's ``_active``) when the block ends."""
    undo = UndoStack()
    for transform in transforms:
        for name in ("_was_used", "_active"):
            if hasattr(transform, name):
                undo.setattr(transform, name, getattr(transform, name))
    return undo


def convert_checkpoint(model, state_dict: dict, load_config, resolved: ResolvedRules):
    """Convert ``state_dict`` (the checkpoint as Transformers' ZeRO-3 path read it: real tensors on rank 0, ``meta``
    tensors elsewhere) to ``model``'s layout with the user rules ``resolved``, validated first on meta tensors
    against the full (``ds_shape``) parameter shapes.

    Returns ``(converted, load_config, state)``: the state dict to hand to ``_load_state_dict_into_zero3_model``
    (converted keys eagerly converted, group by group, their sources released; other keys unchanged), the load
    config with only the built-in transforms the user rules leave in place and whose target layout the model has
    (that loader sends every key a converter matches to the converter's target: a built-in expert fusion would
    take the per-expert keys of per-expert Linears away from them), and the :class:`ConversionState` to
    bind to the model once loaded.

    Raises:
        ConversionError, ConversionShapeError: as :func:`.loading.prepare` (nothing loaded).
    """
    mapping = list(getattr(load_config, "weight_mapping", None) or []) if load_config is not None else []
    model_state = zero3_state_shapes(model)
    builtins = transforms_in_force(compose_builtins(model, mapping, resolved), model_state)
    plan, dry, state = prepare(
        model, state_dict.items(), resolved, transformers_renamings(builtins), True, model_state=model_state
    )
    converted = dict(plan.passthrough)
    for group in list(plan.groups.values()):
        converted.update(plan.convert_group(group, plan.references))
        group.sources.clear()  # the checkpoint tensors of this group are no longer needed
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        converted = _WithMetadata(converted)
        converted._metadata = metadata
    if load_config is not None:
        load_config = dataclasses.replace(load_config, weight_mapping=builtins)
    return converted, load_config, state


class _WithMetadata(dict):
    """A dict that can carry ``_metadata`` (``torch.load``'s per-module versions) like the one it replaces."""

    _metadata: dict


def check_gathered(model, state_dict: dict) -> None:
    """Refuse a state dict that holds ZeRO-3 partitions of ``model``'s parameters (``param.shape`` ``(0,)`` or a
    slice, outside ``deepspeed.zero.GatheredParameters``) instead of the full tensors: converted to the original
    layout they would be empty or wrong.

    Raises:
        ConversionError: naming the parameters (up to 4) whose tensor is not of their full ``ds_shape``.
    """
    full = {k: tensor_shape(p) for k, p in model.named_parameters() if getattr(p, "ds_shape", None) is not None}
    if not full:
        return
    partial = [
        k for k, v in state_dict.items() if k in full and isinstance(v, torch.Tensor) and tuple(v.shape) != full[k]
    ]
    if partial:
        raise ConversionError(
            f"{len(partial)} tensor(s) of the state dict are DeepSpeed ZeRO-3 partitions, not full parameters: "
            f"{', '.join(partial[:4])}{' ...' if len(partial) > 4 else ''} (e.g. '{partial[0]}' has shape "
            f"{tuple(state_dict[partial[0]].shape)}, its parameter {full[partial[0]]}). Gather them first: "
            "`with deepspeed.zero.GatheredParameters(list(model.parameters())):`, or pass the consolidated state "
            "dict (the Trainer does with stage3_gather_16bit_weights_on_model_save)."
        )


BROADCAST_CHUNK_BYTES = 64 * 2**20
"""The most bytes :func:`batched_zero_init` concatenates for one broadcast (beyond one parameter's)."""


def _open_zero_init():
    """The ``deepspeed.zero.Init`` context open in this process (DeepSpeed's ``top_level_context``), or None
    (DeepSpeed not imported, or no ``zero.Init`` open)."""
    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    context = getattr(module, "top_level_context", None) if module is not None else None
    if context is None or not all(
        callable(getattr(context, name, None))
        for name in ("_zero_init_param", "_convert_to_deepspeed_param", "get_partition_dp_group")
    ):
        return None  # not open, or a DeepSpeed release whose zero.Init works otherwise: per parameter, unchanged
    return context


@contextlib.contextmanager
def batched_zero_init() -> Iterator[None]:
    """Under an open ``deepspeed.zero.Init``: the parameters of the modules built in this block are broadcast from
    rank 0 at the end of the block, their bytes concatenated in chunks of at most :data:`BROADCAST_CHUNK_BYTES`
    (one collective per chunk and process group), then partitioned, instead of one blocking broadcast and
    partition per parameter (DeepSpeed's ``_zero_init_param``, which ``zero.Init`` runs after each module's
    ``__init__``).

    The values, ``ds_id`` order and final partitions are those of the per-parameter path; what the block builds is
    held in full until the end of the block (for linear experts: one layer's experts, the size of the fused
    parameter the original class materialises in full the same way). Without an open ``zero.Init`` (or with a
    DeepSpeed release that lacks the methods named here) the block runs unchanged.
    """
    context = _open_zero_init()
    if context is None:
        yield
        return
    deferred: list = []

    def zero_init_param(param) -> None:  # DeepSpeed's _zero_init_param, the broadcast and partition deferred
        context._convert_to_deepspeed_param(param)  # noqa: SLF001 - zero.Init's own converter: a parameter made outside its context
        deferred.append(param)

    with UndoStack() as undo:
        undo.setattr(context, "_zero_init_param", zero_init_param)
        yield
    if deferred:
        _broadcast_and_partition(context, deferred)


def _broadcast_and_partition(context, params: list) -> None:
    from deepspeed import comm as dist

    groups: dict[int, tuple] = {}
    for param in params:
        group = context.get_partition_dp_group(param)
        groups.setdefault(id(group), (group, []))[1].append(param)
    for group, members in groups.values():
        source = 0 if dist.get_world_group() == group else dist.get_global_rank(group, 0)
        chunks: list[list] = [[]]
        size = 0
        for param in members:  # chunks of at most BROADCAST_CHUNK_BYTES (or one parameter): a bounded extra copy
            nbytes = param.data.numel() * param.data.element_size()
            if chunks[-1] and size + nbytes > BROADCAST_CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(param)
            size += nbytes
        for chunk in chunks:
            flat = torch.cat([p.data.reshape(-1).view(torch.uint8) for p in chunk])
            dist.broadcast(flat, source, group)
            offset = 0
            for param in chunk:
                nbytes = param.data.numel() * param.data.element_size()
                param.data.reshape(-1).view(torch.uint8).copy_(flat[offset : offset + nbytes])
                offset += nbytes
            del flat
            chunk[0].partition(param_list=chunk)  # frees the full tensors of this chunk


def load_leaf_modules(model, state_dict: dict, transforms: list) -> tuple[dict, set]:
    """Load the parameters of each ZeRO-3 leaf module of ``model`` (``_z3_leaf``, DeepSpeed's marker for a block
    whose parameters are fetched together, e.g. :class:`~modelpatch.recipes.LinearExperts`) from ``state_dict``
    with one broadcast from rank 0 per module, instead of Transformers' ZeRO-3 loader's gather and broadcast of
    every parameter of every sub-module (``GatheredParameters(..., modifier_rank=0)`` around
    ``_load_from_state_dict``).

    Every parameter of such a module is overwritten, so its old partitions are not gathered: rank 0 copies the
    checkpoint values (cast to the parameter's dtype, as ``_load_from_state_dict`` copies them) into one buffer,
    the buffer is broadcast, and each rank partitions the full tensors again as ``GatheredParameters`` does on exit
    (DeepSpeed's ``partition(has_been_updated=True)``, which also writes offloaded partitions).

    Only a leaf module without buffers, whose every parameter is a key of ``state_dict`` under its own name with
    the parameter's full shape, which no transform of ``transforms`` renames or converts, and whose parameters
    are partitioned over the world group (the loader's values are global rank 0's) is loaded here; any other is
    left to the loader. The decision reads only keys and shapes, the same on every rank (rank 0 holds the values,
    the others ``meta`` tensors), so every rank makes the same broadcasts.

    Returns ``(rest, loaded)``: ``state_dict`` without the keys loaded (its ``_metadata`` kept) and those keys.
    """
    leaves = [(name, m) for name, m in model.named_modules() if getattr(m, "_z3_leaf", False)]
    if not leaves:
        return state_dict, set()
    try:
        from deepspeed import comm as dist
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    except ImportError:
        return state_dict, set()

    transforms = [t for t in transforms if isinstance(t, (_tcml.WeightRenaming, _tcml.WeightConverter))]

    def loadable(key: str, param) -> bool:
        value = state_dict.get(key)
        return (
            isinstance(value, torch.Tensor)
            and tuple(value.shape) == tensor_shape(param)
            and hasattr(param, "ds_id")
            and param.ds_status == ZeroParamStatus.NOT_AVAILABLE
            and all(t.rename_source_key(key) == (key, None) for t in transforms)
        )

    loaded: set[str] = set()
    with _usage_marks_kept(transforms):  # rename_source_key marks the transforms it matches
        for prefix, leaf in leaves:
            if not prefix or any(prefix.startswith(f"{other}.") for other, _ in leaves if other):
                continue  # the whole model, or inside another leaf
            params = {f"{prefix}.{n}": p for n, p in leaf.named_parameters()}
            if not params or any(True for _ in leaf.buffers()):
                continue
            if not all(loadable(k, p) for k, p in params.items()):
                continue
            if any(p.ds_process_group != dist.get_world_group() for p in params.values()):
                continue  # the loader's values are global rank 0's; a sub-group is left to the loader
            _broadcast_into_partitions(dist, ZeroParamStatus, params, state_dict)
            loaded.update(params)
    if not loaded:
        return state_dict, set()
    rest = _WithMetadata({k: v for k, v in state_dict.items() if k not in loaded})
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        rest._metadata = metadata
    return rest, loaded


def _broadcast_into_partitions(dist, status, params: dict, state_dict: dict) -> None:
    """``params`` (``{key: partitioned parameter}``, world group) set to ``state_dict``'s values of rank 0 on every
    rank: one byte buffer (each parameter at a 64-byte aligned offset), broadcast from rank 0, then partitioned."""
    from deepspeed.accelerator import get_accelerator

    members = sorted(params.items(), key=lambda item: item[1].ds_id)  # the same order on every rank
    offsets, total = [], 0
    for _, param in members:
        offsets.append(total)
        total += -(-(param.ds_numel * param.dtype.itemsize) // 64) * 64
    flat = torch.empty(total, dtype=torch.uint8, device=get_accelerator().current_device_name())
    views = []
    for (_, param), offset in zip(members, offsets):
        size = param.ds_numel * param.dtype.itemsize
        views.append(flat[offset : offset + size].view(param.dtype).view(tensor_shape(param)))
    if dist.get_rank() == 0:
        with torch.no_grad():
            for (key, _), view in zip(members, views):
                view.copy_(state_dict[key])  # cast to the parameter's dtype, as _load_from_state_dict copies
    dist.broadcast(flat, 0, dist.get_world_group())
    for (_, param), view in zip(members, views):
        param.data = view
        param.ds_status = status.AVAILABLE
        param._is_hf_initialized = True  # noqa: SLF001 - Transformers' loader flag: a filled parameter is not initialised again; as the loader marks what it fills: not initialised again
    members[0][1].partition(param_list=[p for _, p in members], has_been_updated=True)
