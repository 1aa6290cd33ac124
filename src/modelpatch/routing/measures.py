"""R3's routing-agreement measures, accumulated forward by forward.

R3 ("Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers", arXiv 2510.11370)
measures how far the experts one router run chose differ from another's for the same tokens:

* **router disagreement rate**: the share of (token, MoE layer) pairs whose top-k *set* differs (order within the
  top-k is ignored);
* **token flip rate**: the share of tokens with at least one MoE layer whose top-k set differs;
* **mean top-k overlap**: the mean of ``|A ∩ B| / k`` over (token, layer) pairs (1.0 = identical).

:class:`RoutingDriftMeter` accumulates them from ``(tokens, top_k)`` index pairs, one forward at a time, on the
tensors' device (no host synchronisation until :meth:`RoutingDriftMeter.result`); rows that are ``-1`` (no route) in
either are left out. :func:`~modelpatch.routing.compare_routing` and ``replay_routing(..., drift=meter)`` (the live
router's natural choice against the replayed one, measured during the replay forward itself) both use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LayerAgreement", "RoutingAgreement", "RoutingDriftMeter"]


@dataclass(frozen=True)
class LayerAgreement:
    """Agreement of one MoE layer: ``tokens`` compared (rows with a route in both), the share whose top-k set
    differs (``disagreement_rate``) and the mean ``|A ∩ B| / k`` (``mean_topk_overlap``)."""

    layer: int
    tokens: int
    disagreement_rate: float
    mean_topk_overlap: float


@dataclass(frozen=True)
class RoutingAgreement:
    """R3's routing-agreement measures (see the module docstring).

    Attributes:
        layers: one :class:`LayerAgreement` per MoE layer, in layer order.
        tokens: tokens compared (with a route in at least one layer of both).
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


class RoutingDriftMeter:
    """Accumulates R3's measures over forwards: :meth:`add` each MoE layer's ``(tokens, top_k)`` pair of one forward
    (the same tokens, in the same row order, for every layer of that forward), then :meth:`end_forward`;
    :meth:`result` returns the :class:`RoutingAgreement` of everything added since :meth:`reset`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything added."""
        self._layers: dict[int, torch.Tensor] = {}  # layer -> float64 (tokens, differing, overlap sum)
        self._flipped: torch.Tensor | None = None  # this forward: a layer differs, per row
        self._routed: torch.Tensor | None = None  # this forward: compared in some layer, per row
        self._tokens: list[torch.Tensor] = []
        self._flips: list[torch.Tensor] = []

    def add(self, layer: int, other: torch.Tensor, reference: torch.Tensor) -> None:
        """Compare one layer's ``other`` with ``reference`` indices, LongTensors ``(tokens, top_k)``."""
        with torch.no_grad():
            other, reference = other.detach(), reference.detach().to(other.device)
            k = reference.shape[-1]
            routed = (reference[:, 0] >= 0) & (other[:, 0] >= 0)
            common = (other[:, :, None] == reference[:, None, :]).any(dim=-1).sum(dim=-1)
            differ = (common < k) & routed
            overlap = torch.where(
                routed, common.double() / k, torch.zeros((), dtype=torch.float64, device=common.device)
            )
            sums = torch.stack([routed.sum().double(), differ.sum().double(), overlap.sum()])
            previous = self._layers.get(layer)
            self._layers[layer] = sums if previous is None else previous + sums.to(previous.device)
            if self._flipped is None or self._flipped.shape != differ.shape:
                self.end_forward()
                self._flipped, self._routed = differ.clone(), routed.clone()
            else:
                self._flipped |= differ
                assert self._routed is not None
                self._routed |= routed

    def end_forward(self) -> None:
        """Close the current forward (token flips are counted per forward)."""
        if self._flipped is not None and self._routed is not None:
            self._flips.append(self._flipped.sum())
            self._tokens.append(self._routed.sum())
        self._flipped = self._routed = None

    def result(self) -> RoutingAgreement:
        """The measures of everything added (closes the current forward)."""
        self.end_forward()
        layers = []
        pairs = differing = 0.0
        overlap = 0.0
        for layer in sorted(self._layers):
            tokens, differ, over = (float(v) for v in self._layers[layer].tolist())
            layers.append(
                LayerAgreement(layer, int(tokens), differ / tokens if tokens else 0.0, over / tokens if tokens else 1.0)
            )
            pairs, differing, overlap = pairs + tokens, differing + differ, overlap + over
        tokens = int(sum(int(t) for t in self._tokens))
        flips = int(sum(int(f) for f in self._flips))
        return RoutingAgreement(
            layers=tuple(layers),
            tokens=tokens,
            router_disagreement_rate=differing / pairs if pairs else 0.0,
            token_flip_rate=flips / tokens if tokens else 0.0,
            mean_topk_overlap=overlap / pairs if pairs else 1.0,
        )
