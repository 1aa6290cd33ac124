"""Transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")``) for models with replaced modules.

Transformers shards a model by its plan (``model._tp_plan``: ``{"model.layers.*.self_attn.q_proj": "colwise",
...}``, assembled in ``post_init`` from the config's ``base_model_tp_plan`` and the classes' ``_tp_plan``) and the
parallel styles of ``transformers.distributed.tensor_parallel``. That plan names the original modules' parameters:
a replacement that lays them out otherwise (a fused ``qkv_proj``, per-expert Linears) would be left unsharded next
to sharded neighbours (wrong outputs, or a failing forward). So, after ``post_init`` of a model built with
replacements (:func:`adapt_tensor_parallel_plan`), the plan entries at and under each replaced module are swapped
for the replacement's own plan:

* a replacement class gives its plan by a method ``modelpatch_tp_plan(self, tp_size: int | None) -> dict[str,
  str]`` (names relative to the module, ``""`` for the module itself, ``*`` for a ``ModuleList`` index; styles
  from ``ALL_PARALLEL_STYLES``), raising :class:`TensorParallelError` where no exact split exists;
* where Transformers' plan has no entry at or under a replaced module (e.g. MoE experts in 5.25, which shards
  them only under expert parallelism), the replacement is left replicated, as the original would be;
* a replacement without ``modelpatch_tp_plan`` whose original Transformers shards is refused when tensor
  parallelism is requested, before anything is sharded or loaded.

A ``tp_plan`` dict passed by the user is checked too: an entry at or under a replaced module that the adapted
plan does not have (``q_proj`` of a fused-QKV model) or gives another style (``qkv_proj: colwise``, which would
split the concatenation) is refused, naming the entry and the module.

Two styles are added to Transformers' registry while a plan uses them (undone by :func:`uninstall`):

* ``"modelpatch_packed_qkv_colwise"`` (:func:`packed_qkv_colwise_style`): the column split of a fused ``[q; k;
  v]`` projection that splits each of q, k and v (``_StridedShard(0, split_factor=3)``, as Transformers' own
  ``packed_colwise`` splits gate and up), for equal q, k and v sizes (multi-head attention);
* ``"modelpatch_qkv_heads"`` (:func:`qkv_heads_style`), for grouped-query attention, whose unequal q and k/v no
  placement splits: ``qkv_proj`` stays whole on every rank and each rank computes the rows of its heads only.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.nn as nn

from ..errors import ModelpatchValueError
from ..patching.provenance import provenance
from ..undo import UndoStack

__all__ = [
    "TensorParallelError",
    "PACKED_QKV_COLWISE",
    "requested_tensor_parallelism",
    "adapt_tensor_parallel_plan",
    "packed_qkv_colwise_style",
    "QKV_HEADS",
    "qkv_heads_style",
    "uninstall",
]

PACKED_QKV_COLWISE = "modelpatch_packed_qkv_colwise"
"""The style name of :func:`packed_qkv_colwise_style` in Transformers' ``ALL_PARALLEL_STYLES``."""
QKV_HEADS = "modelpatch_qkv_heads"
"""The style name of :func:`qkv_heads_style` in Transformers' ``ALL_PARALLEL_STYLES``."""

_styles = UndoStack()  # styles registered in ALL_PARALLEL_STYLES
_lock = threading.Lock()


class TensorParallelError(ModelpatchValueError):
    """Tensor parallelism requested (``tp_plan``, or ``distributed_config`` with ``tp_size > 1``) for a model whose
    replaced modules cannot be sharded exactly, or a user ``tp_plan`` entry that names a module a recipe removed or
    splits a replacement otherwise than its plan; raised before anything is sharded or loaded."""


def _wildcard(name: str) -> str:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    return replace_layer_number_by_wildcard(name)


def requested_tensor_parallelism(kwargs: dict) -> dict | None:
    """What a ``from_pretrained`` call asks for: ``{"plan": "auto" | dict | None, "tp_size": int | None, "tp":
    bool, "ep": bool}`` when it passes ``tp_plan``/``tp_size`` or a ``distributed_config`` with tensor or expert
    parallelism, else ``None``."""
    config = kwargs.get("distributed_config")
    if config is not None:
        get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
        plan, size, ep = get("tp_plan"), get("tp_size"), (get("ep_size") or 1) > 1
        tp = (plan is not None and plan != {}) or (size or 1) > 1
        if not tp and not ep:
            return None
        return {"plan": plan, "tp_size": size, "tp": tp, "ep": ep}
    if kwargs.get("tp_plan") is None and kwargs.get("tp_size") is None:
        return None
    return {"plan": kwargs.get("tp_plan"), "tp_size": kwargs.get("tp_size"), "tp": True, "ep": False}


def _tp_size(request: dict | None) -> int | None:
    if request is None:
        return None
    if request["tp_size"]:
        return int(request["tp_size"])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    import os

    return int(os.environ.get("WORLD_SIZE", 1))


def _under(key: str, path: str) -> bool:
    return key == path or key.startswith(f"{path}.")


