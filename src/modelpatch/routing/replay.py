""":func:`replay_routing`: :class:`ReplaySession` forces the experts of a given :class:`~.trace.RoutingTrace`, in order,
and checks that all of them were consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import RoutingReplayError, RoutingTraceError
from .kinds import merge_forced
from .layout import ForwardLayout, Slot
from .measures import RoutingDriftMeter
from .recompute import (
    RecomputeFrame,
    ignore_indices,
    unbound_checkpoint_on_stack,
)
from .sites import RouterSite
from .trace import RoutingTrace

if TYPE_CHECKING:
    pass
from .driver import CHECKPOINT_HINT, SessionDriver, in_backward, module_device

__all__ = ["ReplaySession", "RoutingReplayError", "replay_routing"]


class ReplaySession(SessionDriver):
    """Forces the expert indices of ``trace``, sequence after sequence, while the live routers compute weights.

    Raises:
        RoutingTraceError: (on construction) the trace's layers, top-k or id range do not fit the model.
    """

    def __init__(self, model: nn.Module, trace: RoutingTrace, drift: RoutingDriftMeter | None = None) -> None:
        super().__init__(model)
        self.trace = trace
        self.drift = drift
        model_layers = tuple(s.layer_idx for s in self.sites)
        if trace.layers != model_layers:
            raise RoutingTraceError(
                f"trace MoE layers {list(trace.layers)} do not match the model's MoE layers {list(model_layers)}"
            )
        self.lengths = trace.sequence_lengths
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.flat: dict[int, torch.Tensor] = {}  # CPU layers: every sequence's rows, concatenated in order
        for s in self.sites:
            layer = s.layer_idx
            if trace.top_k[layer] != s.top_k:
                raise RoutingTraceError(f"layer {layer}: expected top_k {s.top_k}, trace has {trace.top_k[layer]}")
            seqs = trace.layer_routes(layer, copy=False)
            hi = trace.max_expert_id(layer)
            if hi >= s.num_experts:
                raise RoutingTraceError(
                    f"layer {layer}: expected expert ids in [0, {s.num_experts}) or -1, received max id {hi}"
                )
            device = module_device(s.module)
            # the trace's rows are CPU tensors (never modified): moved once per block for a router elsewhere
            if device.type in ("cpu", "meta"):
                self.rows[layer] = seqs
                if [t.shape[0] for t in seqs] == self.lengths:  # (a trace still being built may disagree)
                    self.flat[layer] = trace.flat_routes(layer)  # the rows are consecutive ranges of it
            else:
                self.rows[layer] = [t.to(device) for t in seqs]
        self.free_rows = {layer: trace.has_free_rows(layer) for layer in model_layers}  # "no route" rows
        self.cursor = [0] * len(self.lengths)
        self.closed = [False] * len(self.lengths)
        self.next_seq = 0
        self.forwards = 0  # forwards of the owner in the block
        self.routed: dict[int, int] = {s.layer_idx: 0 for s in self.sites}  # router calls per layer given routes
        self._plan: list[tuple[int, int, int]] | None = None  # see _assign
        self._span: tuple[int, int] | None = None  # see _assign
        self._offsets = [0]  # first row of each sequence in the flat tensors
        for n in self.lengths:
            self._offsets.append(self._offsets[-1] + n)

    def _assign(self, layout: ForwardLayout) -> None:
        self.forwards += 1
        if layout.continuation and self._last_seqs:
            if len(self._last_seqs) != len(layout.slots):
                raise RoutingReplayError(
                    f"continuation forward has {len(layout.slots)} sequences, the previous forward had "
                    f"{len(self._last_seqs)}"
                )
            seqs = self._last_seqs
        else:
            left = len(self.lengths) - self.next_seq
            if len(layout.slots) > left:
                raise RoutingReplayError(
                    f"forward holds {len(layout.slots)} sequences but the trace has only {left} left "
                    f"({len(self.lengths)} in all)"
                )
            seqs = list(range(self.next_seq, self.next_seq + len(layout.slots)))
            self.next_seq += len(layout.slots)
        for slot, seq in zip(layout.slots, seqs):
            start = self.cursor[seq]
            avail = self.lengths[seq] - start
            if self.closed[seq] or slot.n > avail + 1:
                raise RoutingReplayError(
                    f"missing routes: sequence {seq} needs tokens [{start}, {start + slot.n}) but the trace holds "
                    f"{self.lengths[seq]} tokens for it"
                )
            slot.seq, slot.start, slot.pad_end = seq, start, max(0, slot.n - avail)
            if slot.pad_end:
                self.closed[seq] = True  # engine convention: the last token was never routed
            self.cursor[seq] = start + slot.n - slot.pad_end
        self._last_seqs = seqs
        # the common compiled case, decided once per forward rather than at every router call: consecutive slices
        # of the token grid, each wholly routed by the trace -> ``(sequence, first row, end row)`` to concatenate
        plan = self._plan = (
            [(slot.seq, slot.start, slot.start + slot.n) for slot in layout.slots]
            if _contiguous(layout.slots, layout.num_tokens)
            else None
        )
        # ... and when those are consecutive sequences, each whole but the first's start and the last's end: one
        # range of the layers' flat tensors (the same for every layer)
        self._span = None
        if plan is not None:
            lengths = self.lengths
            first, last = plan[0], plan[-1]
            if all(b[0] == a[0] + 1 and a[2] == lengths[a[0]] and b[1] == 0 for a, b in zip(plan, plan[1:])):
                offset = self._offsets[first[0]]
                self._span = (offset + first[1], self._offsets[last[0]] + last[2])

    def _forced(self, site: RouterSite, num_tokens: int) -> torch.Tensor:
        return self._forced_rows(site, num_tokens)[0]

    def _forced_rows(self, site: RouterSite, num_tokens: int) -> tuple[torch.Tensor, bool]:
        """``(forced, new)``: the ``(num_tokens, top_k)`` indices the trace gives this router call (``-1`` rows:
        padding, a trace's "no route", a sequence's unrouted last token), and whether ``forced`` is a new tensor
        holding only the trace's rows (``False``: a view of the trace's storage, or a tensor with padding rows)."""
        layout = self.layout
        if layout is None:
            raise RoutingReplayError(
                f"layer {site.layer_idx}: router called outside a forward of {type(self.owner).__name__}; "
                "replay needs the forward to go through the module owning the decoder layers"
            )
        self.routed[site.layer_idx] = self.routed.get(site.layer_idx, 0) + 1
        if layout.num_tokens != num_tokens:
            raise RoutingReplayError(
                f"layer {site.layer_idx}: expected {layout.num_tokens} tokens at the router, received {num_tokens}"
            )
        rows = self.rows[site.layer_idx]
        slots = layout.slots
        if len(slots) == 1 and isinstance(slots[0].rows, slice) and not slots[0].pad_end:
            slot = slots[0]
            if slot.n == num_tokens:
                return rows[slot.seq][slot.start : slot.start + slot.n], False
        if _contiguous(slots, num_tokens):  # a batch without padding: one concatenation, no -1 fill
            return torch.cat([rows[slot.seq][slot.start : slot.start + slot.n] for slot in slots]), True
        dense = torch.full((num_tokens, site.top_k), -1, dtype=torch.int64, device=rows[0].device if rows else None)
        for slot in slots:
            got = rows[slot.seq][slot.start : slot.start + slot.n - slot.pad_end]
            if slot.pad_end:
                got = torch.cat([got, got.new_full((slot.pad_end, site.top_k), -1)])
            dense[slot.rows] = got
        return dense, False

    def _route(
        self,
        site: RouterSite,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        originals: list[RecomputeFrame],
    ) -> object:
        if unbound_checkpoint_on_stack():
            raise RoutingReplayError(
                f"layer {site.layer_idx}: the router runs inside a torch.utils.checkpoint call that replay_routing "
                "is not bound to; its recomputation in backward would not use the replayed indices; " + CHECKPOINT_HINT
            )
        hidden = args[0] if args else next(iter(kwargs.values()))
        forced = self._forced(site, hidden.numel() // hidden.shape[-1])
        for frame in originals:  # bound checkpoints keep the indices for their recomputation
            frame.add(site, forced)
        measure = None
        if self.drift is not None:
            drift = self.drift

            def measure(natural: torch.Tensor) -> None:
                drift.add(site.layer_idx, natural, forced)

        return site.kind.call(site, forward, args, kwargs, forced, ignore_indices, measure)

    def compiled_route(self, site: RouterSite, natural: torch.Tensor) -> torch.Tensor:
        layer = site.layer_idx
        plan = self._plan
        layout = self.layout
        if (
            plan is not None
            and layout is not None
            and self.drift is None
            and not self.free_rows[layer]
            and natural.shape[0] == layout.num_tokens
        ):
            # fast path, once per router call of a compiled forward: every row is a route of the trace (no -1 to
            # merge with the natural choice), one new tensor (never the trace's storage: the graph owns it)
            self.routed[layer] += 1
            span = self._span
            flat = self.flat.get(layer)
            if span is not None and flat is not None:
                forced = flat[span[0] : span[1]].clone()
                if forced.device == natural.device:
                    return forced
                return forced.to(natural.device)
            rows = self.rows[layer]
            if len(plan) == 1:
                seq, start, end = plan[0]
                forced = rows[seq][start:end].clone()
            else:
                forced = torch.cat([rows[seq][start:end] for seq, start, end in plan])
            if forced.device == natural.device:
                return forced
            return forced.to(natural.device)
        forced, new = self._forced_rows(site, natural.shape[0])
        if self.drift is not None:
            self.drift.add(site.layer_idx, natural, forced)
        if new and not self.free_rows[site.layer_idx] and forced.device == natural.device:
            return forced  # every row a route of the trace: nothing to merge, and no storage of the trace
        return merge_forced(natural, forced)

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self.drift is not None and not in_backward():
            self.drift.end_forward()
        return super()._post_forward(module, args, kwargs, output)

    def compiled_end(self) -> None:
        if self.drift is not None:
            self.drift.end_forward()
        super().compiled_end()

    def _route_unbound_recompute(
        self,
        site: RouterSite,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        originals: list[RecomputeFrame],
    ) -> object:
        raise RoutingReplayError(
            f"layer {site.layer_idx}: the router is recomputed during backward by an activation checkpoint "
            "replay_routing is not bound to, so the recomputation cannot be given the indices of its "
            "original forward; " + CHECKPOINT_HINT
        )

    def check_complete(self) -> None:
        """Raises :class:`RoutingReplayError` naming every sequence whose routes were not all consumed, and every MoE
        layer whose router was not given its routes in every forward (a layer skipped, or a router that ran its
        natural routing: replaced or added inside the block, outside what replay drives)."""
        short = [
            f"layer {layer}: {n} of {self.forwards}" for layer, n in sorted(self.routed.items()) if n < self.forwards
        ]
        if short:
            raise RoutingReplayError(
                "replay: some MoE layers did not take their routes in every forward of the block (skipped, or their "
                "router ran its natural routing): " + "; ".join(short)
            )
        leftover = [
            f"sequence {i}: {self.cursor[i]} of {n} tokens replayed"
            for i, n in enumerate(self.lengths)
            if self.cursor[i] < n
        ]
        if leftover:
            raise RoutingReplayError("leftover routes at the end of the replay block: " + "; ".join(leftover))


def _contiguous(slots: list[Slot], num_tokens: int) -> bool:
    """Whether the slots' rows are consecutive slices covering ``[0, num_tokens)`` with no unrouted last token."""
    end = 0
    for slot in slots:
        rows = slot.rows
        if not isinstance(rows, slice) or slot.pad_end or rows.start != end or rows.step not in (None, 1):
            return False
        end = rows.stop
    return end == num_tokens


