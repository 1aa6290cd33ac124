"""`record_routing` / `replay_routing`: drive the routers of one model instance for the length of a block.

Nothing is installed on classes or module globals. On entry each router module of the model gets an
instance-level ``forward`` (one module-level function bound to the router, the same for every block, so that
``torch.compile`` recompiles once for a driven model, not per block) that delegates to its original one (through
its router kind, see :mod:`modelpatch.routing.kinds`; under ``torch.compile`` through the operators of
:mod:`modelpatch.routing.compiled`), the module owning the decoder layers gets a forward pre-hook and hook
that read the batch layout, and the checkpoint functions of the routers' ancestors (Transformers'
``_gradient_checkpointing_func``, ``CheckpointWrapper.checkpoint_fn``) are wrapped per instance so that every
checkpointed call carries its own routes to its recomputation (:mod:`modelpatch.routing.recompute`). Every such
change goes on the session's :class:`~modelpatch.undo.UndoStack`, undone on exit (also on exception), so the
model is exactly as before and runs with zero overhead; a checkpoint recomputed after the exit still replays
its routes.

The classes behind the two context managers:

- :class:`_SessionDriver` — what both share: router discovery, installing and undoing the per-instance
  changes, the layout hooks, and the dispatch of each router call (checkpoint recomputation first).
- :class:`RecordSession` — fills a new :class:`RoutingTrace` with the experts the live routers choose.
- :class:`ReplaySession` — forces the experts of a given :class:`RoutingTrace`, in order, and checks that
  all of them were consumed.
- :class:`GenerateGuard` — while recording, refuses ``model.generate`` calls in decoding modes that cannot be
  recorded and checks each decode step continues the KV cache.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import ModelpatchRuntimeError
from ..undo import ABSENT, UndoStack
from .compiled import (
    HANDLERS,
    compiled_owner_info,
    compiled_owner_post_forward,
    compiled_owner_pre_forward,
    compiled_router_call,
    compiled_router_info,
)
from .errors import RoutingReplayError, RoutingTraceError
from .kinds import merge_forced
from .layout import ForwardLayout, Slot, signature_binder, layout_from_call
from .measures import RoutingDriftMeter
from .recompute import MARK as _MARK
from .recompute import (
    RecomputeFrame,
    ignore_indices,
    active_frames,
    bind_checkpoint_fn,
    is_bound,
    unbound_checkpoint_on_stack,
)
from .sites import RouterSite, find_router_sites, stack_owner, submodule
from .trace import RoutingTrace

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "record_routing",
    "replay_routing",
    "RoutingReplayError",
    "RecordSession",
    "ReplaySession",
    "GenerateGuard",
]

# Instance attributes holding a checkpoint function: Transformers' (GradientCheckpointingLayer, or the module
# owning the layers in older remote code) and torch's CheckpointWrapper.
_CHECKPOINT_ATTRS = ("_gradient_checkpointing_func", "checkpoint_fn")


# Instance attributes a block sets for its length on each router (and the owner): the router's forward before the
# block, and the facts its compiled calls need (see :mod:`modelpatch.routing.compiled`).
_ORIGINAL = "_modelpatch_routing_original"
_COMPILED = "_modelpatch_routing_compiled"


def _driven_router_forward(router: nn.Module, *args: Any, **kwargs: Any) -> object:
    """The ``forward`` of a router while a block drives it (bound to the router with ``types.MethodType``).

    One function for every block, so that ``torch.compile`` guards on it rather than on the block: while Dynamo
    traces, the call becomes the router's own forward with its top-k routed through an ordered custom operator;
    otherwise the session driving the router handles the call."""
    info = getattr(router, _COMPILED)
    if torch.compiler.is_compiling() and info.topk_kind:
        return compiled_router_call(info, getattr(router, _ORIGINAL), args, kwargs)
    session, site = HANDLERS[id(router)]
    return session._router_call(site, getattr(router, _ORIGINAL), args, kwargs)


def _owner_pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if torch.compiler.is_compiling():
        compiled_owner_pre_forward(getattr(module, _COMPILED), args, kwargs)
        return None
    HANDLERS[id(module)]._pre_forward(module, args, kwargs)
    return None


def _owner_post_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    if torch.compiler.is_compiling():
        compiled_owner_post_forward(getattr(module, _COMPILED))
        return None
    session = HANDLERS.get(id(module))
    if session is not None:
        session._post_forward(module, args, kwargs, output)
    return None


_CHECKPOINT_HINT = (
    "checkpoint the decoder layers with model.gradient_checkpointing_enable() / "
    "activation_checkpointing_enable() or torch's checkpoint_wrapper (CheckpointWrapper), which replay binds"
)


def _in_backward() -> bool:
    # Activation-checkpoint recomputation (reentrant or not) runs inside the autograd engine.
    return torch._C._current_graph_task_id() != -1


class _SessionDriver:
    """Drives the routers of one model instance while a record or replay block is open.

    Subclasses say what a router call does (:meth:`_route`, :meth:`_route_unbound_recompute`) and which trace
    sequences the tokens of a forward belong to (:meth:`_assign`). Used as a context manager: ``__enter__``
    installs, ``__exit__`` undoes every change, also on exception.

    Raises:
        RoutingDiscoveryError: (on construction) the model has no top-k router.
        ModelpatchRuntimeError: (on entry) a router is already driven by another block.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sites, stack_name, self.num_hidden_layers = find_router_sites(model)
        self.owner = stack_owner(model, stack_name)
        self.layout: ForwardLayout | None = None
        self._sig = signature_binder(self.owner)
        self._undo = UndoStack()  # every change to the model's modules, undone on exit
        self._handles: list[RemovableHandle] = []
        self._last_seqs: list[int] = []
        # modules that may carry a checkpoint function around a router: every ancestor of every router
        hosts: dict[int, nn.Module] = {id(model): model}
        for s in self.sites:
            m = model
            for part in s.name.split(".")[:-1]:  # one level at a time (not get_submodule of each prefix)
                m = submodule(m, part)
                hosts.setdefault(id(m), m)
        self._hosts = list(hosts.values())
        self._bound_attrs: dict[tuple[int, str], tuple[nn.Module, str]] = {}

    # -- what subclasses decide ---------------------------------------------------------------------------------
    def _assign(self, layout: ForwardLayout) -> None:
        """Give each slot of a forward's layout its trace sequence (``slot.seq``, and for replay its start)."""
        raise NotImplementedError

    def _route(
        self,
        site: RouterSite,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        originals: list[RecomputeFrame],
    ) -> object:
        """A router call of an ordinary forward (not a recomputation)."""
        raise NotImplementedError

    def _route_unbound_recompute(
        self,
        site: RouterSite,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        originals: list[RecomputeFrame],
    ) -> object:
        """A router call recomputed during backward by a checkpoint no frame is bound to."""
        raise NotImplementedError

    # -- hooks ------------------------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _in_backward():
            return None
        self._bind_checkpoints()  # checkpointing may have been enabled inside the block
        layout = layout_from_call(module, args, kwargs, self._sig)
        self._assign(layout)
        self.layout = layout
        return None

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not _in_backward():
            self.layout = None
        return None

    # -- compiled graphs (run by the operators of :mod:`modelpatch.routing.compiled`) ----------------------------
    def compiled_layout(
        self,
        ref: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache_position: torch.Tensor | None,
        past: int,
    ) -> None:
        """A compiled forward of the owner starts: what :meth:`_pre_forward` does, from the traced inputs."""
        given = {"attention_mask": attention_mask, "position_ids": position_ids, "cache_position": cache_position}
        kwargs = {"input_ids": ref, **{k: v for k, v in given.items() if v is not None}}
        layout = layout_from_call(self.owner, (), kwargs, self._sig, past=past)
        self._assign(layout)
        self.layout = layout

    def compiled_end(self) -> None:
        """A compiled forward of the owner ended."""
        self.layout = None

    def compiled_route(self, site: RouterSite, natural: torch.Tensor) -> torch.Tensor:
        """A compiled router call: ``natural`` ``(tokens, top_k)`` indices of the live router -> the indices to
        use (a new tensor)."""
        raise NotImplementedError

    def _router_call(
        self, site: RouterSite, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> object:
        source, originals = active_frames()
        if source is not None:  # a bound checkpoint recomputes: exactly the routes of its original forward
            forced = source.take(site)
            for frame in originals:
                frame.add(site, forced)
            return site.kind.call(site, forward, args, kwargs, forced, ignore_indices)
        if _in_backward():  # recomputed by a checkpoint no frame is bound to
            return self._route_unbound_recompute(site, forward, args, kwargs, originals)
        return self._route(site, forward, args, kwargs, originals)

    def _bind_checkpoints(self) -> None:
        """Wrap the checkpoint functions of the routers' ancestors so each checkpointed call keeps its routes
        (see :mod:`modelpatch.routing.recompute`)."""
        for host in self._hosts:
            d = host.__dict__
            for attr in _CHECKPOINT_ATTRS:
                fn = d.get(attr)
                if fn is None or not callable(fn) or is_bound(fn):
                    continue
                if attr == "checkpoint_fn" and "_checkpoint_wrapped_module" not in host._modules:
                    continue
                self._undo.setattr(host, attr, bind_checkpoint_fn(fn), raw=True)
                self._bound_attrs.setdefault((id(host), attr), (host, attr))

    def _checkpoint_fns_to_keep(self) -> list[tuple[nn.Module, str, object]]:
        """The checkpoint functions as the user left them: where our wrapper is still in place, the function it
        wraps; where the user replaced (or deleted) it inside the block, their value, which the undo must not
        take back."""
        keep = []
        for host, attr in self._bound_attrs.values():
            current = host.__dict__.get(attr, ABSENT)
            keep.append((host, attr, current.__wrapped__ if is_bound(current) else current))
        return keep

    # -- install / remove -------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        try:
            for site in self.sites:
                router = site.module
                if getattr(router, _MARK, None) is not None:
                    raise ModelpatchRuntimeError(
                        f"layer {site.layer_idx}: router already driven by another record_routing/replay_routing "
                        "block; these blocks do not nest on the same model"
                    )
                if id(router) in HANDLERS:
                    raise ModelpatchRuntimeError(
                        f"layer {site.layer_idx}: router already driven by another record_routing/replay_routing "
                        "block (as the module owning another model's decoder layers)"
                    )
                self._undo.setattrs_raw(
                    router,
                    {
                        _ORIGINAL: router.forward,
                        _COMPILED: compiled_router_info(site),
                        "forward": types.MethodType(_driven_router_forward, router),
                        _MARK: self,
                    },
                )
                self._undo.setitem(HANDLERS, id(router), (self, site))
            owner = self.owner
            if id(owner) in HANDLERS:
                raise ModelpatchRuntimeError(
                    f"{type(owner).__name__}: the module owning the decoder layers is already driven by another "
                    "record_routing/replay_routing block; these blocks do not nest on the same model"
                )
            self._undo.setattr(owner, _COMPILED, compiled_owner_info(owner, self._sig), raw=True)
            self._undo.setitem(HANDLERS, id(owner), self)
            self._bind_checkpoints()
            self._handles.append(owner.register_forward_pre_hook(_owner_pre_hook, with_kwargs=True))
            # not always_call: Dynamo guards on the handle ids of always-called hooks (a recompile per block)
            self._handles.append(owner.register_forward_hook(_owner_post_hook, with_kwargs=True))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks and undo every change to the model (idempotent)."""
        try:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
        finally:
            keep = self._checkpoint_fns_to_keep()
            self._bound_attrs.clear()
            self.layout = None
            self._undo.undo()
            for host, attr, value in keep:
                if host.__dict__.get(attr, ABSENT) is value:
                    continue
                if value is ABSENT:
                    del host.__dict__[attr]
                else:
                    host.__dict__[attr] = value


class GenerateGuard:
    """While recording, ``model.generate`` refuses the decoding modes whose forwards do not extend the recorded
    sequences one token at a time (beam search, assisted / prompt-lookup decoding, ``use_cache=False``, ...),
    and :meth:`check_step` checks at every forward of an accepted call that it continues the KV cache where the
    previous forward ended.

    :meth:`install` puts the guarded ``generate`` on the model instance through the caller's
    :class:`~modelpatch.undo.UndoStack`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.active = False  # inside a guarded generate call
        self.end: int | None = None  # inside generate: grid length after the last forward
        self.prompt_mask: torch.Tensor | None = None  # inside generate: its 2-D attention_mask (batch, prompt)

    def install(self, undo: UndoStack) -> None:
        model = self.model
        original = getattr(model, "generate", None)
        if original is None:  # a bare wrapper (DDP) or a base model without generate
            return

        def generate(*args: Any, **kwargs: Any) -> Any:
            why = _refused_generation(model, args, kwargs)
            if why is not None:
                raise RoutingTraceError(f"record_routing cannot record generate with {why}")
            if self.active:  # generate calling generate: let the outer call's checks stand
                return original(*args, **kwargs)
            mask = kwargs.get("attention_mask")
            with UndoStack() as state:
                state.setattr(self, "active", True)
                state.setattr(self, "end", None)
                state.setattr(self, "prompt_mask", mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)
                return original(*args, **kwargs)

        undo.setattr(model, "generate", generate, raw=True)

    def check_step(self, layout: ForwardLayout) -> None:
        """Inside ``generate``: every forward after the first must continue the KV cache exactly where the
        previous one ended (the backstop behind :func:`_refused_generation`).

        Raises:
            RoutingTraceError: the forward re-runs the whole sequence, or continues the cache elsewhere.
        """
        if not self.active:
            return
        end = self.end
        if end is not None:
            if not layout.continuation:
                raise RoutingTraceError(
                    "record_routing: a generate step ran the whole sequence again instead of continuing the KV "
                    "cache (use_cache=False, or a decoding mode without cache); each step would be recorded as "
                    "new sequences. Generate with use_cache=True, greedy or sampling"
                )
            if layout.past != end:
                raise RoutingTraceError(
                    f"record_routing: a generate step continues the KV cache from position {layout.past}, the "
                    f"previous forward ended at {end}: the cache was cropped or reordered (assisted / speculative "
                    "decoding, beam search?), so routes of discarded tokens were recorded. Generate greedy or "
                    "sampling, without an assistant"
                )
        self.end = layout.past + layout.seq_len

    def padding_mask(self, mask: Any, seq_len: int, batch: int) -> Any:
        """Inside ``generate``: the 2-D mask ``(batch, past + seq_len)`` of the forward about to run, built from the
        prompt's 2-D mask (every generated token is real), when the forward itself gets no 2-D mask: a static or
        otherwise compiled cache hands the model a 4-D mask, from which padding cannot be read. Else ``mask``.

        ``generate`` expands the prompt batch ``B`` to ``batch = B * n`` rows (``num_return_sequences``: each
        prompt row repeated ``n`` times, ``repeat_interleave`` as ``_expand_inputs_for_generation`` does), so the
        prompt mask is expanded the same way.

        Raises:
            RoutingTraceError: ``batch`` is not a multiple of the prompt batch (the rows cannot be aligned).
        """
        prompt = self.prompt_mask
        if not self.active or prompt is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            return mask
        total = (self.end if self.end is not None else prompt.shape[1]) + (seq_len if self.end is not None else 0)
        if total < prompt.shape[1]:
            return mask
        if batch != prompt.shape[0]:
            if batch % prompt.shape[0]:
                raise RoutingTraceError(
                    f"record_routing: a generate forward of {batch} rows for a prompt batch of {prompt.shape[0]} "
                    "rows: its padding cannot be aligned with the prompt's attention_mask"
                )
            prompt = prompt.repeat_interleave(batch // prompt.shape[0], dim=0)
        extra = prompt.new_ones((prompt.shape[0], total - prompt.shape[1]))
        return torch.cat([prompt, extra], dim=1)


class RecordSession(_SessionDriver):
    """Records the experts the live routers choose into :attr:`trace` (a new :class:`RoutingTrace`).

    A forward without past key values starts new sequences; one continuing a KV cache appends to the previous
    forward's sequences. ``model.generate`` is guarded by a :class:`GenerateGuard`.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.trace = RoutingTrace(
            {},
            num_experts={s.layer_idx: s.num_experts for s in self.sites},
            top_k={s.layer_idx: s.top_k for s in self.sites},
            num_hidden_layers=self.num_hidden_layers,
        )
        self.generate_guard = GenerateGuard(model)

    def __enter__(self) -> Self:
        super().__enter__()
        try:
            self.generate_guard.install(self._undo)
        except BaseException:
            self.close()
            raise
        return self

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        guard = self.generate_guard
        if guard.active and guard.prompt_mask is not None:
            ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            mask = kwargs.get("attention_mask")
            if (
                isinstance(ref, torch.Tensor)
                and ref.dim() >= 2
                and not (isinstance(mask, torch.Tensor) and mask.dim() == 2)
            ):
                kwargs = {**kwargs, "attention_mask": guard.padding_mask(mask, int(ref.shape[1]), int(ref.shape[0]))}
        super()._pre_forward(module, args, kwargs)

    def compiled_layout(
        self,
        ref: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache_position: torch.Tensor | None,
        past: int,
    ) -> None:
        attention_mask = self.generate_guard.padding_mask(attention_mask, int(ref.shape[1]), int(ref.shape[0]))
        super().compiled_layout(ref, attention_mask, position_ids, cache_position, past)

    def _assign(self, layout: ForwardLayout) -> None:
        self.generate_guard.check_step(layout)
        if layout.continuation and self._last_seqs and len(self._last_seqs) == len(layout.slots):
            seqs = self._last_seqs
        else:
            first = max(self.trace.num_sequences, max(self._last_seqs, default=-1) + 1)
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
        compact = idx.detach().to(self.trace.storage_dtype(site.layer_idx))
        for slot in layout.slots:
            self.trace.append(site.layer_idx, slot.seq, compact[slot.rows], check=False)

    def compiled_route(self, site: RouterSite, natural: torch.Tensor) -> torch.Tensor:
        self._record(site, natural)
        return natural.clone()

    def _route(
        self,
        site: RouterSite,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        originals: list[RecomputeFrame],
    ) -> object:
        for frame in originals:
            frame.add(site, None)  # a recomputation routes naturally, as this forward does
        return site.kind.call(site, forward, args, kwargs, None, lambda idx: self._record(site, idx))

    def _route_unbound_recompute(
        self,
        site: RouterSite,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        originals: list[RecomputeFrame],
    ) -> object:
        for frame in originals:
            frame.add(site, None)
        return site.kind.call(site, forward, args, kwargs, None, ignore_indices)  # not recorded twice


class ReplaySession(_SessionDriver):
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
            device = _module_device(s.module)
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
                "is not bound to; its recomputation in backward would not use the replayed indices; " + _CHECKPOINT_HINT
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
        if self.drift is not None and not _in_backward():
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
            "original forward; " + _CHECKPOINT_HINT
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


def _module_device(module: nn.Module) -> torch.device:
    """The device of the router's first parameter (its own ones first: no generator over the subtree); CPU if it
    has none."""
    for p in module._parameters.values():
        if p is not None:
            return p.device
    return next(iter(module.parameters()), torch.empty(0)).device


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

    ``model.generate`` is recorded for greedy decoding and sampling with the KV cache: calls whose forwards
    would not extend the generated sequences one step at a time raise :class:`RoutingTraceError` before any
    forward — beam search (``num_beams > 1``), ``use_cache=False``, assisted / speculative decoding
    (``assistant_model``, ``prompt_lookup_num_tokens``, ``assistant_early_exit``, ``use_mtp``),
    classifier-free guidance (``guidance_scale``), contrastive search, DoLa, ``custom_generate`` — and every
    decode step is checked to continue the KV cache where the previous forward ended.

    Args:
        model: the model (``*ForCausalLM``, base model, or a DDP/FSDP2 wrapper of one).

    Yields:
        :class:`RoutingTrace`: ``trace[layer_idx][seq]`` is a LongTensor ``(num_tokens, top_k)``. Complete once
        the block exits (readable earlier, too).

    Raises:
        RoutingDiscoveryError: the model has no top-k router.
        RoutingTraceError: ``model.generate`` called in a decoding mode that cannot be recorded (see above).
        RuntimeError: the model is already inside a record/replay block.

    Example::

        with record_routing(model) as trace:
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=16)
    """
    session = RecordSession(model)
    with session:
        yield session.trace
    session.trace.check_lengths()


# Options of ``generate`` whose forwards do not extend the recorded sequences one step at a time.
_ASSISTED_OPTIONS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


def _generation_config(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The generation config ``generate(*args, **kwargs)`` will run with (``None`` if it cannot be read)."""
    config: Any = kwargs.get("generation_config")
    if config is None and len(args) > 1:
        config = args[1]
    rest = {k: v for k, v in kwargs.items() if k not in ("generation_config", "assistant_model", "custom_generate")}
    prepare: Any = getattr(model, "_prepare_generation_config", None)
    try:
        return prepare(config, **rest)[0]
    except Exception:  # noqa: BLE001 - private helper of Transformers: fall back to the plain merge
        pass
    try:
        config = copy.deepcopy(config if config is not None else model.generation_config)
        config.update(**rest)
        return config
    except Exception:  # noqa: BLE001 - generate itself will report a bad config
        return None


def _refused_generation(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``record_routing`` cannot record this ``generate`` call, or ``None``."""
    config = _generation_config(model, args, kwargs)
    if kwargs.get("custom_generate") is not None:
        return (
            f"custom_generate={kwargs['custom_generate']!r}: a custom decoding loop may run forwards that do not "
            "extend the generated sequences one step at a time"
        )
    if config is None:
        return None
    beams = getattr(config, "num_beams", 1) or 1
    if beams > 1:
        return (
            f"beam search (num_beams={beams}): beams reorder the KV cache between decode steps; generate with "
            "num_beams=1 (greedy or sampling), as RL rollouts do"
        )
    assisted = []
    for name in _ASSISTED_OPTIONS:
        value = kwargs.get(name) if name == "assistant_model" else getattr(config, name, None)
        if value is not None and value is not False:
            assisted.append(name if name == "assistant_model" else f"{name}={value!r}")
    if assisted:
        return (
            f"assisted / speculative decoding ({', '.join(assisted)}): the model verifies draft tokens in one "
            "forward, the rejected ones are routed too and then cropped from the KV cache; generate without it"
        )
    if getattr(config, "use_cache", True) is False:
        return (
            "use_cache=False: every decode step re-runs the whole prefix, so each step would be recorded as new "
            "sequences; generate with use_cache=True"
        )
    guidance = getattr(config, "guidance_scale", None)
    if guidance is not None and guidance != 1:
        return (
            f"classifier-free guidance (guidance_scale={guidance}): it runs extra unconditional forwards of the "
            "model that would be recorded as routes of the generated sequences"
        )
    try:
        mode = str(getattr(config.get_generation_mode(kwargs.get("assistant_model")), "value", ""))
    except Exception:  # noqa: BLE001 - a config generate cannot classify: generate itself reports it
        mode = ""
    if mode and mode not in ("greedy_search", "sample"):
        return f"generation mode {mode!r}: only greedy decoding and sampling extend the sequences one step at a time"
    return None


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