def _describe(path: str, module: nn.Module) -> str:
    record = provenance(module)
    assert record is not None
    return f"{path} ({record.replacement.__name__} replacing {record.original.__name__})"


def adapt_tensor_parallel_plan(model, request: dict | None) -> None:  # noqa: C901 - one pass over the plan's entries; each branch is one request form or one refusal, kept beside its message
    """Swap the entries of ``model._tp_plan`` at and under each replaced module for the replacement's own plan
    (see the module docstring); with tensor parallelism ``request`` ed (:func:`requested_tensor_parallelism`),
    refuse what cannot be sharded exactly and check a user ``tp_plan`` dict. Called after ``post_init`` of every
    model built with replacements (the plan then describes the model, requested or not).

    Raises:
        TensorParallelError: (only with ``request``) a replaced module Transformers' plan shards has no plan of its
            own, or its plan cannot split it exactly for this ``tp_size`` (the replacement says why), or the
            request asks for expert parallelism over a replaced module's experts, or a user ``tp_plan`` entry
            names a module a recipe removed or splits a replacement otherwise than its plan.
    """
    groups: dict[str, tuple[str, nn.Module]] = {}
    for path, module in model.named_modules():
        if path and provenance(module) is not None:
            groups.setdefault(_wildcard(path), (path, module))
    if not groups:
        return
    tp_size = _tp_size(request)
    plan = dict(getattr(model, "_tp_plan", None) or {})
    refused = []
    for generic, (path, module) in groups.items():
        under = [key for key in plan if _under(key, generic)]
        if not under:
            continue  # Transformers does not shard the original here: the replacement stays replicated too
        give = getattr(module, "modelpatch_tp_plan", None)
        if give is None:
            refused.append(f"{_describe(path, module)}, planned {sorted(under)}")
            continue
        if request is not None and request["tp"]:
            try:
                own = give(tp_size)
            except TensorParallelError as e:
                raise TensorParallelError(
                    f"from_pretrained(tp_plan={request['plan']!r}, tp_size={tp_size}): {_describe(path, module)} "
                    f"cannot be split exactly: {e}"
                ) from None
        else:
            try:
                own = give(None)
            except TensorParallelError:
                continue  # refused if a tensor-parallel load asks for it
        for key in under:
            del plan[key]
        for key, style in own.items():
            plan[f"{generic}.{key}" if key else generic] = style
            if style in _STYLES and _distributed():
                _register(style)  # before Transformers validates the plan's styles
    model._tp_plan = plan  # noqa: SLF001 - the plan Transformers' tensor-parallel loader reads
    if request is None:
        return
    if refused and request["tp"]:
        raise TensorParallelError(
            f"from_pretrained(tp_plan={request['plan']!r}): Transformers' tensor-parallel plan of "
            f"{type(model).__name__} shards modules that modelpatch replaced with classes that give no plan of "
            f"their own (a method modelpatch_tp_plan(tp_size)): {'; '.join(refused[:3])}"
            f"{' ...' if len(refused) > 3 else ''}. Load without tp_plan (DDP, FSDP2 or DeepSpeed ZeRO-3 work), or "
            "without the patch."
        )
    if request["ep"]:
        ep_plan = getattr(model, "_ep_plan", None) or {}
        for generic, (path, module) in groups.items():
            if under := sorted(key for key in ep_plan if _under(key, generic)):
                raise TensorParallelError(
                    f"distributed_config with ep_size > 1: expert parallelism shards {under}, parameters of the "
                    f"original module that {_describe(path, module)} does not have. Load without ep_size, or "
                    "without the patch."
                )
    user = request["plan"]
    if isinstance(user, dict):
        names = {_wildcard(n) for n, _ in model.named_modules()} | {_wildcard(n) for n, _ in model.named_parameters()}
        for key, style in user.items():
            generic_key = _wildcard(key)
            for generic, (path, module) in groups.items():
                if not _under(generic_key, generic) or plan.get(generic_key) == style:
                    continue
                if generic_key in plan:
                    why = f"the replacement's plan splits it as {plan[generic_key]!r}"
                elif generic_key in names:
                    why = "the replacement's plan does not split it by itself"
                else:
                    why = "the replacement has no such module or parameter (a recipe removed it)"
                own = {k: v for k, v in plan.items() if _under(k, generic)}
                raise TensorParallelError(
                    f"from_pretrained(tp_plan=...) entry {key!r}: {style!r} is for {_describe(path, module)}, "
                    f"and {why} (its plan: {own or 'replicated'}). Drop the entry, or load without the patch."
                )


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available()


def _register(name: str) -> Any:
    with _lock:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

        if name not in ALL_PARALLEL_STYLES:
            _styles.setitem(ALL_PARALLEL_STYLES, name, _STYLES[name]()())
        return ALL_PARALLEL_STYLES[name]


