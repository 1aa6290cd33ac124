""":func:`record_routing`: :class:`RecordSession` fills a new :class:`~.trace.RoutingTrace` with the experts the live routers
choose, in forward passes and ``model.generate`` (see :mod:`.generate`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .driver import SessionDriver
from .errors import RoutingReplayError
from .generate import GenerateGuard
from .layout import ForwardLayout
from .recompute import (
    RecomputeFrame,
    ignore_indices,
)
from .sites import RouterSite
from .trace import RoutingTrace

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["RecordSession", "record_routing"]


class RecordSession(SessionDriver):
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
