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

import torch
from torch import nn

from .errors import RoutingTraceError
from .measures import LayerAgreement, RoutingAgreement, RoutingDriftMeter
from .record import record_routing
from .trace import RoutingTrace

__all__ = ["LayerAgreement", "RoutingAgreement", "RoutingDriftMeter", "compare_routing", "routing_drift"]


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
    meter = RoutingDriftMeter()
    for layer in reference.layers:
        if reference.num_sequences:
            meter.add(
                layer,
                torch.cat(other.layer_routes(layer, copy=False)),
                torch.cat(reference.layer_routes(layer, copy=False)),
            )
    return meter.result()


def routing_drift(
    model: nn.Module, trace: RoutingTrace, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> RoutingAgreement:
    """``trace`` against ``model``'s own natural routing of the same tokens: "does my trainer still route like my
    rollout engine?" (R3's measures, :func:`compare_routing` with ``trace`` as the reference).

    Runs one forward of ``model`` (no gradient) on ``input_ids`` ``(batch, seq_len)`` long, with
    ``attention_mask`` ``(batch, seq_len)`` for a padded batch (padding is not compared), recording its routing.

    A trace recorded around ``generate`` holds one row fewer per sequence than its output (the last generated
    token is never fed to the model): pass that output as ``input_ids`` (with, for a padded prompt batch, the
    prompt mask extended by ones for the new tokens) and the last token of each sequence is left out of the
    comparison.

    Raises:
        RoutingTraceError: the trace is not of these tokens (sequence lengths differ by other than that one
            generated row; the message says how to call for a ``generate`` trace) or of other routers.
        RoutingDiscoveryError: ``model`` has no top-k router.
    """
    with torch.no_grad(), record_routing(model) as natural:
        model(input_ids=input_ids, attention_mask=attention_mask)
    wanted, fed = trace.sequence_lengths, natural.sequence_lengths
    if wanted != fed and len(wanted) == len(fed) and all(w == f - 1 for w, f in zip(wanted, fed)):
        natural = RoutingTrace(  # a generate trace: compare every row but the last generated token's
            {layer: [rows[:-1] for rows in natural.layer_routes(layer, copy=False)] for layer in natural.layers},
            num_experts=natural.num_experts,
            top_k=natural.top_k,
            num_hidden_layers=natural.num_hidden_layers,
        )
    elif wanted != fed:
        raise RoutingTraceError(
            f"the trace is not of these tokens: sequence lengths {wanted} (trace) vs {fed} (input_ids"
            f"{' with attention_mask' if attention_mask is not None else ', no attention_mask'}); pass the tokens "
            "the trace was recorded on, or for a trace recorded around generate() its output with "
            "attention_mask=torch.cat([prompt_mask, prompt_mask.new_ones(batch, new_tokens)], dim=1) (the trace "
            "is then one row short per sequence: the last generated token is never fed to the model)"
        )
    return compare_routing(trace, natural)