def packed_qkv_colwise_style() -> Any:
    """The ``"modelpatch_packed_qkv_colwise"`` style (registered in ``ALL_PARALLEL_STYLES`` on first use): a fused
    ``[q; k; v]`` ``nn.Linear`` with q, k and v of equal size, each split column-wise (rank ``r`` of ``T`` holds
    rows ``r`` of q, k and v split in ``T``, i.e. whole heads): weight and bias as ``_StridedShard(0,
    split_factor=3)`` (Transformers' loader reads only those rows, and ``full_tensor()`` gives the fused layout
    back), input replicated, output this rank's ``[q_r; k_r; v_r]`` (local; the attention's forward splits it in the
    proportions of the full q, k and v)."""
    return _register(PACKED_QKV_COLWISE)


def qkv_heads_style() -> Any:
    """The ``"modelpatch_qkv_heads"`` style (registered in ``ALL_PARALLEL_STYLES`` on first use), for a fused-QKV
    attention module (attributes ``qkv_proj``, ``q_size``, ``kv_size``, ``head_dim``) whose q and k/v differ in
    size (grouped-query attention), where no DTensor placement splits each of q, k and v: ``qkv_proj``'s weight
    and bias stay whole on every rank (plain tensors: loaded, gathered and saved as without tensor parallelism),
    and each rank computes only the rows of its heads (rank ``r`` of ``T``: query heads ``r*H/T ...`` and the
    key/value heads ``r*K/T ...`` they attend with), ``F.linear(x, weight[rows], bias[rows])``: the attention
    core and ``o_proj`` (row-wise) run on ``1/T`` of the heads. Gradients: the input's and the weight's partial
    sums (each rank's rows) are all-reduced over the tensor-parallel group."""
    return _register(QKV_HEADS)


def _packed_qkv_class() -> type:
    import torch
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from transformers.distributed.tensor_parallel import PackedColwiseParallel

    class PackedQKVColwiseParallel(PackedColwiseParallel):
        """``PackedColwiseParallel`` with three equal parts, the bias split like the weight's rows."""

        def __init__(self) -> None:
            super().__init__(split_factor=3)

        def shard_param(self, module, param, mesh, *args, **kwargs):  # 5.25 adds config=, mesh_manager=
            meta = module._parameters.get(param)
            if meta is None:
                return
            module._parameters[param] = torch.nn.Parameter(
                distribute_tensor(meta, mesh, [_StridedShard(dim=0, split_factor=3)], src_data_rank=None),
                requires_grad=meta.requires_grad,
            )

    return PackedQKVColwiseParallel


def _qkv_heads_class() -> type:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers.distributed.parallel_utils import _AllReduceBackward
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    class QKVHeadsParallel(TensorParallelLayer):
        """See :func:`qkv_heads_style`; installed on the attention module, it replaces ``qkv_proj.forward``."""

        def install_forward(self, module, mesh, *args, **kwargs):
            size, rank = mesh.size(), mesh.get_local_rank()
            group = mesh.get_group()
            heads, kv_heads = module.q_size // module.head_dim, module.kv_size // module.head_dim
            if heads % size or kv_heads % size:
                raise TensorParallelError(
                    f"{heads} query heads and {kv_heads} key/value heads do not split over {size} ranks"
                )
            q, kv = module.q_size // size, module.kv_size // size
            rows = torch.cat(
                [
                    torch.arange(rank * q, (rank + 1) * q),
                    module.q_size + torch.arange(rank * kv, (rank + 1) * kv),
                    module.q_size + module.kv_size + torch.arange(rank * kv, (rank + 1) * kv),
                ]
            )
            proj = module.qkv_proj
            if type(proj) is not nn.Linear:  # its forward is replaced by a row-selecting F.linear below
                raise TensorParallelError(
                    f"qkv_proj is a {type(proj).__name__} (quantized, or wrapped): splitting grouped-query heads "
                    "works on a plain nn.Linear only"
                )

            def forward(hidden_states):
                hidden_states = _AllReduceBackward.apply(hidden_states, group)  # each rank's rows: a partial sum
                index = rows.to(proj.weight.device)
                bias = None if proj.bias is None else proj.bias.index_select(0, index)
                return F.linear(hidden_states, proj.weight.index_select(0, index), bias)

            def all_reduce(param):  # each rank's gradient holds its rows only
                dist.all_reduce(param.grad, group=group)

            proj.forward = forward  # type: ignore[method-assign]  # as Transformers installs its styles
            proj.register_forward_pre_hook(_hook_gradients(all_reduce))
            return module

    return QKVHeadsParallel


def _hook_gradients(all_reduce):
    """A forward pre-hook that registers ``all_reduce`` as the post-accumulate-grad hook of the module's parameters,
    once per parameter object (the loader replaces the parameters after the styles are installed)."""
    hooked: dict = {}

    def hook(module, args):
        import torch

        if torch.is_grad_enabled():
            for name, param in module.named_parameters(recurse=False):
                if param.requires_grad and hooked.get(name) is not param:
                    param.register_post_accumulate_grad_hook(all_reduce)
                    hooked[name] = param

    return hook


_STYLES = {PACKED_QKV_COLWISE: _packed_qkv_class, QKV_HEADS: _qkv_heads_class}


def uninstall() -> None:
    """Remove the styles this module registered in Transformers' ``ALL_PARALLEL_STYLES``."""
    with _lock:
        _styles.undo()
