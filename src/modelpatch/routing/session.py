"""`record_routing` / `replay_routing`: drive the routers of one model instance for the length of a block.

Nothing is installed on classes or module globals. On entry each router module of the model gets an
instance-level ``forward`` that delegates to its original one (through its router kind, see
:mod:`modelpatch.routing.kinds`), and the module owning the decoder layers gets a forward pre-hook and hook
that read the batch layout. On exit (also on exception) the instance attributes and hooks are removed, so the
model is exactly as before and runs with zero overhead.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from .layout import ForwardLayout, _signature_binder, layout_from_call
from .sites import RouterSite, find_router_sites, stack_owner
from .trace import RoutingTrace, RoutingTraceError, _Block, compact_dtype

__all__ = ["record_routing", "replay_routing", "RoutingReplayError"]

_MARK = "_modelpatch_routing_session"


class RoutingReplayError(RuntimeError):
    """A replay block consumed more or fewer routes than its trace holds, or a forward does not fit it."""


def _in_backward() -> bool:
    # Activation-checkpoint recomputation (reentrant or not) runs inside the autograd engine.
    return torch._C._current_graph_task_id() != -1


class _Session:
    def __init__(self, model: nn.Module, trace: RoutingTrace | None):
        self.sites, stack_name, self.num_hidden_layers = find_router_sites(model)
        self.owner = stack_owner(model, stack_name)
        stack = model.get_submodule(stack_name)
        self.layer_modules = {s.layer_idx: stack[s.layer_idx] for s in self.sites}
        self.replay = trace is not None
        self.layout: ForwardLayout | None = None
        self.recompute: dict[int, list[torch.Tensor]] = {s.layer_idx: [] for s in self.sites}
        self._sig = _signature_binder(self.owner)
        self._installed: list[tuple[nn.Module, bool, object]] = []
        self._handles = []
        self._last_seqs: list[int] = []
        if self.replay:
            self.trace = trace
            self._prepare_replay(trace)
        else:
            self.trace = RoutingTrace(
                {},
                num_experts={s.layer_idx: s.num_experts for s in self.sites},
                top_k={s.layer_idx: s.top_k for s in self.sites},
                num_hidden_layers=self.num_hidden_layers,
            )

    # -- replay bookkeeping -----------------------------------------------------------------------------------
    def _prepare_replay(self, trace: RoutingTrace) -> None:
        model_layers = tuple(s.layer_idx for s in self.sites)
        if trace.layers != model_layers:
            raise RoutingTraceError(
                f"trace MoE layers {list(trace.layers)} do not match the model's MoE layers {list(model_layers)}"
            )
        self.rows: dict[int, list[torch.Tensor]] = {}
        for s in self.sites:
            layer = s.layer_idx
            if trace.top_k[layer] != s.top_k:
                raise RoutingTraceError(f"layer {layer}: expected top_k {s.top_k}, trace has {trace.top_k[layer]}")
            seqs = trace._rows(layer)
            hi = trace._max_id(layer)
            if hi >= s.num_experts:
                raise RoutingTraceError(
                    f"layer {layer}: expected expert ids in [0, {s.num_experts}) or -1, received max id {hi}"
                )
            device = next(iter(s.module.parameters()), torch.empty(0)).device
            if device.type == "meta":
                device = torch.device("cpu")
            self.rows[layer] = [t.to(device) for t in seqs]  # no copy on the same device; never modified
        self.lengths = trace.sequence_lengths
        self.cursor = [0] * len(self.lengths)
        self.closed = [False] * len(self.lengths)
        self.next_seq = 0

    def _assign_replay(self, layout: ForwardLayout) -> None:
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

    def _forced(self, site: RouterSite, num_tokens: int) -> torch.Tensor:
        layout = self.layout
        if layout is None:
            raise RoutingReplayError(
                f"layer {site.layer_idx}: router called outside a forward of {type(self.owner).__name__}; "
                "replay needs the forward to go through the module owning the decoder layers"
            )
        if layout.num_tokens != num_tokens:
            raise RoutingReplayError(
                f"layer {site.layer_idx}: expected {layout.num_tokens} tokens at the router, received {num_tokens}"
            )
        rows = self.rows[site.layer_idx]
        if len(layout.slots) == 1 and isinstance(layout.slots[0].rows, slice) and not layout.slots[0].pad_end:
            slot = layout.slots[0]
            if slot.n == num_tokens:
                return rows[slot.seq][slot.start : slot.start + slot.n]
        dense = torch.full((num_tokens, site.top_k), -1, dtype=torch.int64, device=rows[0].device if rows else None)
        for slot in layout.slots:
            got = rows[slot.seq][slot.start : slot.start + slot.n - slot.pad_end]
            if slot.pad_end:
                got = torch.cat([got, got.new_full((slot.pad_end, site.top_k), -1)])
            dense[slot.rows] = got
        return dense

    # -- record bookkeeping -----------------------------------------------------------------------------------
    def _assign_record(self, layout: ForwardLayout) -> None:
        if layout.continuation and self._last_seqs and len(self._last_seqs) == len(layout.slots):
            seqs = self._last_seqs
        else:
            first = self.trace.num_sequences if self.trace._blocks else 0
            first = max(first, max(self._last_seqs, default=-1) + 1)
            seqs = list(range(first, first + len(layout.slots)))
        for slot, seq in zip(layout.slots, seqs):
            slot.seq = seq
        self._last_seqs = seqs

    def _record(self, site: RouterSite, idx: torch.Tensor) -> None:
        layout = self.layout
        if layout is None:
            raise RoutingReplayError(
                f"layer {site.layer_idx}: router called outside a forward of {type(self.owner).__name__}"
            )
        idx = idx.reshape(-1, site.top_k)
        if idx.shape[0] != layout.num_tokens:
            raise RoutingReplayError(
                f"layer {site.layer_idx}: expected {layout.num_tokens} tokens at the router, received {idx.shape[0]}"
            )
        dtype = compact_dtype(site.num_experts)
        seqs = self.trace._blocks[site.layer_idx]
        compact = idx.detach().to(dtype)
        for slot in layout.slots:
            while len(seqs) <= slot.seq:
                seqs.append([])
            seqs[slot.seq].append(_Block(compact[slot.rows], None))

    # -- hooks ------------------------------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        if _in_backward():
            return None
        layout = layout_from_call(module, args, kwargs, self._sig)
        (self._assign_replay if self.replay else self._assign_record)(layout)
        self.layout = layout
        return None

    def _post_forward(self, module, args, kwargs, output):
        if not _in_backward():
            self.layout = None
        return None

    def _checkpointed(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` runs under activation checkpointing (Transformers'
        ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable``, or a ``CheckpointWrapper``)."""
        layer = self.layer_modules[layer_idx]
        if not layer.training:
            return False
        return bool(getattr(layer, "gradient_checkpointing", False)) or "checkpoint" in type(layer).__name__.lower()

    def _router_call(self, site: RouterSite, forward, args, kwargs):
        hidden = args[0] if args else next(iter(kwargs.values()))
        num_tokens = hidden.numel() // hidden.shape[-1]
        recompute = _in_backward()
        if not self.replay:
            sink = (lambda idx: None) if recompute else (lambda idx: self._record(site, idx))
            return site.kind.call(site, forward, args, kwargs, None, sink)
        stack = self.recompute[site.layer_idx]
        if recompute:
            match = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].shape[0] == num_tokens), None)
            if match is None:
                raise RoutingReplayError(
                    f"layer {site.layer_idx}: recomputed forward (activation checkpointing) found no replayed "
                    f"routes of {num_tokens} tokens to reuse; enable checkpointing with "
                    "model.gradient_checkpointing_enable() (or a CheckpointWrapper) so replay can keep them"
                )
            forced = stack.pop(match).to(torch.int64)
        else:
            forced = self._forced(site, num_tokens)
            if self._checkpointed(site.layer_idx):  # its backward will recompute this forward: keep the indices
                stack.append(forced.to(compact_dtype(site.num_experts)) if not bool((forced < 0).any()) else forced)
        return site.kind.call(site, forward, args, kwargs, forced, lambda idx: None)

    # -- install / remove -------------------------------------------------------------------------------------
    def install(self) -> None:
        try:
            for site in self.sites:
                router = site.module
                if getattr(router, _MARK, None) is not None:
                    raise RuntimeError(
                        f"layer {site.layer_idx}: router already driven by another record_routing/replay_routing "
                        "block; these blocks do not nest on the same model"
                    )
                had = "forward" in router.__dict__
                prev = router.__dict__.get("forward")
                original = router.forward

                def forward(*args, _site=site, _orig=original, **kwargs):
                    return self._router_call(_site, _orig, args, kwargs)

                self._installed.append((router, had, prev))
                router.__dict__["forward"] = forward
                router.__dict__[_MARK] = self
            self._handles.append(self.owner.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(
                self.owner.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
            )
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for router, had, prev in self._installed:
            router.__dict__.pop(_MARK, None)
            if had:
                router.__dict__["forward"] = prev
            else:
                router.__dict__.pop("forward", None)
        self._installed.clear()
        self.layout = None
        for stack in self.recompute.values():
            stack.clear()

    def check_replay_complete(self) -> None:
        leftover = [
            f"sequence {i}: {self.cursor[i]} of {n} tokens replayed"
            for i, n in enumerate(self.lengths)
            if self.cursor[i] < n
        ]
        if leftover:
            raise RoutingReplayError("leftover routes at the end of the replay block: " + "; ".join(leftover))


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingTrace]:
    """Record the experts every token is routed to, in every MoE layer of ``model``.

    Works with any Transformers model built or loaded the ordinary way (no router subclass, no step before
    loading); the model's router modules are driven per instance for the length of the block and left exactly
    as they were on exit (also on exception).

    Every forward of the block through the module owning the decoder layers adds to the yielded trace: a forward
    without past key values starts new sequences (one per batch row, or one per packed segment when a single
    row's ``position_ids`` restart), a forward continuing a KV cache (``model.generate`` decode steps) appends to
    the previous ones, in token order. Padding (2-D ``attention_mask`` zeros, left or right) is skipped.
    Under activation checkpointing the recomputed forward is not recorded twice.

    Args:
        model: the model (``*ForCausalLM``, base model, or a DDP/FSDP2 wrapper of one).

    Yields:
        :class:`RoutingTrace`: ``trace[layer_idx][seq]`` is a LongTensor ``(num_tokens, top_k)``. Complete once
        the block exits (readable earlier, too).

    Raises:
        RoutingDiscoveryError: the model has no top-k router.
        RuntimeError: the model is already inside a record/replay block.

    Example::

        with record_routing(model) as trace:
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=16)
    """
    session = _Session(model, None)
    session.install()
    restore_generate = _refuse_beam_search(model)
    try:
        yield session.trace
    finally:
        restore_generate()
        session.remove()
    session.trace._check_lengths()