@contextmanager
def replay_routing(
    model: nn.Module, trace: RoutingTrace, *, drift: RoutingDriftMeter | None = None
) -> Iterator[RoutingTrace]:
    """Force the expert indices of ``trace`` while the routing weights are recomputed by the live routers.

    The Megatron-LM router replay / R3 contract (arXiv 2510.11370): indices fixed, weights gathered from the
    full score distribution of the live router and normalised exactly as that family's router normalises them
    (see :mod:`modelpatch.routing.kinds`), so gradients reach the router weights. Router logits keep their
    original meaning (raw logits), so auxiliary losses are unchanged.

    Forwards consume the trace's sequences in order: a forward without past key values takes the next sequences
    (one per batch row, or per packed segment of a single row whose ``position_ids`` restart); a forward
    continuing a KV cache continues them. Padded positions (2-D ``attention_mask`` zeros, left or right) and
    ``-1`` rows are routed naturally by the live router. A sequence may hold one row fewer than the tokens fed
    (the engine convention: the last sampled token is never routed); that last token is then routed naturally.
    Under activation checkpointing (``use_reentrant`` True or False; Transformers'
    ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable``, or torch's ``checkpoint_wrapper``)
    each recomputed forward reuses exactly the indices its own original forward used, whether ``backward``
    runs inside the block or after it, and in any order over several forwards (forward a, forward b,
    backward a, backward b). A router running inside any other ``torch.utils.checkpoint`` call cannot be bound
    to its recomputation: that forward raises :class:`RoutingReplayError`.

    Args:
        model: the model (``*ForCausalLM``, base model, or a DDP/FSDP2 wrapper of one).
        trace: a :class:`RoutingTrace` whose MoE layers and top-k match the model.
        drift: a :class:`~modelpatch.routing.RoutingDriftMeter` that receives, for every replayed router call, the
            experts the live router would have chosen against the replayed ones (R3's measures of routing drift, at
            the cost of one comparison per layer: no extra forward). Each layer's natural choice is taken on the
            hidden states of the replayed forward (the layers below it replayed), which is what the policy would
            choose at that point of the training forward. Routers of the ``topk`` kind only (PhiMoE's sparsemixer
            is not measured). ``drift.result()`` after the block.

    Yields:
        the same ``trace``.

    Raises:
        RoutingTraceError: on entry, if the trace's layers, top-k, or id range (``>= num_experts``) do not fit
            the model (the message names the layer, expected and received values).
        RoutingReplayError: during a forward, if it needs routes the trace does not hold (missing), its token
            count at a router differs, or a router runs inside an activation checkpoint replay cannot bind; on
            exit, if routes were left unconsumed (leftover).
    """
    session = ReplaySession(model, trace, drift)
    with session:
        yield trace
    session.check_complete()
