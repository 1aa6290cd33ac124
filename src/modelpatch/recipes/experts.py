"""Per-expert linear experts: every expert a set of ``nn.Linear`` (what weight quantisers need).

Transformers 5.x stores the experts of a MoE layer as two fused parameters: ``gate_up_proj`` of shape
``(E, 2 * I, H)`` (gate rows then up rows) and ``down_proj`` of shape ``(E, H, I)``. The replacement
:class:`LinearExperts` is an ``nn.ModuleList`` of ``E`` :class:`ExpertMLP` modules, expert ``e`` holding
``gate (I, H)``, ``up (I, H)`` and ``down (H, I)`` linears without bias, i.e. the founding document's
``ModuleListExperts`` generalised to every fused-experts family.

Checkpoints on the Hub (and every ``save_pretrained`` of Transformers, which reverts its own fusion) keep one
tensor per expert, under exactly the names :class:`LinearExperts` uses, so the recipe's conversion rules drop the
built-in fusion (``overwrite=True``) and keep the other built-in rules the family needs (Mixtral's
``block_sparse_moe`` → ``mlp`` renaming).

A checkpoint written in Transformers' fused layout (``save_pretrained(..., save_original_format=False)``) needs
the ``<type>-linear-experts-from-fused`` recipe instead: ``gate_up_proj`` is split with ``Chunk(dim=1)`` (gate
rows, up rows) then ``SplitModulelist(dim=0)`` (one tensor per expert), ``down_proj`` with ``SplitModulelist``; on
save the rules run backwards (``MergeModulelist`` + ``Concatenate``), so that layout is written back.

``forward(hidden_states (N, H), top_k_index (N, k) long, top_k_weights (N, k)) -> (N, H)`` follows the original
loop (experts visited in index order, the index ``E`` used as padding is skipped), so outputs equal the fused
original within fp32 rounding.

Under ``torch.compile`` the forward takes one of two formulations, chosen by the instance attribute
``compiled_dispatch`` (class default ``"sparse"``); both call every expert's own ``nn.Linear`` modules (hooks,
quantised weights and PEFT wrappers see each call) and equal the eager forward within fp32 rounding (outputs and
gradients within 1e-5):

- ``"sparse"``: a fixed loop over all ``E`` experts, expert ``e`` applied to exactly the tokens routed to it
  (``torch.where(top_k_index == e)``), weighted and summed with ``index_add_`` as in eager. The number of those
  tokens depends on the routing, so the graph is whole only with
  ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``: then 0 graph breaks and, with
  ``torch.compile(..., dynamic=True)`` (or ``mark_dynamic`` on the sequence dimension), no recompilation per
  sequence length. Without that option the remaining breaks are the ``nonzero`` behind each ``torch.where``
  (Dynamo's "Dynamic shape operator", one per expert, plus the frames above it that Dynamo splits there
  unless ``torch._dynamo.config.nested_graph_breaks`` is set); ``fullgraph=True`` then fails. Transformers'
  own fused experts avoid this with a ``grouped_mm`` over stacked weights (and a custom operator on CPU), which
  per-expert modules cannot use without bypassing the modules.
- ``"dense"``: every expert applied to every token, multiplied by its routing weight (0 where the token is not
  routed to it): static shapes, 0 graph breaks without any option, but ``E / k`` times the expert FLOPs and
  activations — for small expert counts, or to get ``fullgraph=True`` without changing Dynamo's configuration.
  A non-finite expert output on a token not routed to that expert would turn into NaN (``0 * inf``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
from transformers.activations import ACT2FN

from ..conversion import Chunk, SplitModulelist, WeightConverter, WeightRenaming
from ..errors import ModelpatchValueError
from .base import Recipe, RuleSpec

__all__ = [
    "ExpertsFamily",
    "ExpertMLP",
    "LinearExperts",
    "LINEAR_EXPERTS_CLASSES",
    "COMPILED_DISPATCHES",
    "linear_experts_recipe",
    "FAMILIES",
]


@dataclass(frozen=True)
class ExpertsFamily:
    """What differs between the fused-experts classes.

    Attributes:
        model_type: ``config.model_type`` (conversion registry name).
        original: class name replaced (``"MixtralExperts"``).
        num_experts: config attribute holding ``E``; intermediate: config attribute holding ``I``.
        names: attribute names of (gate, up, down) in each expert, as in the family's checkpoints.
        renamings: ``(source, target)`` checkpoint renamings the family's built-in rules also do.
    """

    model_type: str
    original: str
    num_experts: str
    intermediate: str
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    renamings: tuple[tuple[str, str], ...] = ()


FAMILIES = (
    ExpertsFamily("qwen2_moe", "Qwen2MoeExperts", "num_experts", "moe_intermediate_size"),
    ExpertsFamily("qwen3_moe", "Qwen3MoeExperts", "num_experts", "moe_intermediate_size"),
    ExpertsFamily(
        "mixtral",
        "MixtralExperts",
        "num_local_experts",
        "intermediate_size",
        ("w1", "w3", "w2"),
        (("block_sparse_moe", "mlp"),),
    ),
    ExpertsFamily("olmoe", "OlmoeExperts", "num_local_experts", "intermediate_size"),
    ExpertsFamily("deepseek_v3", "DeepseekV3Experts", "num_local_experts", "moe_intermediate_size"),
)


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))``; ``x (n, H) -> (n, H)``. Linear names follow the family."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, up, nn.Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, down, nn.Linear(intermediate_size, hidden_size, bias=False))
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        return down(self.act_fn(gate(x)) * up(x))


COMPILED_DISPATCHES = ("sparse", "dense")
"""Values of :attr:`LinearExperts.compiled_dispatch` (see the module docstring)."""


class LinearExperts(nn.ModuleList):
    """``E`` :class:`ExpertMLP` modules replacing a fused ``<Family>Experts``; built with its ``(config)``.

    ``compiled_dispatch`` (``"sparse"`` or ``"dense"``; set it on an instance to change one layer) chooses the
    formulation traced by ``torch.compile``; eager calls always run the sparse loop over the experts hit.
    """

    family: ClassVar[ExpertsFamily]
    compiled_dispatch: str = "sparse"

    def __init__(self, config):
        super().__init__()
        family = self.family
        self.num_experts = getattr(config, family.num_experts)
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = getattr(config, family.intermediate)
        for _ in range(self.num_experts):
            self.append(ExpertMLP(self.hidden_dim, self.intermediate_dim, config.hidden_act, family.names))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states (N, H)``, ``top_k_index (N, k)`` long (``E`` = no expert), ``top_k_weights (N, k)``
        -> ``(N, H)`` in ``hidden_states.dtype``.

        Raises:
            ModelpatchValueError: ``compiled_dispatch`` is not one of :data:`COMPILED_DISPATCHES` (under
                ``torch.compile``).
        """
        if torch.compiler.is_compiling():
            dispatch = self.compiled_dispatch
            if dispatch == "sparse":
                return self._sparse_static(hidden_states, top_k_index, top_k_weights)
            if dispatch == "dense":
                return self._dense(hidden_states, top_k_index, top_k_weights)
            raise ModelpatchValueError(
                f"{type(self).__name__}.compiled_dispatch={dispatch!r}: expected one of {COMPILED_DISPATCHES}"
            )
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit[:, 0].tolist():
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            out = self[expert_idx](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def _sparse_static(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The eager loop over a fixed range of experts (no ``tolist``, no skip): each expert sees exactly its
        tokens, in the eager order (by top-k slot, then token), possibly none."""
        final = torch.zeros_like(hidden_states)
        by_slot = top_k_index.t()  # (k, N): torch.where yields slot-major order, as the eager one-hot mask does
        for expert_idx, expert in enumerate(self):
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


def _make_class(family: ExpertsFamily) -> type[LinearExperts]:
    name = f"Linear{family.original}"
    cls = type(
        name,
        (LinearExperts,),
        {
            "family": family,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"Per-expert linear replacement of ``{family.original}``.",
        },
    )
    globals()[name] = cls
    return cls


LINEAR_EXPERTS_CLASSES: dict[str, type[LinearExperts]] = {f.model_type: _make_class(f) for f in FAMILIES}
"""``{model_type: replacement class}`` (``LINEAR_EXPERTS_CLASSES["mixtral"].__name__ == "LinearMixtralExperts"``)."""


def _rules_factory(family: ExpertsFamily):
    def rules() -> list:
        return [WeightRenaming(source, target) for source, target in family.renamings]

    return rules


def _from_fused_factory(family: ExpertsFamily):
    gate, up, down = family.names

    def rules() -> list:
        return [
            WeightConverter(
                "mlp.experts.gate_up_proj",
                [f"mlp.experts.*.{gate}.weight", f"mlp.experts.*.{up}.weight"],
                [Chunk(dim=1), SplitModulelist(dim=0)],
            ),
            WeightConverter("mlp.experts.down_proj", f"mlp.experts.*.{down}.weight", [SplitModulelist(dim=0)]),
        ]

    return rules


def linear_experts_recipe(family: ExpertsFamily, *, from_fused: bool = False) -> Recipe:
    """The per-expert recipe of ``family`` for checkpoints with one tensor per expert (Hub layout), or with
    ``from_fused=True`` for checkpoints in Transformers' fused layout."""
    return Recipe(
        name=f"{family.model_type}-linear-experts" + ("-from-fused" if from_fused else ""),
        description=f"{family.original} -> ModuleList of per-expert nn.Linear ({'/'.join(family.names)})"
        + (", from a fused-layout checkpoint" if from_fused else ""),
        patch_mapping={family.original: LINEAR_EXPERTS_CLASSES[family.model_type]},
        conversion={
            family.model_type: RuleSpec((_from_fused_factory if from_fused else _rules_factory)(family), overwrite=True)
        },
        model_types=(family.model_type,),
    )
