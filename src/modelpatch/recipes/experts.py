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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
from transformers.activations import ACT2FN

from ..conversion import Chunk, SplitModulelist, WeightConverter, WeightRenaming
from .base import Recipe, RuleSpec

__all__ = ["ExpertsFamily", "ExpertMLP", "LinearExperts", "LINEAR_EXPERTS_CLASSES", "linear_experts_recipe", "FAMILIES"]


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


class LinearExperts(nn.ModuleList):
    """``E`` :class:`ExpertMLP` modules replacing a fused ``<Family>Experts``; built with its ``(config)``."""

    family: ClassVar[ExpertsFamily]

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
