"""Inference-engine routed-experts arrays: reading them into per-layer routes and writing routes back.

Engines return, per sequence, an integer array ``(seq_len, num_layers, top_k)``: vLLM's
``CompletionOutput.routed_experts`` (``enable_return_routed_experts=True``) is ``np.int32`` over *all* hidden
layers, with zeros in the slices of dense (non-MoE) layers; other engines use smaller dtypes or MoE-only layer
axes. Engines never route the last sampled token, so an array may hold ``seq_len - 1`` rows.

This module works on plain tensors and knows nothing of :class:`~modelpatch.routing.trace.RoutingTrace`: the
trace's :meth:`~modelpatch.routing.trace.RoutingTrace.from_routed_experts` and
:meth:`~modelpatch.routing.trace.RoutingTrace.to_routed_experts` call :func:`routes_from_engine_arrays` and
:func:`engine_arrays_from_routes`.

Which inputs hold how many sequences (:func:`split_sequences`):

- a tensor or NumPy array ``(seq_len, num_layers, top_k)`` is one sequence; ``(batch, seq_len, num_layers,
  top_k)`` is a batch, one sequence per row (``attention_mask`` drops the padded positions);
- a list or tuple of tensors / NumPy arrays holds one array ``(seq_len, num_layers, top_k)`` per sequence
  (lengths may differ; no ``attention_mask``: the arrays are unpadded);
- a nested Python list of integers is read as the array it spells, by its depth: three deep
  (``arr.tolist()`` of one sequence, e.g. ``[[[1, 2]], [[0, 3]]]`` = 2 tokens, 1 layer, top-2) is ONE
  sequence, four deep is a batch (or, when its sequences differ in length, one entry per sequence).
  Anything else raises :class:`RoutingTraceError` naming the shape received and the forms accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from ..errors import ModelpatchValueError
from .errors import RoutingTraceError
from .sites import find_router_sites

__all__ = [
    "EngineRoutes",
    "split_sequences",
    "routes_from_engine_arrays",
    "validate_engine_routes",
    "engine_arrays_from_routes",
]

_FORMS = (
    "one sequence (seq_len, num_layers, top_k), a padded batch (batch, seq_len, num_layers, top_k), or a "
    "list of per-sequence arrays (seq_len, num_layers, top_k)"
)


class EngineRoutes(NamedTuple):
    """What :func:`routes_from_engine_arrays` reads: the arguments of a ``RoutingTrace``.

    Attributes:
        routes: ``{layer_idx: [LongTensor (num_tokens, top_k) per sequence]}`` for every MoE layer.
        num_experts: ``{layer_idx: experts of that layer's router}``.
        top_k: ``{layer_idx: top-k of that layer's router}``.
        num_hidden_layers: the model's decoder layers, dense ones included.
    """

    routes: dict[int, list[torch.Tensor]]
    num_experts: dict[int, int]
    top_k: dict[int, int]
    num_hidden_layers: int


def _as_int64(x, what: str, *, ragged_ok: bool = False) -> torch.Tensor | None:
    """``x`` as an int64 CPU tensor; ``None`` for a ragged nested list when ``ragged_ok``."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
    else:
        import numpy as np

        try:
            a = np.asarray(x)
            ragged = a.dtype.kind == "O" and isinstance(x, (list, tuple))  # NumPy < 1.24 builds object arrays
            reason = "object array"
        except ValueError as exc:
            ragged, reason = True, str(exc)
        if ragged:
            if ragged_ok:
                return None
            raise RoutingTraceError(
                f"{what}: a nested list must be rectangular, received rows of different lengths ({reason}); "
                f"expected {_FORMS}"
            )
        if a.dtype.kind not in "iu":
            raise RoutingTraceError(f"{what}: expected an integer array, received dtype {a.dtype}")
        t = torch.from_numpy(a.astype(np.int64, copy=True))
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise RoutingTraceError(f"{what}: expected an integer array, received dtype {t.dtype}")
    return t.to(torch.int64)


def _is_array(x) -> bool:
    """A tensor or an array with at least one dimension (NumPy, or anything with ``__array__``)."""
    return isinstance(x, torch.Tensor) or (hasattr(x, "__array__") and getattr(x, "ndim", 0) >= 1)


def _list_depth(x) -> int:
    """Nesting depth of a Python list/tuple, following its first entries (a scalar or empty list ends it)."""
    depth = 0
    while isinstance(x, (list, tuple)):
        depth += 1
        if not x:
            break
        x = x[0]
    return depth


def _check_sequence(a: torch.Tensor, i: int) -> torch.Tensor:
    if a.dim() != 3:
        hint = (
            "; a list is read as one array per sequence: for a single sequence pass one array "
            "(e.g. np.stack of the per-token rows)"
            if a.dim() == 2
            else ""
        )
        raise RoutingTraceError(
            f"sequence {i}: expected shape (seq_len, num_layers, top_k), received {tuple(a.shape)}{hint}"
        )
    return a


def split_sequences(routed_experts, attention_mask=None) -> list[torch.Tensor]:
    """The sequences held by ``routed_experts`` (see the module docstring for which input holds how many).

    Args:
        routed_experts: a tensor / NumPy array ``(seq_len, num_layers, top_k)`` or ``(batch, seq_len,
            num_layers, top_k)``, a list of per-sequence arrays, or a nested Python list of integers.
        attention_mask: ``(batch, seq_len)``, 1 on real tokens; only with a batch (4-D) input.

    Returns:
        one LongTensor ``(seq_len_i, num_layers, top_k)`` (int64, CPU) per sequence.

    Raises:
        RoutingTraceError: a non-integer dtype, a rank other than 3 or 4 (3 for each entry of a list of
            arrays), a ragged nested list, an ``attention_mask`` whose shape is not ``(batch, seq_len)``, or an
            ``attention_mask`` given with a list of per-sequence arrays.
    """
    t: torch.Tensor | None = None
    if isinstance(routed_experts, (list, tuple)):
        if not routed_experts:
            return []  # no sequences
        if not any(_is_array(a) for a in routed_experts):  # a nested Python list: the array it spells
            # four deep but ragged: sequences of different lengths, one entry each (t stays None)
            t = _as_int64(routed_experts, "routed_experts", ragged_ok=_list_depth(routed_experts) == 4)
    else:
        t = _as_int64(routed_experts, "routed_experts")
    if t is None:  # one array per sequence
        if attention_mask is not None:
            raise RoutingTraceError(
                f"attention_mask: given with a list of {len(routed_experts)} per-sequence arrays, which are "
                "unpadded; pass the padded batch as one array (batch, seq_len, num_layers, top_k) with its "
                "attention_mask, or the list without attention_mask"
            )
        sequences = [_as_int64(a, f"sequence {i}") for i, a in enumerate(routed_experts)]
        return [_check_sequence(s, i) for i, s in enumerate(sequences) if s is not None]
    if t.dim() == 3:
        return [t]
    if t.dim() != 4:
        raise RoutingTraceError(f"routed_experts: expected {_FORMS}; received shape {tuple(t.shape)}")
    if attention_mask is None:
        return list(t)
    mask = torch.as_tensor(attention_mask).bool().cpu()
    if mask.shape != t.shape[:2]:
        raise RoutingTraceError(
            f"attention_mask: expected shape {tuple(t.shape[:2])} (batch, seq_len), received {tuple(mask.shape)}"
        )
    return [t[b][mask[b]] for b in range(t.shape[0])]


def routes_from_engine_arrays(  # noqa: C901 - the accepted input forms (per layer / per token axis, padded or packed) each need their own check
    routed_experts,
    model: nn.Module,
    *,
    attention_mask=None,
    seq_lens: Sequence[int] | None = None,
    layer_axis: str = "auto",
    validate: bool = True,
) -> EngineRoutes:
    """Per-layer routes of inference-engine arrays, checked against ``model``'s routers.

    Arguments as :meth:`modelpatch.routing.RoutingTrace.from_routed_experts`, which builds the trace from the
    result. Ids are not range-checked here (the trace's constructor does that).

    Engines have returned broken routes (all-zero rows where they recorded nothing: prompt tokens served from the
    prefix cache, preempted requests), so each array is validated (:func:`validate_engine_routes`): an id
    ``>= num_experts``, ids repeated within a row (a zero-filled row with ``top_k >= 2``), leading prompt rows
    that are zero in every MoE layer, and (``layer_axis="auto"``) dense-layer slices holding routes, which means
    the layer axis cannot be told apart, each raise :class:`RoutingTraceError` naming layer, sequence, row and
    values. ``validate=False`` turns the failing rows into ``-1`` (routed naturally on replay) instead.

    Returns:
        :class:`EngineRoutes`: routes ``{layer_idx: [LongTensor (num_tokens, top_k) per sequence]}`` of every
        MoE layer (a missing last row filled with ``-1`` when ``seq_lens`` asks for it), and the routers'
        ``num_experts`` and ``top_k`` per layer, and the model's ``num_hidden_layers``.

    Raises:
        RoutingTraceError: see :func:`split_sequences`; a layer axis matching neither the model's hidden layers
            nor its MoE layers, a top-k axis different from the routers', or a row count other than
            ``seq_len`` / ``seq_len - 1``.
        ModelpatchValueError: ``layer_axis`` not one of ``"auto"``, ``"all"``, ``"moe"``.
    """
    sites, _, num_hidden = find_router_sites(model)
    moe_layers = [s.layer_idx for s in sites]
    arrays = split_sequences(routed_experts, attention_mask)
    n_axes = {a.shape[1] for a in arrays}
    if len(n_axes) > 1:
        raise RoutingTraceError(f"sequences disagree on the layer axis length: {sorted(n_axes)}")
    n_axis = n_axes.pop() if n_axes else len(moe_layers)
    auto = layer_axis == "auto"
    if layer_axis == "auto":
        if n_axis == num_hidden:
            layer_axis = "all"
        elif n_axis == len(moe_layers):
            layer_axis = "moe"
        else:
            wanted = (
                f"{num_hidden} (every hidden layer is an MoE layer)"
                if num_hidden == len(moe_layers)
                else f"{num_hidden} (all hidden layers) or {len(moe_layers)} (MoE layers {moe_layers})"
            )
            raise RoutingTraceError(f"layer axis: expected {wanted}, received {n_axis}")
    expected = {"all": num_hidden, "moe": len(moe_layers)}.get(layer_axis)
    if expected is None:
        raise ModelpatchValueError(f"layer_axis must be 'auto', 'all' or 'moe', received {layer_axis!r}")
    if n_axis != expected:
        raise RoutingTraceError(f"layer axis ({layer_axis!r}): expected {expected} layers, received {n_axis}")
    dense = [layer for layer in range(num_hidden) if layer not in moe_layers]
    if validate and auto and layer_axis == "all" and dense:
        for i, a in enumerate(arrays):
            held = a[:, dense, :]
            if bool(((held != 0) & (held != -1)).any()):
                row, col, _ = (int(v) for v in ((held != 0) & (held != -1)).nonzero()[0])
                raise RoutingTraceError(
                    f"layer axis is ambiguous: sequence {i}, row {row} holds routes {a[row, dense[col]].tolist()} in "
                    f"dense layer {dense[col]}, where an all-layers array (vLLM) holds zeros; pass "
                    f"layer_axis='all' or 'moe' (MoE layers {moe_layers})"
                )
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
            per_seq.append(rows.clone())
        routes[site.layer_idx] = per_seq
    sizes = {s.layer_idx: s.num_experts for s in sites}
    validate_engine_routes(routes, sizes, fix=not validate)
    return EngineRoutes(
        routes,
        {s.layer_idx: s.num_experts for s in sites},
        {s.layer_idx: s.top_k for s in sites},
        num_hidden,
    )


def validate_engine_routes(routes: dict[int, list[torch.Tensor]], num_experts: dict[int, int], *, fix: bool) -> int:  # noqa: C901 - each branch is one defect of an engine's rows, named in its message
    """Check engine routes ``{layer_idx: [LongTensor (num_tokens, top_k) per sequence]}`` in place.

    A row fails when it holds an id ``>= num_experts`` or ``< -1``, repeats an id (``[0, 0]``: a zero-filled row
    with ``top_k >= 2``), or, among the leading rows of a sequence, is zero in every MoE layer for two rows or more
    (``top_k == 1``: engines return zeros for prompt tokens they did not route; two leading all-zero rows in
    every layer of a model with two MoE layers or more are not a routing). ``-1`` rows (no route) pass.

    Returns:
        the number of rows set to ``-1`` (``fix=True``).

    Raises:
        RoutingTraceError: (``fix=False``) the first failing row, naming layer, sequence, row and values.
    """
    fixed = 0

    def fail(layer: int, seq: int, row: int, why: str) -> None:
        nonlocal fixed
        if not fix:
            values = routes[layer][seq][row].tolist()
            raise RoutingTraceError(f"layer {layer}, sequence {seq}, row {row}: {why}, received {values}")
        routes[layer][seq][row] = -1
        fixed += 1

    layers = sorted(routes)
    for layer in layers:
        for seq, rows in enumerate(routes[layer]):
            if not rows.numel():
                continue
            bad = (rows >= num_experts[layer]) | (rows < -1)
            for row in bad.any(dim=1).nonzero()[:, 0].tolist():
                fail(layer, seq, row, f"expert ids must be in [0, {num_experts[layer]}) or -1")
            if rows.shape[1] > 1:
                ordered = rows.sort(dim=1).values
                repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(dim=1)
                for row in repeated.nonzero()[:, 0].tolist():
                    fail(
                        layer,
                        seq,
                        row,
                        "expert ids repeated within a row (a zero-filled row: the engine recorded no route here; "
                        "prefix-cached prompt tokens?)",
                    )
    if len(layers) >= 2 and all(routes[layer] and routes[layer][0].shape[1] == 1 for layer in layers):
        for seq in range(len(routes[layers[0]])):
            zero = torch.stack([(routes[layer][seq] == 0).all(dim=1) for layer in layers]).all(dim=0)
            leading = int(zero.long().cumprod(0).sum())
            if leading >= 2:
                for row in range(leading):
                    for layer in layers:
                        if fix:
                            routes[layer][seq][row] = -1
                    if not fix:
                        fail(
                            layers[0],
                            seq,
                            row,
                            f"the first {leading} rows are expert 0 in every MoE layer (zeros where the engine "
                            "recorded no route: prefix-cached prompt tokens?)",
                        )
                    fixed += 1
    return fixed


def engine_arrays_from_routes(
    routes: dict[int, Sequence[torch.Tensor]],
    sequences: Sequence[int],
    *,
    top_k: int,
    num_hidden_layers: int | None,
    layer_axis: str = "all",
    dense_fill: int = -1,
    dtype: torch.dtype = torch.int32,
) -> list[torch.Tensor]:
    """Engine arrays of the given sequences of per-layer routes.

    Args:
        routes: ``{layer_idx: [LongTensor (num_tokens, top_k) per sequence]}`` (at least one layer); per
            sequence, every layer the same number of tokens. Only read.
        sequences: indices of the sequences to convert, in output order.
        top_k: experts per token, the same for every layer (the caller checks it).
        num_hidden_layers: length of the layer axis for ``layer_axis="all"``.
        layer_axis: ``"all"`` (one slice per hidden layer, dense layers filled with ``dense_fill``) or ``"moe"``
            (MoE layers only, ascending).
        dense_fill: value of the dense layers' slices.
        dtype: integer dtype of the result.

    Returns:
        one tensor ``(seq_len, num_layers, top_k)`` of ``dtype`` per requested sequence (``-1`` for tokens
        without a route).

    Raises:
        RoutingTraceError: ``layer_axis="all"`` without ``num_hidden_layers``.
        ModelpatchValueError: ``layer_axis`` not ``"all"`` or ``"moe"``.
    """
    layers = sorted(routes)
    if layer_axis == "all":
        if num_hidden_layers is None:
            raise RoutingTraceError("layer_axis='all' needs trace.num_hidden_layers (build the trace from a model)")
        cols = list(layers)
        n_axis = num_hidden_layers
    elif layer_axis == "moe":
        cols = list(range(len(layers)))
        n_axis = len(layers)
    else:
        raise ModelpatchValueError(f"layer_axis must be 'all' or 'moe', received {layer_axis!r}")
    out = []
    for i in sequences:
        arr = torch.full((routes[layers[0]][i].shape[0], n_axis, top_k), dense_fill, dtype=torch.int64)
        for col, layer in zip(cols, layers):
            arr[:, col, :] = routes[layer][i]
        out.append(arr.to(dtype))
    return out
