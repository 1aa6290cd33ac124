"""Per-expert linear experts: every expert a set of ``nn.Linear`` (what weight quantisers need), for every family.

Transformers 5.x stores the experts of a MoE layer as fused 3-D parameters in a class decorated with
``@use_experts_implementation`` (``transformers.integrations.moe``), whose flags say how: ``has_gate``
(``gate_up_proj`` holding gate and up, else ``up_proj`` only), ``is_transposed`` (``(E, in, out)`` instead of
``(E, out, in)``), ``is_concatenated`` (gate rows then up rows; ``False``: gpt-oss's alternating gate/up columns),
``has_bias`` (``<name>_bias`` of shape ``(E, out)``), ``has_post_expert_norm``; the class's ``_apply_gate`` (the
default ``act_fn(gate) * up``, or the family's own, e.g. gpt-oss's clamped GLU) combines gate and up, and
``batched_mm_experts_forward`` there is the generic formulation of every decorated class's math.

``forward(hidden_states (N, H), top_k_index (N, k) long, top_k_weights (N, k)) -> (N, H)`` follows the original
loop (experts visited in index order, the index ``E`` used as padding is skipped, ``index_add_``), so outputs equal
the fused original within fp32 rounding. Training steps the same parameters as the original: an expert no token
reached gets a zero gradient, not ``None`` (while gradients are recorded, one autograd node gives the idle experts'
trainable parameters zero gradients without running them), as its slice of the fused tensor does, so SGD momentum,
Adam moments and weight decay move it as they move the original, and
``DistributedDataParallel(find_unused_parameters=False)`` sees every parameter in every step. When FSDP2 shards the
expert modules themselves (``fully_shard`` per expert), every expert is called, in index order, on its tokens
(possibly none): each call is a collective (all-gather before, reduce-scatter after) that every rank must make.

Under ``torch.compile`` the forward takes one of two formulations, chosen by the instance attribute
``compiled_dispatch`` (class default ``"sparse"``); both call every expert's own ``nn.Linear`` modules (hooks,
quantised weights and PEFT wrappers see each call) and equal the eager forward within fp32 rounding (outputs and
gradients within 1e-5):

- ``"sparse"``: a fixed loop over all ``E`` experts, expert ``e`` applied to exactly the tokens routed to it
  (the positions of ``top_k_index == e``), weighted and summed with ``index_add_`` as in eager. The number of those
  tokens depends on the routing: the positions come from one operator, ``modelpatch::expert_positions``, whose
  size is unbacked, so the graph is whole (0 graph breaks, ``fullgraph=True`` works) with Dynamo's defaults and,
  with ``torch.compile(..., dynamic=True)`` (or ``mark_dynamic`` on the sequence dimension), no recompilation per
  sequence length or per token count (before issue 21, item 11, a ``torch.where`` here broke the graph unless
  ``capture_dynamic_output_shape_ops`` was set). Transformers' own fused experts use a ``grouped_mm`` over stacked
  weights (and a custom operator on CPU), which per-expert modules cannot use without bypassing the modules.
- ``"dense"``: every expert applied to every token, multiplied by its routing weight (0 where the token is not
  routed to it): static shapes, 0 graph breaks without any option, but ``E / k`` times the expert FLOPs and
  activations — for small expert counts, or to get ``fullgraph=True`` without changing Dynamo's configuration.
  A non-finite expert output on a token not routed to that expert would turn into NaN (``0 * inf``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn
from transformers.activations import ACT2FN

from ...conversion.zero3 import batched_zero_init, tensor_shape
from ...errors import ModelpatchValueError
from ...integrations.tensor_parallel import TensorParallelError
from .discovery import (
    DEFAULT_FLAGS,
    FLAGS,
    ExpertsClass,
    ExpertsFamily,
    UnsupportedExpertsError,
    experts_family,
    experts_model_types,
)

__all__ = ["COMPILED_DISPATCHES", "ExpertMLP", "LINEAR_EXPERTS_CLASSES", "LinearExperts", "linear_experts_class"]


class ExpertMLP(nn.Module):
    """One expert: ``down(gating(gate(x), up(x)))`` (``down(act(up(x)))`` without gate); ``x (n, H) -> (n, H)``.

    Linear names follow the family (``names``: ``(gate, up, down)`` or ``(up, down)``). ``gating`` is the
    original class's ``_apply_gate`` applied to ``gate`` and ``up`` laid out as the fused tensor has them
    (concatenated, or alternating when ``interleaved``) with this module as ``self`` (it carries the attributes the
    function reads, ``attributes``); ``None`` is the default ``act_fn(gate) * up``. ``act``: an ``ACT2FN`` name or
    an activation module / function.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: Any,
        names: tuple[str, ...],
        *,
        bias: bool = False,
        gating: Callable | None = None,
        interleaved: bool = False,
        attributes: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        self.names = tuple(names)
        self.has_gate = len(self.names) == 3
        *inputs, down = self.names
        for name in inputs:
            setattr(self, name, nn.Linear(hidden_size, intermediate_size, bias=bias))
        setattr(self, down, nn.Linear(intermediate_size, hidden_size, bias=bias))
        self.act_fn = ACT2FN[act] if isinstance(act, str) else act
        self._gating = gating
        self.interleaved = interleaved
        for key, value in (attributes or {}).items():
            if not hasattr(self, key):
                setattr(self, key, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.has_gate:
            up, down = (getattr(self, name) for name in self.names)
            return down(self.act_fn(up(x)))
        gate, up, down = (getattr(self, name) for name in self.names)
        if self._gating is None:
            return down(self.act_fn(gate(x)) * up(x))
        g, u = gate(x), up(x)
        fused = torch.stack((g, u), dim=-1).flatten(-2) if self.interleaved else torch.cat((g, u), dim=-1)
        return down(self._gating(self, fused))


COMPILED_DISPATCHES = ("sparse", "dense")
"""Values of :attr:`LinearExperts.compiled_dispatch` (see the module docstring)."""

_SKIPPED_ATTRIBUTES = frozenset({"training", "config", "num_experts", *FLAGS})


def _reference(original: type, config, args, kwargs) -> nn.Module:
    with torch.device("meta"):
        return original(config, *args, **kwargs)


def _derive(ref: nn.Module, cls_name: str) -> dict[str, Any]:
    """Shapes, flags and gating of a meta instance of a decorated experts class.

    Raises:
        UnsupportedExpertsError: a post-expert norm, parameters other than the fused ones, or an activation with
            parameters.
    """
    flags = {name: bool(getattr(ref, name, DEFAULT_FLAGS[name])) for name in FLAGS}
    if flags["has_post_expert_norm"]:
        raise UnsupportedExpertsError(
            f"{cls_name}: a post-expert norm (one parameterised module shared by all experts) has no place in a "
            "ModuleList of per-expert linears"
        )
    first = "gate_up_proj" if flags["has_gate"] else "up_proj"
    expected = {first, "down_proj"} | ({f"{first}_bias", "down_proj_bias"} if flags["has_bias"] else set())
    found = {name for name, _ in ref.named_parameters()} | {name for name, _ in ref.named_buffers()}
    if found != expected:
        raise UnsupportedExpertsError(
            f"{cls_name}: parameters {sorted(found)}, expected exactly {sorted(expected)} (the fused experts "
            "tensors of its @use_experts_implementation flags)"
        )
    # full shapes: under an open deepspeed.zero.Init (ZeRO-3) the reference is partitioned too, its parameters (0,)
    up = tensor_shape(getattr(ref, first))
    down = tensor_shape(ref.down_proj)  # type: ignore[arg-type]
    if flags["is_transposed"]:
        num, hidden, intermediate = up[0], up[1], down[1]
    else:
        num, hidden, intermediate = up[0], up[2], down[2]
    act = getattr(ref, "act_fn", None)
    if isinstance(act, nn.Module):
        if any(True for _ in act.parameters()) or any(True for _ in act.buffers()):
            raise UnsupportedExpertsError(f"{cls_name}: its activation {type(act).__name__} has parameters")
    gating = getattr(type(ref), "_apply_gate", None)
    if getattr(gating, "__name__", None) == "_default_apply_gate" or not flags["has_gate"]:
        gating = None
    attributes = {
        k: v
        for k, v in vars(ref).items()
        if not k.startswith("_") and k not in _SKIPPED_ATTRIBUTES and isinstance(v, (int, float, bool, str, type(None)))
    }
    return dict(
        flags=flags, num=num, hidden=hidden, intermediate=intermediate, act=act, gating=gating, attributes=attributes
    )


class _ZeroGradients(torch.autograd.Function):
    """``(anchor (0, H), *params) -> (0, H)`` empty rows whose backward gives every ``param`` a zero gradient of its
    own shape and dtype (and ``anchor`` none): the parameters join the graph as a module run on no token would make
    them join, without running it. Works under gradient checkpointing (re-run in the recomputation) and with any
    parameter (PEFT adapters, quantized wrappers' trainable parts)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.params = [(p.shape, p.dtype, p.device, _dtensor_layout(p)) for p in params]
        return anchor.new_zeros(anchor.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *(_zeros(*param) for param in ctx.params))


def _dtensor_layout(param: torch.Tensor) -> tuple | None:
    """``(local shape, mesh, placements, stride)`` of a ``DTensor`` parameter (tensor parallelism), else ``None``."""
    if not (hasattr(param, "device_mesh") and hasattr(param, "placements") and hasattr(param, "to_local")):
        return None
    return (param.to_local().shape, param.device_mesh, param.placements, param.stride())


def _zeros(shape, dtype, device, layout) -> torch.Tensor:
    """A zero gradient for a parameter: a ``DTensor`` of the parameter's layout for a ``DTensor`` parameter (an
    optimizer cannot add a plain tensor to it)."""
    if layout is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    from torch.distributed.tensor import DTensor

    local, mesh, placements, stride = layout
    zeros = torch.zeros(local, dtype=dtype, device=device)
    return DTensor.from_local(zeros, mesh, placements, run_check=False, shape=shape, stride=stride)


@torch.library.custom_op("modelpatch::expert_positions", mutates_args=())
def _expert_positions(by_slot: torch.Tensor, expert_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.where(by_slot == expert_idx)`` as one operator: ``by_slot (k, N)`` long -> ``(top_k_pos (n,),
    token_idx (n,))`` long, ``n`` the number of slots routed to ``expert_idx``.

    What :meth:`LinearExperts._sparse_static` calls under ``torch.compile`` (issue 21, item 11). Traced by Dynamo
    as ``torch.where``, the ``nonzero`` behind it broke the graph unless ``capture_dynamic_output_shape_ops`` was
    set; Dynamo then split every frame above it (a decoder layer compiled once per layer: a recompile per layer
    on the cache's guards) and compiled each expert as a frame of its own, recompiled when its row count met 0 or
    1. As an operator whose fake implementation returns a new unbacked size, the whole loop is one graph with or
    without that option, and no size is ever specialised."""
    top_k_pos, token_idx = torch.where(by_slot == expert_idx)
    return top_k_pos.clone(), token_idx.clone()  # views of one nonzero result: an operator's outputs may not alias


