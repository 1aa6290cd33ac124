"""Calibration of per-expert linear experts: :func:`calibrate_all_experts` runs every expert on every token.

Post-training quantisers that calibrate on activations (GPTQ, AWQ, SmoothQuant: a forward hook on each
``nn.Linear`` that accumulates statistics of its inputs) only see the tokens the router sends to an expert, so an
expert that no calibration token picks gets no statistics at all ("dead" experts), and rarely picked experts get a
few rows. llm-compressor solves this by linearising the MoE block and feeding all tokens to every expert during
calibration (its ``calibrate_all_experts`` option of the MoE linearisation); this is the same idea for the
per-expert modules of the ``*-linear-experts`` recipes: inside the block, each expert ``e`` of every
:class:`~modelpatch.recipes.linear_experts.LinearExperts` is called once on all ``N`` tokens of the layer, and the
layer's output still adds only the rows of the tokens routed to ``e``, weighted as in the plain forward, in the
same order (so outputs equal the plain forward within fp32 rounding: the only difference is that a matmul over
``N`` rows instead of the routed subset may block its sums differently).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from ...errors import ModelpatchValueError
from ...undo import UndoStack
from .layer import LinearExperts

__all__ = ["calibrate_all_experts"]


def _all_experts_forward(
    module: LinearExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """:meth:`LinearExperts.forward` with every expert called on all ``N`` rows of ``hidden_states (N, H)``; the
    rows routed to it (``top_k_index (N, k)``, ``E`` = padding) are weighted by ``top_k_weights (N, k)`` and
    added in the eager order (expert index, then top-k slot, then token)."""
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=module.num_experts + 1).permute(2, 1, 0)
    for expert_idx, expert in enumerate(module):
        every_token = expert(hidden_states)
        top_k_pos, token_idx = torch.where(mask[expert_idx])
        if token_idx.numel() == 0:
            continue
        out = every_token[token_idx] * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


@contextmanager
def calibrate_all_experts(model: nn.Module) -> Iterator[list[str]]:
    """Within the block, every expert of every per-expert MoE layer of ``model`` runs on every token.

    For calibration observers (GPTQ/AWQ hooks on each expert ``nn.Linear``): each expert's Linears see all ``N``
    tokens of the layer (one call each per forward, input ``(N, H)``), including experts that no token is routed to,
    while each layer's output keeps only the routed experts' contributions: model outputs equal the plain forward
    within fp32 rounding (measured ≤ 1e-6). Costs ``E / k`` times the expert FLOPs of a forward. Routing is
    unchanged (routers, routing record/replay and output capture behave as in a plain forward).

    Source: llm-compressor's MoE calibration (``calibrate_all_experts`` in its linearised MoE modules).

    Args:
        model: a model whose MoE experts are :class:`~modelpatch.recipes.linear_experts.LinearExperts` (loaded or patched
            with a ``*-linear-experts`` recipe, or the generic ``linear-experts`` recipe).

    Yields:
        The qualified names of the MoE expert modules put in calibration mode. Every one is back to its plain
        forward on any exit of the block (normal or exception).

    Raises:
        ModelpatchValueError: ``model`` has no per-expert linear experts (the message names fused expert modules
            found, which need a ``*-linear-experts`` recipe first).
    """
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, LinearExperts)]
    if not found:
        fused = [name for name, module in model.named_modules() if type(module).__name__.endswith("Experts")]
        hint = f"; fused expert modules found: {fused[:3]}{' ...' if len(fused) > 3 else ''}" if fused else ""
        raise ModelpatchValueError(
            f"calibrate_all_experts: {type(model).__name__} has no per-expert linear experts (LinearExperts){hint}. "
            "Load or patch the model with a '<model_type>-linear-experts' recipe first."
        )
    with UndoStack() as undo:
        for _, module in found:
            undo.setattr(module, "forward", _bound(module), raw=True)
        yield [name for name, _ in found]


def _bound(module: LinearExperts):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return _all_experts_forward(module, hidden_states, top_k_index, top_k_weights)

    return forward
