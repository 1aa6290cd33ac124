"""Conversions between :class:`RoutingTrace` and inference-engine routed-experts arrays.

Engines return, per sequence, an integer array ``(seq_len, num_layers, top_k)``: vLLM's
``CompletionOutput.routed_experts`` (``enable_return_routed_experts=True``) is ``np.int32`` over *all* hidden
layers, with zeros in the slices of dense (non-MoE) layers; other engines use smaller dtypes or MoE-only layer
axes. Engines never route the last sampled token, so an array may hold ``seq_len - 1`` rows.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..errors import ModelpatchValueError
from .sites import find_router_sites
from .trace import RoutingTrace, RoutingTraceError

__all__ = ["from_routed_experts", "to_routed_experts"]


def _as_int64(x, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
    else:
        import numpy as np

        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise RoutingTraceError(f"{what}: expected an integer array, received dtype {a.dtype}")
        t = torch.from_numpy(a.astype(np.int64, copy=True))
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise RoutingTraceError(f"{what}: expected an integer array, received dtype {t.dtype}")
    return t.to(torch.int64)


def from_routed_experts(
    routed_experts,
    model: nn.Module,
    *,
    attention_mask=None,
    seq_lens: Sequence[int] | None = None,
    layer_axis: str = "auto",
) -> RoutingTrace:
    """Build a :class:`RoutingTrace` from inference-engine arrays.

    Args:
        routed_experts: one array ``(seq_len, num_layers, top_k)`` (a single sequence), a list of such arrays
            (variable lengths), or a padded batch ``(batch, seq_len, num_layers, top_k)`` together with
            ``attention_mask``. NumPy arrays or tensors of any integer dtype (uint8, uint16, int16, int32, int64;
            ids >= 256 survive). ``-1`` means "no route".
        model: the model the trace will be replayed on; its MoE layers, number of experts and top-k are read
            from its routers.
        attention_mask: ``(batch, seq_len)`` with 1 on real tokens, for a padded batch (left or right padding).
        seq_lens: total tokens per sequence as fed to the training forward. An array may hold ``seq_len`` or
            ``seq_len - 1`` rows (engines never route the last sampled token); a missing last row becomes ``-1``
            (routed naturally on replay).
        layer_axis: ``"all"`` (one slice per hidden layer; dense layers' slices are ignored, so vLLM's zeros
            there are never read as expert 0), ``"moe"`` (one slice per MoE layer, in layer order) or
            ``"auto"`` (detected from the axis length, which must then match one of the two).

    Returns:
        :class:`RoutingTrace` with ``num_hidden_layers`` set from the model.

    Raises:
        RoutingTraceError: wrong rank, a layer axis matching neither the model's hidden layers nor its MoE
            layers, a top-k axis different from the routers', an id ``>= num_experts`` or ``< -1``, or a row
            count other than ``seq_len`` / ``seq_len - 1``. Messages name the layer (and sequence), the expected
            and the received shape or range.
    """
    sites, _, num_hidden = find_router_sites(model)
    moe_layers = [s.layer_idx for s in sites]

    if isinstance(routed_experts, (list, tuple)):
        arrays = [_as_int64(a, f"sequence {i}") for i, a in enumerate(routed_experts)]
    else:
        t = _as_int64(routed_experts, "routed_experts")
        if t.dim() == 4:
            if attention_mask is None:
                arrays = list(t)
            else:
                mask = torch.as_tensor(attention_mask).bool().cpu()
                if mask.shape != t.shape[:2]:
                    raise RoutingTraceError(
                        f"attention_mask: expected shape {tuple(t.shape[:2])} (batch, seq_len), received "
                        f"{tuple(mask.shape)}"
                    )
                arrays = [t[b][mask[b]] for b in range(t.shape[0])]
        else:
            arrays = [t]
    for i, a in enumerate(arrays):
        if a.dim() != 3:
            raise RoutingTraceError(
                f"sequence {i}: expected shape (seq_len, num_layers, top_k), received {tuple(a.shape)}"
            )
    n_axis = {a.shape[1] for a in arrays}
    if len(n_axis) > 1:
        raise RoutingTraceError(f"sequences disagree on the layer axis length: {sorted(n_axis)}")
    n_axis = n_axis.pop() if n_axis else len(moe_layers)
    if layer_axis == "auto":
        if n_axis == num_hidden:
            layer_axis = "all"
        elif n_axis == len(moe_layers):
            layer_axis = "moe"
        else:
            raise RoutingTraceError(
                f"layer axis: expected {num_hidden} (all hidden layers) or {len(moe_layers)} (MoE layers "
                f"{moe_layers}), received {n_axis}"
            )
    expected = {"all": num_hidden, "moe": len(moe_layers)}.get(layer_axis)
    if expected is None:
        raise ModelpatchValueError(f"layer_axis must be 'auto', 'all' or 'moe', received {layer_axis!r}")
    if n_axis != expected:
        raise RoutingTraceError(f"layer axis ({layer_axis!r}): expected {expected} layers, received {n_axis}")
    if seq_lens is not None and len(seq_lens) != len(arrays):
        raise RoutingTraceError(f"seq_lens: expected {len(arrays)} lengths, received {len(seq_lens)}")

    routes: dict[int, list[torch.Tensor]] = {}
    for j, site in enumerate(sites):
        col = site.layer_idx if layer_axis == "all" else j
        per_seq = []
        for i, a in enumerate(arrays):
            if a.shape[2] != site.top_k:
                raise RoutingTraceError(
                    f"layer {site.layer_idx}, sequence {i}: expected top_k {site.top_k}, received {a.shape[2]}"
                )
            rows = a[:, col, :]
            if seq_lens is not None:
                want = int(seq_lens[i])
                if rows.shape[0] == want - 1:
                    rows = torch.cat([rows, rows.new_full((1, site.top_k), -1)])
                elif rows.shape[0] != want:
                    raise RoutingTraceError(
                        f"layer {site.layer_idx}, sequence {i}: expected {want} or {want - 1} rows, received "
                        f"{rows.shape[0]}"
                    )
            per_seq.append(rows)
        routes[site.layer_idx] = per_seq
    return RoutingTrace(
        routes,
        num_experts={s.layer_idx: s.num_experts for s in sites},
        top_k={s.layer_idx: s.top_k for s in sites},
        num_hidden_layers=num_hidden,
    )


def to_routed_experts(
    trace: RoutingTrace,
    sequence: int | None = None,
    *,
    layer_axis: str = "all",
    dense_fill: int = -1,
    dtype: torch.dtype = torch.int32,
):
    """Engine layout of a trace.

    Args:
        trace: the trace.
        sequence: which sequence; ``None`` returns a list with every sequence.
        layer_axis: ``"all"`` (``num_hidden_layers`` slices, dense layers filled with ``dense_fill``; needs
            ``trace.num_hidden_layers``) or ``"moe"`` (MoE layers only, in layer order).
        dense_fill: value written in the slices of dense layers (vLLM writes 0; -1 keeps them unambiguous).
        dtype: integer dtype of the result (``torch.int32`` like vLLM's ``np.int32``).

    Returns:
        a tensor ``(seq_len, num_layers, top_k)`` (``-1`` for tokens without a route), or a list of them.

    Raises:
        RoutingTraceError: ``layer_axis="all"`` without ``num_hidden_layers``, or layers with different top-k.
    """
    layers = trace.layers
    ks = {trace.top_k[layer] for layer in layers}
    if len(ks) != 1:
        raise RoutingTraceError(f"engine arrays need one top_k for all layers, trace has {sorted(ks)}")
    k = ks.pop()
    if layer_axis == "all":
        if trace.num_hidden_layers is None:
            raise RoutingTraceError("layer_axis='all' needs trace.num_hidden_layers (build the trace from a model)")
        cols = list(layers)
        n_axis = trace.num_hidden_layers
    elif layer_axis == "moe":
        cols = list(range(len(layers)))
        n_axis = len(layers)
    else:
        raise ModelpatchValueError(f"layer_axis must be 'all' or 'moe', received {layer_axis!r}")
    per_layer = {layer: trace[layer] for layer in layers}
    seqs = range(trace.num_sequences) if sequence is None else [sequence]
    out = []
    for i in seqs:
        n = trace.sequence_lengths[i]
        arr = torch.full((n, n_axis, k), dense_fill, dtype=torch.int64)
        for col, layer in zip(cols, layers):
            arr[:, col, :] = per_layer[layer][i]
        out.append(arr.to(dtype))
    return out[0] if sequence is not None else out