def _refuse_beam_search(model: nn.Module):
    """While recording, ``model.generate`` with ``num_beams > 1`` raises: beam search reorders the KV cache
    between decode steps, so rows appended by batch position would match none of the returned sequences.
    Returns the function that restores ``model`` exactly."""
    original = getattr(model, "generate", None)
    if original is None:
        return lambda: None
    had, prev = "generate" in model.__dict__, model.__dict__.get("generate")

    def generate(*args, **kwargs):
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
        if beams > 1:
            raise RoutingTraceError(
                f"record_routing does not follow beam search (num_beams={beams}): beams reorder the KV cache between "
                "decode steps; generate with num_beams=1 (greedy or sampling), as RL rollouts do"
            )
        return original(*args, **kwargs)

    model.__dict__["generate"] = generate

    def restore() -> None:
        if had:
            model.__dict__["generate"] = prev
        else:
            model.__dict__.pop("generate", None)

    return restore


@contextmanager
def replay_routing(model: nn.Module, trace: RoutingTrace) -> Iterator[RoutingTrace]:
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
    Under activation checkpointing (``use_reentrant`` True or False) the recomputed forward reuses exactly the
    indices of the original forward.

    Args:
        model: the model (``*ForCausalLM``, base model, or a DDP/FSDP2 wrapper of one).
        trace: a :class:`RoutingTrace` whose MoE layers and top-k match the model.

    Yields:
        the same ``trace``.

    Raises:
        RoutingTraceError: on entry, if the trace's layers, top-k, or id range (``>= num_experts``) do not fit
            the model (the message names the layer, expected and received values).
        RoutingReplayError: during a forward, if it needs routes the trace does not hold (missing) or its token
            count at a router differs; on exit, if routes were left unconsumed (leftover).
    """
    session = _Session(model, trace)
    session.install()
    try:
        yield trace
    except BaseException:
        session.remove()
        raise
    session.remove()
    session.check_replay_complete()