@_expert_positions.register_fake
def _expert_positions_fake(by_slot: torch.Tensor, expert_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    ctx = torch.library.get_ctx()
    shape_env = getattr(ctx, "_shape_env", None)
    if shape_env is None:  # no symbolic shapes: new_dynamic_size raises the usual DynamicOutputShapeException
        n = ctx.new_dynamic_size()
    else:
        # new_dynamic_size without its capture_dynamic_output_shape_ops check, as torch's own device_mesh operator
        # does: the size is a count of slots, bounded by their number
        n = shape_env.create_unbacked_symint()
        bound = by_slot.numel()
        _constrain_range_for_size(n, min=0, max=bound if isinstance(bound, int) else None)
    return by_slot.new_empty(n), by_slot.new_empty(n)


def _sharded_per_expert(experts: nn.ModuleList) -> bool:
    """Whether FSDP2 (``torch.distributed.fsdp.fully_shard``) sharded the expert modules themselves."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return any(isinstance(expert, FSDPModule) for expert in experts)


class LinearExperts(nn.ModuleList):
    """``E`` :class:`ExpertMLP` modules replacing a fused experts class; built with its constructor arguments.

    Subclasses (:func:`linear_experts_class`, one per original class) set ``family`` and ``original``; building one
    builds the original on the ``meta`` device to read its flags, sizes and gating (no memory, no weights).

    ``compiled_dispatch`` (``"sparse"`` or ``"dense"``; set it on an instance to change one layer) chooses the
    formulation traced by ``torch.compile``; eager calls run the sparse loop over the experts hit, then, while
    gradients are recorded, give every other expert's trainable parameters a zero gradient (not ``None``, one
    autograd node, no expert run) as its slice of the fused original does: optimizers step it exactly as they step the original
    (momentum and Adam moments decay, weight decay applies) and ``DistributedDataParallel`` with
    ``find_unused_parameters=False`` sees every parameter used. ``skip_idle_experts = True`` (an explicit opt-out,
    per instance) leaves idle experts out of the graph: their gradients stay ``None`` and optimizers skip them,
    which the fused original never does.

    Raises (on construction):
        UnsupportedExpertsError: the original class cannot be expressed with per-expert linears (the message says
            why: a post-expert norm, other parameters, an activation with parameters).
    """

    family: ClassVar[ExpertsFamily]
    original: ClassVar[ExpertsClass]
    compiled_dispatch: str = "sparse"
    skip_idle_experts: bool = False
    _z3_leaf: bool = True
    """DeepSpeed ZeRO-3's leaf-module flag (``deepspeed.utils.set_z3_leaf_modules``): the experts' parameters are
    fetched together when the module runs, not by a hook per expert linear (the fused original's are one
    parameter each). Also what keeps ZeRO-3 exact here: the eager loop calls only the experts its rank's tokens
    hit, and per-module fetches are collectives every rank must make in the same order."""

    def __init__(self, config, *args, **kwargs):
        super().__init__()
        derived = _derive(_reference(self.original.load(), config, args, kwargs), self.original.name)
        with batched_zero_init():  # under deepspeed.zero.Init: one broadcast for all experts, not one per linear
            self._build(config, derived)

    def _build(self, config, derived: dict[str, Any]) -> None:
        flags = derived["flags"]
        names = self.family.names if flags["has_gate"] else self.family.names[-2:]
        self.num_experts = derived["num"]
        self.hidden_dim = derived["hidden"]
        self.intermediate_dim = derived["intermediate"]
        self.has_bias = flags["has_bias"]
        act = derived["act"]
        if act is None:
            act = ACT2FN[config.hidden_act] if getattr(config, "hidden_act", None) else nn.Identity()
        for _ in range(self.num_experts):
            self.append(
                ExpertMLP(
                    self.hidden_dim,
                    self.intermediate_dim,
                    act,  # one activation module (no parameters, checked) shared by the experts
                    names,
                    bias=flags["has_bias"],
                    gating=derived["gating"],
                    interleaved=not flags["is_concatenated"],
                    attributes=derived["attributes"],
                )
            )

    def modelpatch_tp_plan(self, tp_size: int | None) -> dict[str, str]:
        """Tensor-parallel plan (see :mod:`modelpatch.integrations.tensor_parallel`), Transformers' split of the
        fused experts per expert: each expert's gate/up rows and down columns split over the ranks (``colwise`` /
        ``rowwise`` parameter placements; the expert linears run on their local shards, ``local_params``), the
        experts' summed partial outputs all-reduced once per layer (``moe_tp_experts``, which also sums the input
        gradients).

        Raises:
            TensorParallelError: the experts have biases (a row-split ``down`` bias would be added once per rank).
        """
        if self.has_bias:
            raise TensorParallelError(
                "its experts have biases, which a row-wise split of the down projection would add once per rank"
            )
        first: ExpertMLP = self[0]  # type: ignore[assignment]  # ModuleList indexing is typed as Module
        *inputs, down = first.names
        plan = {"": "moe_tp_experts"}
        for name in inputs:
            plan |= {f"*.{name}.weight": "colwise", f"*.{name}": "local_params"}
        return plan | {f"*.{down}.weight": "rowwise", f"*.{down}": "local_params"}

    @staticmethod
    def _routing(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        values = [*args, *kwargs.values()]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        index = next((t for t in tensors if not t.is_floating_point()), None)
        weights = next((t for t in tensors if t.is_floating_point()), None)
        if index is None or weights is None or len(values) != 2:
            raise ModelpatchValueError(
                "linear experts take (hidden_states, top_k_index, top_k_weights), got "
                f"{[type(v).__name__ for v in values]} after hidden_states"
            )
        return index, weights

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """``hidden_states (N, H)``, ``top_k_index (N, k)`` long (``E`` = no expert), ``top_k_weights (N, k)``
        (positional or by the family's keyword names) -> ``(N, H)`` in ``hidden_states.dtype``.

        Raises:
            ModelpatchValueError: ``compiled_dispatch`` is not one of :data:`COMPILED_DISPATCHES` (under
                ``torch.compile``), or the routing arguments are not an index and a weight tensor.
        """
        top_k_index, top_k_weights = self._routing(args, kwargs)
        if torch.compiler.is_compiling():
            dispatch = self.compiled_dispatch
            if dispatch == "sparse":
                return self._sparse_static(hidden_states, top_k_index, top_k_weights)
            if dispatch == "dense":
                return self._dense(hidden_states, top_k_index, top_k_weights)
            raise ModelpatchValueError(
                f"{type(self).__name__}.compiled_dispatch={dispatch!r}: expected one of {COMPILED_DISPATCHES}"
            )
        if _sharded_per_expert(self):
            # FSDP2 shards each expert module: its pre-forward all-gather and post-backward reduce-scatter are
            # collectives, so every rank calls every expert, in index order, on its tokens (possibly none)
            return self._sparse_static(hidden_states, top_k_index, top_k_weights)
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        hit_experts = [e for e in hit[:, 0].tolist() if e != self.num_experts]
        for expert_idx in hit_experts:
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            out = self[expert_idx](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        if torch.is_grad_enabled() and not self.skip_idle_experts and len(hit_experts) < self.num_experts:
            self._idle_experts(final, hidden_states, set(hit_experts))
        return final

    def _idle_experts(self, final: torch.Tensor, hidden_states: torch.Tensor, hit: set[int]) -> None:
        """Give the trainable parameters of each expert no token reached a zero gradient (not ``None``), as that
        expert's slice of the fused original's parameters gets: one :class:`_ZeroGradients` node over all of
        them, added to ``final`` through an empty ``index_add_`` (no expert runs, no FLOPs). Optimizers then step
        those parameters as they step the fused slice (moments decay, weight decay applies) and DDP's reducer sees
        every parameter. Frozen parameters are left out (they get no gradient either way)."""
        idle = [
            p
            for expert_idx, expert in enumerate(self)
            if expert_idx not in hit
            for p in expert.parameters()
            if p.requires_grad
        ]
        if idle:
            empty = torch.zeros(0, dtype=torch.long, device=hidden_states.device)
            final.index_add_(0, empty, _ZeroGradients.apply(hidden_states[:0], *idle).to(final.dtype))

    def _sparse_static(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The eager loop over a fixed range of experts (no ``tolist``, no skip): each expert sees exactly its
        tokens, in the eager order (by top-k slot, then token), possibly none."""
        final = torch.zeros_like(hidden_states)
        by_slot = top_k_index.t()  # (k, N): torch.where yields slot-major order, as the eager one-hot mask does
        compiling = torch.compiler.is_compiling()
        for expert_idx, expert in enumerate(self):
            if compiling:  # issue 21, item 11: one opaque operator, no graph break (see _expert_positions)
                top_k_pos, token_idx = _expert_positions(by_slot, expert_idx)
            else:
                top_k_pos, token_idx = torch.where(by_slot == expert_idx)
            out = expert(hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def _dense(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every token times its routing weight (exactly the token's weight when routed to it,
        else 0, so the sum is the eager one): static shapes."""
        final = torch.zeros_like(hidden_states)
        for expert_idx, expert in enumerate(self):
            weight = (top_k_weights * (top_k_index == expert_idx)).sum(dim=-1, keepdim=True)
            final += (expert(hidden_states) * weight).to(final.dtype)
        return final


_CLASSES: dict[tuple[str, str, tuple[str, ...]], type[LinearExperts]] = {}


def linear_experts_class(family: ExpertsFamily, original: ExpertsClass | None = None) -> type[LinearExperts]:
    """The replacement class ``Linear<Original>`` of ``original`` (default: the family's first class), created
    once per class and kept as an attribute of this module (so instances pickle)."""
    original = original or family.classes[0]
    key = (original.module, original.name, family.names)
    if key not in _CLASSES:
        name = f"Linear{original.name}"
        if any(other[:2] == key[:2] for other in _CLASSES):  # another type names this class's linears otherwise
            name = f"{name}_{family.model_type}"
        cls = type(
            name,
            (LinearExperts,),
            {
                "family": family,
                "original": original,
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"Per-expert linear replacement of ``{original.name}`` ({original.module}).",
            },
        )
        globals()[name] = cls
        _CLASSES[key] = cls
    return _CLASSES[key]


class _LinearExpertsClasses(Mapping):
    """``{model_type: replacement class}`` for every model type with decorated experts, derived on access."""

    def __getitem__(self, model_type: str) -> type[LinearExperts]:
        try:
            family = experts_family(model_type)
        except UnsupportedExpertsError:
            raise KeyError(model_type) from None
        return linear_experts_class(family)

    def __iter__(self) -> Iterator[str]:
        return iter(experts_model_types())

    def __len__(self) -> int:
        return len(experts_model_types())

    def __repr__(self) -> str:
        return f"LINEAR_EXPERTS_CLASSES({len(self)} model types, derived on access)"


LINEAR_EXPERTS_CLASSES: Mapping[str, type[LinearExperts]] = _LinearExpertsClasses()
"""``{model_type: replacement class}`` (``LINEAR_EXPERTS_CLASSES["mixtral"].__name__ == "LinearMixtralExperts"``),
derived when looked up."""
