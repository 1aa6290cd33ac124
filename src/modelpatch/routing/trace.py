"""`RoutingTrace`: the experts each token was routed to, per MoE layer and per sequence.

Also the module-level :func:`from_routed_experts` / :func:`to_routed_experts` (the trace's conversions from and
to inference-engine arrays, whose array handling lives in :mod:`modelpatch.routing.engine_arrays`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch import nn

from ..errors import ModelpatchKeyError
from .engine_arrays import engine_arrays_from_routes, routes_from_engine_arrays
from .errors import RoutingTraceError

__all__ = ["RoutingTrace", "RoutingTraceError", "compact_dtype", "from_routed_experts", "to_routed_experts"]

_FORMAT = "modelpatch.routing_trace/1"


def compact_dtype(num_experts: int) -> torch.dtype:
    """Storage dtype for expert ids: ``uint8`` up to 256 experts, ``uint16`` up to 65536, else ``int32``."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 65536:
        return torch.uint16
    return torch.int32


def _check_rows(idx: torch.Tensor, layer: int, seq: int, num_experts: int, top_k: int) -> torch.Tensor:
    """Validate one ``(tokens, top_k)`` block of expert ids (``-1`` rows = no route) and return it as int64."""
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise RoutingTraceError(f"layer {layer}, sequence {seq}: expert ids must be integers, received {idx.dtype}")
    if idx.dim() != 2 or idx.shape[1] != top_k:
        raise RoutingTraceError(
            f"layer {layer}, sequence {seq}: expected shape (num_tokens, {top_k}), received {tuple(idx.shape)}"
        )
    idx = idx.to(torch.int64)
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            raise RoutingTraceError(
                f"layer {layer}, sequence {seq}: expected expert ids in [0, {num_experts}) or -1 (no route), "
                f"received values in [{lo}, {hi}]"
            )
        free = idx < 0
        mixed = free.any(dim=1) & ~free.all(dim=1)
        if bool(mixed.any()):
            row = int(mixed.nonzero()[0, 0])
            raise RoutingTraceError(
                f"layer {layer}, sequence {seq}, token {row}: a row is either all -1 (no route) or all expert "
                f"ids, received {idx[row].tolist()}"
            )
        if top_k > 1:
            s = idx.sort(dim=1).values
            dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(dim=1)
            if bool(dup.any()):
                row = int(dup.nonzero()[0, 0])
                raise RoutingTraceError(
                    f"layer {layer}, sequence {seq}, token {row}: expert ids must be distinct, received "
                    f"{idx[row].tolist()}"
                )
    return idx


class _Block:
    """Compact storage of one ``(tokens, top_k)`` block: ids in :func:`compact_dtype`, plus a row mask of
    free (``-1``) rows kept only when some row is free."""

    __slots__ = ("ids", "free")

    def __init__(self, ids: torch.Tensor, free: torch.Tensor | None):
        self.ids, self.free = ids, free

    @classmethod
    def encode(cls, idx: torch.Tensor, dtype: torch.dtype) -> _Block:
        free = idx[:, 0] < 0 if idx.numel() else None
        if free is not None and not bool(free.any()):
            free = None
        ids = idx.clamp(min=0).to(dtype) if free is not None else idx.to(dtype)
        return cls(ids, free)

    def decode(self) -> torch.Tensor:
        out = self.ids.to(torch.int64)
        if self.free is not None:
            out[self.free] = -1
        return out

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size() + (self.free.numel() if self.free is not None else 0)


