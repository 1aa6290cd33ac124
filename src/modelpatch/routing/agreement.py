"""Routing drift: how far two routings of the same tokens agree (R3's measures), and a model against a trace.

R3 ("Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers", arXiv 2510.11370) measures
the mismatch between the experts an inference engine chose and those the trainer's forward chooses for the same
tokens; these are its definitions, on :class:`~modelpatch.routing.trace.RoutingTrace` pairs:

* **router disagreement rate**: the share of (token, MoE layer) pairs whose top-k *set* differs (order within the
  top-k is ignored; R3 reports ~10% of routers disagreeing per forward on Qwen3-30B-A3B);
* **token flip rate**: the share of tokens with at least one MoE layer whose top-k set differs (R3: 94% of tokens);
* **mean top-k overlap**: the mean of ``|A ∩ B| / k`` over (token, layer) pairs (1.0 = identical).

Rows without a route (``-1``, e.g. the last sampled token an engine never routed) are left out of every measure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import RoutingTraceError
from .session import record_routing
from .trace import RoutingTrace

__all__ = ["LayerAgreement", "RoutingAgreement", "compare_routing", "routing_drift"]


@dataclass(frozen=True)
class LayerAgreement:
    """Agreement of one MoE layer: ``tokens`` compared (rows with a route in both traces), the share whose top-k
    set differs (``disagreement_rate``) and the mean ``|A ∩ B| / k`` (``mean_topk_overlap``)."""

    layer: int
    tokens: int
    disagreement_rate: float
    mean_topk_overlap: float


@dataclass(frozen=True)
class RoutingAgreement:
    """R3's routing-agreement measures of two traces of the same tokens (see the module docstring).

    Attributes:
        layers: one :class:`LayerAgreement` per MoE layer, in layer order.
        tokens: tokens compared (with a route in at least one layer of both traces).
        router_disagreement_rate: share of (token, layer) pairs whose top-k set differs, in [0, 1].
        token_flip_rate: share of tokens with at least one layer differing, in [0, 1].
        mean_topk_overlap: mean ``|A ∩ B| / k`` over (token, layer) pairs, in [0, 1].
    """

    layers: tuple[LayerAgreement, ...]
    tokens: int
    router_disagreement_rate: float
    token_flip_rate: float
    mean_topk_overlap: float

    def worst_layers(self, n: int = 3) -> list[LayerAgreement]:
        """The ``n`` layers with the highest disagreement rate (ties: lower overlap first, then layer order)."""
        return sorted(self.layers, key=lambda a: (-a.disagreement_rate, a.mean_topk_overlap, a.layer))[:n]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly dict (layers as a list of dicts)."""
        return {
            "tokens": self.tokens,
            "router_disagreement_rate": self.router_disagreement_rate,
            "token_flip_rate": self.token_flip_rate,
            "mean_topk_overlap": self.mean_topk_overlap,
            "layers": [vars(layer) for layer in self.layers],
        }

    def table(self) -> str:
        """A per-layer text table followed by the overall measures."""
        lines = [f"{'layer':>5}  {'tokens':>7}  {'disagree':>8}  {'overlap':>7}"]
        for a in self.layers:
            lines.append(f"{a.layer:>5}  {a.tokens:>7}  {a.disagreement_rate:>8.2%}  {a.mean_topk_overlap:>7.3f}")
        lines.append(
            f"overall: {self.tokens} tokens, router disagreement {self.router_disagreement_rate:.2%}, token flip "
            f"{self.token_flip_rate:.2%}, mean top-k overlap {self.mean_topk_overlap:.3f}"
        )
        return "\n".join(lines)