class RoutingTrace:
    """Expert indices each token was routed to, per MoE layer and per sequence.

    ``trace[layer_idx]`` is a list with one ``torch.LongTensor`` of shape ``(num_tokens, top_k)`` per sequence,
    ``layer_idx`` being the index of the decoder layer holding the router (dense layers have no entry).
    A row of ``-1`` means "no route": replay lets the live router choose for that token (padding, the last
    sampled token an engine never routed...). All layers hold the same number of sequences and, per sequence,
    the same number of tokens.

    Storage is compact: ids are kept as ``uint8`` when ``num_experts <= 256`` (``uint16`` up to 65536), plus
    a one-byte-per-token mask only for blocks containing ``-1`` rows, so a 32k-token, 60-layer, top-8 trace
    takes about 15 MiB (:attr:`nbytes`). Reading returns ``int64``.

    Built by :func:`modelpatch.routing.record_routing`, from an inference engine's array with
    :meth:`from_routed_experts` (vLLM ``CompletionOutput.routed_experts``), by :meth:`load`, or directly::

        RoutingTrace({1: [torch.tensor([[0, 3], [2, 1]])]}, num_experts=8, top_k=2)

    Args:
        routes: ``{layer_idx: [LongTensor (num_tokens, top_k) per sequence]}`` (any integer dtype).
        num_experts: experts per layer, an ``int`` for all layers or ``{layer_idx: int}``.
        top_k: experts per token, an ``int`` or ``{layer_idx: int}``; defaults to the tensors' last dimension.
        num_hidden_layers: total decoder layers of the model (dense ones included); needed by
            :meth:`to_routed_experts` with ``layer_axis="all"``.

    Raises:
        RoutingTraceError: a block with the wrong shape, an id outside ``[0, num_experts)`` other than ``-1``,
            a row mixing ``-1`` and ids, repeated ids in a row, or layers disagreeing on sequence lengths.
            The message names the layer and sequence, the expected and the received shape or range.
    """

    def __init__(
        self,
        routes: Mapping[int, Sequence[torch.Tensor]] | None = None,
        *,
        num_experts: int | Mapping[int, int],
        top_k: int | Mapping[int, int] | None = None,
        num_hidden_layers: int | None = None,
    ):
        routes = dict(routes or {})
        layers = sorted(int(k) for k in routes)
        if isinstance(num_experts, Mapping):
            self.num_experts = {int(k): int(v) for k, v in num_experts.items()}
            layers = sorted(set(layers) | set(self.num_experts))
        else:
            self.num_experts = {layer: int(num_experts) for layer in layers}
        if top_k is None:
            top_k = {int(k): (int(v[0].shape[-1]) if len(v) else 0) for k, v in routes.items()}
        if isinstance(top_k, Mapping):
            self.top_k = {int(k): int(v) for k, v in top_k.items()}
        else:
            self.top_k = {layer: int(top_k) for layer in layers}
        for layer in layers:
            if layer not in self.num_experts or layer not in self.top_k:
                raise RoutingTraceError(f"layer {layer}: num_experts and top_k must both be given")
        self.num_hidden_layers = num_hidden_layers
        self._blocks: dict[int, list[list[_Block]]] = {layer: [] for layer in layers}
        self._decoded: dict[Any, Any] = {}  # layer -> decoded rows; ("max", layer) -> largest id
        for layer in layers:
            for seq, idx in enumerate(routes.get(layer, [])):
                self.append(layer, seq, torch.as_tensor(idx))
        self.check_lengths()

    # -- building -------------------------------------------------------------------------------------------
    def append(self, layer_idx: int, sequence: int, ids: torch.Tensor, *, check: bool = True) -> None:
        """Append the routes of ``ids.shape[0]`` more tokens to sequence ``sequence`` of layer ``layer_idx``.

        The layer grows to ``sequence + 1`` sequences if it has fewer (the new ones empty). Layers may disagree
        on lengths while a trace is being built: call :meth:`check_lengths` when done.

        Args:
            layer_idx: an MoE layer of the trace (one of :attr:`layers`).
            sequence: index of the sequence the tokens continue.
            ids: ``(num_tokens, top_k)`` expert ids of the tokens, in token order.
            check: ``True`` validates ``ids`` as the constructor does (any integer dtype, ``-1`` rows allowed).
                ``False`` is the recorder's path: ``ids`` is trusted to be an integer tensor of shape
                ``(num_tokens, top_k)`` with every id in ``[0, num_experts)`` (no ``-1`` rows); it is kept as
                given, on its device, converted to :meth:`storage_dtype` (no copy when it already has it, no
                device synchronisation).

        Raises:
            ModelpatchKeyError: ``layer_idx`` is not an MoE layer of the trace.
            RoutingTraceError: with ``check=True``, as the constructor (shape, dtype, range, mixed or repeated ids).
        """
        if layer_idx not in self._blocks:
            raise ModelpatchKeyError(
                f"layer {layer_idx} is not an MoE layer of this trace (layers: {list(self.layers)})"
            )
        dtype = self.storage_dtype(layer_idx)
        if check:
            ids = _check_rows(ids, layer_idx, sequence, self.num_experts[layer_idx], self.top_k[layer_idx])
            block = _Block.encode(ids, dtype)
        else:
            block = _Block(ids.to(dtype), None)
        self._decoded.clear()
        seqs = self._blocks[layer_idx]
        while len(seqs) <= sequence:
            seqs.append([])
        seqs[sequence].append(block)

    def check_lengths(self) -> None:
        """Check that every layer holds the same number of sequences and, per sequence, the same number of tokens.

        Raises:
            RoutingTraceError: naming the first layer that disagrees with the first layer, and both lengths.
        """
        ref = None
        for layer in self._blocks:
            lengths = self._lengths(layer)
            if ref is None:
                ref = (layer, lengths)
            elif lengths != ref[1]:
                raise RoutingTraceError(
                    f"layer {layer}: expected {len(ref[1])} sequences with token counts {ref[1]} (as layer "
                    f"{ref[0]}), received {len(lengths)} sequences with token counts {lengths}"
                )

    def _lengths(self, layer: int) -> list[int]:
        return [sum(b.rows for b in blocks) for blocks in self._blocks[layer]]

    def _consolidate(self) -> None:
        for layer, seqs in self._blocks.items():
            for i, blocks in enumerate(seqs):
                if len(blocks) > 1 or (blocks and blocks[0].ids.device.type != "cpu"):
                    if not blocks:
                        continue
                    idx = torch.cat([b.decode().cpu() for b in blocks])
                    seqs[i] = [_Block.encode(idx, blocks[0].ids.dtype)]
                    self._decoded.pop(layer, None)

    # -- reading --------------------------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        """Decoder-layer indices of the MoE layers, ascending."""
        return tuple(sorted(self._blocks))

    @property
    def num_sequences(self) -> int:
        return max((len(s) for s in self._blocks.values()), default=0)

    @property
    def sequence_lengths(self) -> list[int]:
        """Number of tokens (rows) of each sequence."""
        return self._lengths(self.layers[0]) if self._blocks else []

    def __getitem__(self, layer_idx: int) -> list[torch.Tensor]:
        """``[LongTensor (num_tokens, top_k) per sequence]`` of decoder layer ``layer_idx`` (copies)."""
        return self.layer_routes(layer_idx)

    def layer_routes(self, layer_idx: int, *, copy: bool = True) -> list[torch.Tensor]:
        """The routes of one MoE layer: one int64 tensor ``(num_tokens, top_k)`` per sequence, on the CPU.

        Args:
            layer_idx: an MoE layer of the trace (one of :attr:`layers`).
            copy: ``False`` returns the trace's decoded cache itself, without copying (what replay reads at
                every router call): the tensors must not be modified, and are replaced when the trace changes.

        Raises:
            ModelpatchKeyError: ``layer_idx`` is not an MoE layer of the trace.
        """
        if layer_idx not in self._blocks:
            raise ModelpatchKeyError(
                f"layer {layer_idx} is not an MoE layer of this trace (layers: {list(self.layers)})"
            )
        rows = self._decoded.get(layer_idx)
        if rows is None or len(rows) != len(self._blocks[layer_idx]):
            self._consolidate()
            empty = torch.empty(0, self.top_k[layer_idx], dtype=torch.int64)
            decoded = [(blocks[0].decode() if blocks else empty) for blocks in self._blocks[layer_idx]]
            # one tensor per layer, the sequences its consecutive row ranges (views): replay hands a batch of
            # consecutive whole sequences to a compiled graph as one slice (see flat_routes)
            flat = torch.cat(decoded) if decoded else empty
            rows = self._decoded[layer_idx] = list(flat.split([t.shape[0] for t in decoded]))
            self._decoded[("flat", layer_idx)] = (rows, flat)
        return [t.clone() for t in rows] if copy else list(rows)

    def flat_routes(self, layer_idx: int) -> torch.Tensor:
        """The routes of every sequence of layer ``layer_idx``, concatenated in sequence order ``(tokens, top_k)``
        int64 on the CPU: the storage :meth:`layer_routes` ``copy=False`` returns views of (must not be modified).

        Raises:
            ModelpatchKeyError: ``layer_idx`` is not an MoE layer of the trace.
        """
        self.layer_routes(layer_idx, copy=False)  # (re)decodes the layer and its flat tensor together if needed
        flat: torch.Tensor = self._decoded[("flat", layer_idx)][1]
        return flat

    def max_expert_id(self, layer_idx: int) -> int:
        """The largest expert id of layer ``layer_idx`` over all sequences (``-1`` if no token has a route).

        Raises:
            ModelpatchKeyError: ``layer_idx`` is not an MoE layer of the trace.
        """
        key = ("max", layer_idx)
        if key not in self._decoded:
            rows = self.layer_routes(layer_idx, copy=False)
            self._decoded[key] = max((int(t.max()) for t in rows if t.numel()), default=-1)
        largest: int = self._decoded[key]  # the cache holds an int under ("max", layer)
        return largest

    def has_free_rows(self, layer_idx: int) -> bool:
        """Whether any token of layer ``layer_idx`` has the "no route" row (``-1``); read from the stored blocks,
        without a pass over the ids.

        Raises:
            ModelpatchKeyError: ``layer_idx`` is not an MoE layer of the trace.
        """
        if layer_idx not in self._blocks:
            raise ModelpatchKeyError(
                f"layer {layer_idx} is not an MoE layer of this trace (layers: {list(self.layers)})"
            )
        return any(b.free is not None for blocks in self._blocks[layer_idx] for b in blocks)

    def __contains__(self, layer_idx: object) -> bool:
        return layer_idx in self._blocks

    def __iter__(self) -> Iterator[int]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> tuple[int, ...]:
        return self.layers

    def items(self) -> list[tuple[int, list[torch.Tensor]]]:
        return [(layer, self[layer]) for layer in self.layers]

    def sequence(self, seq: int) -> dict[int, torch.Tensor]:
        """``{layer_idx: LongTensor (num_tokens, top_k)}`` of one sequence."""
        return {layer: self[layer][seq] for layer in self.layers}

    @property
    def nbytes(self) -> int:
        """Bytes held by the compact storage."""
        self._consolidate()
        return sum(b.nbytes for seqs in self._blocks.values() for blocks in seqs for b in blocks)

    def storage_dtype(self, layer_idx: int) -> torch.dtype:
        """Dtype the ids of layer ``layer_idx`` are stored in (:func:`compact_dtype` of its number of experts)."""
        return compact_dtype(self.num_experts[layer_idx])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        if (self.layers, self.num_experts, self.top_k) != (other.layers, other.num_experts, other.top_k):
            return False
        return all(
            len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
            for a, b in ((self[layer], other[layer]) for layer in self.layers)
        )

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(layers={list(self.layers)}, sequences={self.num_sequences}, "
            f"tokens={self.sequence_lengths}, top_k={sorted(set(self.top_k.values()))}, "
            f"num_experts={sorted(set(self.num_experts.values()))})"
        )

    def select(self, sequences: Sequence[int]) -> RoutingTrace:
        """A trace holding only the given sequences, in the given order (e.g. one data-parallel rank's share)."""
        routes = {layer: [self[layer][i] for i in sequences] for layer in self.layers}
        return RoutingTrace(
            routes, num_experts=self.num_experts, top_k=self.top_k, num_hidden_layers=self.num_hidden_layers
        )

    # -- multi-turn -----------------------------------------------------------------------------------------
    def extend(self, next_turn: RoutingTrace, *, next_turn_offset: int | Sequence[int] = 0) -> RoutingTrace:
        """Stitch the next turn of a multi-turn conversation onto this one.

        ``next_turn`` sequence *i* continues this trace's sequence *i*; its row 0 is the conversation's token
        ``next_turn_offset`` (0 when the engine returned routes for the whole prompt, which then repeats this
        turn; ``len`` of this turn's sequence when it holds only the new tokens). Where both turns route a
        token, this (earlier) turn's route wins, since it is the one the tokens were generated with; its ``-1``
        rows (e.g. the last sampled token, which an engine never routes) are filled from ``next_turn``.

        Returns:
            a new trace whose sequence *i* covers ``max(len_i, offset_i + next_len_i)`` tokens.

        Raises:
            RoutingTraceError: different layers, sequence count, or a gap between the two turns.
        """
        if next_turn.layers != self.layers or next_turn.num_sequences != self.num_sequences:
            raise RoutingTraceError(
                f"next turn: expected layers {list(self.layers)} with {self.num_sequences} sequences, received "
                f"layers {list(next_turn.layers)} with {next_turn.num_sequences} sequences"
            )
        offsets = (
            [int(next_turn_offset)] * self.num_sequences
            if isinstance(next_turn_offset, int)
            else [int(o) for o in next_turn_offset]
        )
        routes = {}
        for layer in self.layers:
            out = []
            for seq, (a, b) in enumerate(zip(self[layer], next_turn[layer])):
                off = offsets[seq]
                if off > a.shape[0]:
                    raise RoutingTraceError(
                        f"layer {layer}, sequence {seq}: next turn starts at token {off}, expected at most "
                        f"{a.shape[0]} (no gap between turns)"
                    )
                n = max(a.shape[0], off + b.shape[0])
                merged = torch.full((n, a.shape[1]), -1, dtype=torch.int64)
                merged[off : off + b.shape[0]] = b
                keep = a[:, 0] >= 0
                merged[: a.shape[0]][keep] = a[keep]
                out.append(merged)
            routes[layer] = out
        return RoutingTrace(
            routes, num_experts=self.num_experts, top_k=self.top_k, num_hidden_layers=self.num_hidden_layers
        )

    # -- engine arrays ----------------------------------------------------------------------------------------
    @classmethod
    def from_routed_experts(
        cls,
        routed_experts: Any,
        model: nn.Module,
        *,
        attention_mask: Any = None,
        seq_lens: Sequence[int] | None = None,
        layer_axis: str = "auto",
        validate: bool = True,
    ) -> RoutingTrace:
        """Build a trace from inference-engine arrays.

        Args:
            routed_experts: the engine's routes, any integer dtype (uint8, uint16, int16, int32, int64; ids
                >= 256 survive), NumPy arrays, tensors or nested Python lists; ``-1`` means "no route":

                - one array ``(seq_len, num_layers, top_k)``: one sequence;
                - a padded batch ``(batch, seq_len, num_layers, top_k)``: one sequence per row, with
                  ``attention_mask`` to drop the padding (left or right);
                - a list of arrays ``(seq_len_i, num_layers, top_k)`` (lengths may differ): one sequence each;
                - a nested Python list of ints reads as the array it spells: three deep (``arr.tolist()`` of
                  one sequence, e.g. ``[[[1, 2]], [[0, 3]]]``: 2 tokens, 1 layer, top-2) is ONE sequence,
                  four deep a batch (or, if its entries differ in length, one sequence per entry).
            model: the model the trace will be replayed on; its MoE layers, number of experts and top-k are
                read from its routers.
            attention_mask: ``(batch, seq_len)`` with 1 on real tokens, for a padded batch only.
            seq_lens: total tokens per sequence as fed to the training forward. An array may hold ``seq_len`` or
                ``seq_len - 1`` rows (engines never route the last sampled token); a missing last row becomes
                ``-1`` (routed naturally on replay).
            layer_axis: ``"all"`` (one slice per hidden layer; dense layers' slices are ignored, so vLLM's zeros
                there are never read as expert 0), ``"moe"`` (one slice per MoE layer, in layer order) or
                ``"auto"`` (detected from the axis length, which must then match one of the two).
            validate: check the engine's rows (see below); ``False`` makes failing rows ``-1`` (no route: the live
                router chooses on replay) instead of raising.

        Returns:
            :class:`RoutingTrace` with ``num_hidden_layers`` set from the model; int64 routes
            ``(num_tokens, top_k)`` per MoE layer and sequence.

        Raises:
            RoutingTraceError: a rank other than those above (the message names the shape received and the
                forms accepted), a ragged nested list, ``attention_mask`` with a list of per-sequence arrays or
                of the wrong shape, a layer axis matching neither the model's hidden layers nor its MoE layers,
                a top-k axis different from the routers', or a row count other than ``seq_len`` /
                ``seq_len - 1``; and (``validate=True``) a row with an id ``>= num_experts`` or ``< -1``, ids
                repeated within a row (a zero-filled row with ``top_k >= 2``: vLLM and other engines have
                returned all-zero routes), leading prompt rows that are zero in every MoE layer, or, with
                ``layer_axis="auto"``, dense-layer slices holding routes (the layer axis is ambiguous). Messages
                name the layer, sequence and row, and the values received.
            ModelpatchValueError: ``layer_axis`` not ``"auto"``, ``"all"`` or ``"moe"``.
            RoutingDiscoveryError: ``model`` has no top-k router.
        """
        read = routes_from_engine_arrays(
            routed_experts,
            model,
            attention_mask=attention_mask,
            seq_lens=seq_lens,
            layer_axis=layer_axis,
            validate=validate,
        )
        return cls(
            read.routes, num_experts=read.num_experts, top_k=read.top_k, num_hidden_layers=read.num_hidden_layers
        )

    @overload
    def to_routed_experts(
        self, sequence: int, *, layer_axis: str = ..., dense_fill: int = ..., dtype: torch.dtype = ...
    ) -> torch.Tensor: ...

    @overload
    def to_routed_experts(
        self, sequence: None = None, *, layer_axis: str = ..., dense_fill: int = ..., dtype: torch.dtype = ...
    ) -> list[torch.Tensor]: ...

    def to_routed_experts(
        self,
        sequence: int | None = None,
        *,
        layer_axis: str = "all",
        dense_fill: int = -1,
        dtype: torch.dtype = torch.int32,
    ) -> torch.Tensor | list[torch.Tensor]:
        """The trace in an inference engine's layout.

        Args:
            sequence: which sequence; ``None`` returns a list with every sequence.
            layer_axis: ``"all"`` (``num_hidden_layers`` slices, dense layers filled with ``dense_fill``; needs
                :attr:`num_hidden_layers`) or ``"moe"`` (MoE layers only, in layer order).
            dense_fill: value written in the slices of dense layers (vLLM writes 0; -1 keeps them unambiguous).
            dtype: integer dtype of the result (``torch.int32`` like vLLM's ``np.int32``).

        Returns:
            a tensor ``(seq_len, num_layers, top_k)`` of ``dtype`` (``-1`` for tokens without a route), or a list
            of them.

        Raises:
            RoutingTraceError: ``layer_axis="all"`` without ``num_hidden_layers``, or layers with different top-k.
            ModelpatchValueError: ``layer_axis`` not ``"all"`` or ``"moe"``.
        """
        ks = {self.top_k[layer] for layer in self.layers}
        if len(ks) != 1:
            raise RoutingTraceError(f"engine arrays need one top_k for all layers, trace has {sorted(ks)}")
        out = engine_arrays_from_routes(
            {layer: self.layer_routes(layer, copy=False) for layer in self.layers},
            range(self.num_sequences) if sequence is None else [sequence],
            top_k=ks.pop(),
            num_hidden_layers=self.num_hidden_layers,
            layer_axis=layer_axis,
            dense_fill=dense_fill,
            dtype=dtype,
        )
        return out[0] if sequence is not None else out

    # -- files ----------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to a safetensors file (compact dtypes kept; metadata in the header).

        Tensors are named ``layers.{layer}.seq.{i}`` (ids) and ``layers.{layer}.seq.{i}.free`` (uint8 mask of
        ``-1`` rows, only where present).
        """
        from safetensors.torch import save_file

        self._consolidate()
        tensors = {}
        for layer, seqs in self._blocks.items():
            for i, blocks in enumerate(seqs):
                block = (
                    blocks[0]
                    if blocks
                    else _Block.encode(torch.empty(0, self.top_k[layer], dtype=torch.int64), self.storage_dtype(layer))
                )
                tensors[f"layers.{layer}.seq.{i}"] = block.ids.contiguous()
                if block.free is not None:
                    tensors[f"layers.{layer}.seq.{i}.free"] = block.free.to(torch.uint8).contiguous()
        meta = {
            "format": _FORMAT,
            "num_experts": json.dumps({str(k): v for k, v in self.num_experts.items()}),
            "top_k": json.dumps({str(k): v for k, v in self.top_k.items()}),
            "num_hidden_layers": json.dumps(self.num_hidden_layers),
            "num_sequences": str(self.num_sequences),
        }
        save_file(tensors, os.fspath(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTrace:
        """Read a trace written by :meth:`save`.

        Raises:
            RoutingTraceError: the file is not a modelpatch routing trace.
        """
        from safetensors import safe_open

        try:
            with safe_open(os.fspath(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != _FORMAT:
                    raise RoutingTraceError(f"{path}: expected format {_FORMAT!r}, received {meta.get('format')!r}")
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except RoutingTraceError:
            raise
        except Exception as exc:  # safetensors' own errors (truncated or not a safetensors file), OSError
            raise RoutingTraceError(f"{path}: cannot read a routing trace: {exc}") from exc
        num_experts = {int(k): v for k, v in json.loads(meta["num_experts"]).items()}
        top_k = {int(k): v for k, v in json.loads(meta["top_k"]).items()}
        trace = cls({}, num_experts=num_experts, top_k=top_k, num_hidden_layers=json.loads(meta["num_hidden_layers"]))
        n = int(meta["num_sequences"])
        for layer in trace._blocks:
            for i in range(n):
                ids = tensors[f"layers.{layer}.seq.{i}"]
                free = tensors.get(f"layers.{layer}.seq.{i}.free")
                trace._blocks[layer].append([_Block(ids, free.bool() if free is not None else None)])
        trace.check_lengths()
        return trace


def from_routed_experts(routed_experts: Any, model: nn.Module, **kwargs: Any) -> RoutingTrace:
    """:meth:`RoutingTrace.from_routed_experts` as a function (same arguments, result and errors)."""
    return RoutingTrace.from_routed_experts(routed_experts, model, **kwargs)


@overload
def to_routed_experts(trace: RoutingTrace, sequence: int, **kwargs: Any) -> torch.Tensor: ...


@overload
def to_routed_experts(trace: RoutingTrace, sequence: None = None, **kwargs: Any) -> list[torch.Tensor]: ...


def to_routed_experts(
    trace: RoutingTrace, sequence: int | None = None, **kwargs: Any
) -> torch.Tensor | list[torch.Tensor]:
    """:meth:`RoutingTrace.to_routed_experts` of ``trace`` as a function (same arguments, result and errors)."""
    return trace.to_routed_experts(sequence, **kwargs)