def _check_same_tokens(reference: RoutingTrace, other: RoutingTrace) -> None:
    if reference.layers != other.layers:
        raise RoutingTraceError(f"the traces cover different MoE layers: {reference.layers} vs {other.layers}")
    if reference.sequence_lengths != other.sequence_lengths:
        raise RoutingTraceError(
            "the traces are not of the same tokens: sequence lengths "
            f"{reference.sequence_lengths} vs {other.sequence_lengths}"
        )
    for layer in reference.layers:
        if reference.top_k[layer] != other.top_k[layer]:
            raise RoutingTraceError(
                f"layer {layer}: top_k {reference.top_k[layer]} vs {other.top_k[layer]}; the traces are of different "
                "routers"
            )


def compare_routing(reference: RoutingTrace, other: RoutingTrace) -> RoutingAgreement:
    """R3's agreement measures (module docstring) between two traces of the same tokens.

    Args:
        reference: e.g. the rollout engine's routes (:meth:`RoutingTrace.from_routed_experts`) or a recording.
        other: the routes to compare, of the same sequences and tokens (e.g. the trainer's natural routing).

    Returns:
        :class:`RoutingAgreement` (per layer and overall). Rows that are ``-1`` (no route) in either trace are
        not compared.

    Raises:
        RoutingTraceError: the traces differ in MoE layers, sequence lengths or a layer's top-k (naming them).
    """
    _check_same_tokens(reference, other)
    per_layer: list[LayerAgreement] = []
    differ_by_layer, routed_by_layer = [], []
    total_pairs = total_differ = 0
    overlap_sum = 0.0
    for layer in reference.layers:
        a = torch.cat(reference.layer_routes(layer, copy=False)) if reference.num_sequences else torch.empty(0, 0)
        b = torch.cat(other.layer_routes(layer, copy=False)) if other.num_sequences else torch.empty(0, 0)
        k = reference.top_k[layer]
        routed = (a[:, 0] >= 0) & (b[:, 0] >= 0) if a.numel() else torch.zeros(0, dtype=torch.bool)
        common = (a[:, :, None] == b[:, None, :]).any(dim=-1).sum(dim=-1) if a.numel() else torch.zeros(0)
        differ = (common < k) & routed
        tokens = int(routed.sum())
        overlap = float((common[routed].double() / k).sum()) if tokens else 0.0
        per_layer.append(
            LayerAgreement(
                layer, tokens, int(differ.sum()) / tokens if tokens else 0.0, overlap / tokens if tokens else 1.0
            )
        )
        differ_by_layer.append(differ)
        routed_by_layer.append(routed)
        total_pairs += tokens
        total_differ += int(differ.sum())
        overlap_sum += overlap
    if differ_by_layer and differ_by_layer[0].numel():
        flipped = torch.stack(differ_by_layer).any(dim=0)
        compared = torch.stack(routed_by_layer).any(dim=0)
        tokens = int(compared.sum())
        flip_rate = int(flipped.sum()) / tokens if tokens else 0.0
    else:
        tokens, flip_rate = 0, 0.0
    return RoutingAgreement(
        layers=tuple(per_layer),
        tokens=tokens,
        router_disagreement_rate=total_differ / total_pairs if total_pairs else 0.0,
        token_flip_rate=flip_rate,
        mean_topk_overlap=overlap_sum / total_pairs if total_pairs else 1.0,
    )


def routing_drift(
    model: nn.Module, trace: RoutingTrace, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> RoutingAgreement:
    """``trace`` against ``model``'s own natural routing of the same tokens: "does my trainer still route like my
    rollout engine?" (R3's measures, :func:`compare_routing` with ``trace`` as the reference).

    Runs one forward of ``model`` (no gradient) on ``input_ids`` ``(batch, seq_len)`` long, with
    ``attention_mask`` ``(batch, seq_len)`` for a padded batch (padding is not compared), recording its routing.

    Raises:
        RoutingTraceError: the trace is not of these tokens (sequence lengths differ) or of other routers.
        RoutingDiscoveryError: ``model`` has no top-k router.
    """
    with torch.no_grad(), record_routing(model) as natural:
        model(input_ids=input_ids, attention_mask=attention_mask)
    return compare_routing(trace, natural)
