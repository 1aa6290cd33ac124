"""Record and replay inside ``torch.compile`` graphs: the routing bookkeeping as two opaque, ordered operators.

What a record/replay block does per forward is Python bookkeeping that depends on tensor values (which rows
are padding, where packed sequences restart, which trace rows come next), so Dynamo cannot trace it without
breaking the graph. Under ``torch.compile`` the block's code therefore only puts two custom operators into the
graph, and the bookkeeping runs, unchanged, when the compiled graph executes them:

- ``modelpatch::routing_layout(key, ref, attention_mask, position_ids, cache_position, past)`` — at the start
  of each forward of the module owning the decoder layers (its forward pre-hook): the session reads the batch
  layout, assigns trace sequences (and for ``model.generate`` checks each step continues the cache).
- ``modelpatch::routing_route(key, natural) -> indices`` — at each router's ``torch.topk`` (found by a
  :class:`~torch.overrides.TorchFunctionMode` for that router call, which Dynamo traces): record appends the
  natural indices and returns them; replay returns the trace's indices (``-1`` rows: the natural ones). The
  router then gathers its weights at those indices from the full score distribution, as in eager.
- ``modelpatch::routing_end(key)`` — the owner's forward hook: the forward is over. (Not an ``always_call``
  hook, whose handle id Dynamo would guard on, so a forward that raises leaves the layout until the next
  forward or the end of the block.)

Both are registered with an *ordered* effect (``torch.library._register_effectful_op``), so the compiler keeps
them, in program order, although their results do not feed the loss. ``key`` is ``id()`` of the module; a
plain dict maps it to the session driving that module only while a block is open (entries are undone on
exit); an operator with no session behind it routes naturally.

Dynamo guards on the *functions* a block installs (one module-level function per role, bound to the router or
owner), not on the session: so a model compiled before a block recompiles once on entry, then every later
block and forward reuses the compiled code (no graph break, no recompile per forward or per block). The
per-router facts the trace needs (:class:`CompiledRouter`) are cached per router, for the same reason, and
record and replay trace the same graph (record's operator returns the natural indices).

Limits: routers of the ``TOPK`` kind only (PhiMoE's sparsemixer runs its eager path, with graph breaks);
activation checkpointing inside a compiled region is not bound (a recomputation inside the compiled backward
would run the operators again), so compile either the checkpointed layers or the routing, not both.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .errors import RouterContractError
from .kinds import TOPK, is_router_topk

__all__ = ["CompiledRouter", "CompiledOwner", "HANDLERS", "compiled_router_info", "compiled_owner_info"]

HANDLERS: dict[int, Any] = {}
"""``id(module) -> session`` for the routers and owners driven by an open block (set and undone by the block)."""


# Registered with torch.library.Library, not torch.library.custom_op: the compiled graph calls these operators at
# every forward (six calls for a four-layer model), and custom_op's Python dispatch layers (autograd wrapper,
# backend wrapper, Dynamo-disabled frame) cost about 11 us per call against about 4 us here. Their inputs never need
# gradients (indices, masks, ids), so the autograd fallback's pass-through is all they need.
_LIB = torch.library.Library("modelpatch", "FRAGMENT")
_LIB.define(
    "routing_layout(SymInt key, Tensor ref, Tensor? attention_mask, Tensor? position_ids, Tensor? cache_position, "
    "SymInt past) -> ()"
)
_LIB.define("routing_route(SymInt key, Tensor natural) -> Tensor")
_LIB.define("routing_end(SymInt key) -> ()")


def _routing_layout(
    key: int,
    ref: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache_position: torch.Tensor | None,
    past: int,
) -> None:
    session = HANDLERS.get(key)
    if session is not None:
        session.compiled_layout(ref, attention_mask, position_ids, cache_position, past)


def _routing_layout_fake(key, ref, attention_mask, position_ids, cache_position, past) -> None:
    return None


def _routing_route(key: int, natural: torch.Tensor) -> torch.Tensor:
    entry = HANDLERS.get(key)
    if entry is None:
        return natural.clone()
    session, site = entry
    return session.compiled_route(site, natural)


def _routing_route_fake(key: int, natural: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(natural)


def _routing_end(key: int) -> None:
    session = HANDLERS.get(key)
    if session is not None:
        session.compiled_end()


def _routing_end_fake(key: int) -> None:
    return None


for _name, _impl, _fake in (
    ("routing_layout", _routing_layout, _routing_layout_fake),
    ("routing_route", _routing_route, _routing_route_fake),
    ("routing_end", _routing_end, _routing_end_fake),
):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"modelpatch::{_name}", _fake, lib=_LIB)


def _register_effects() -> None:
    from torch._library.effects import EffectType

    for name in ("modelpatch::routing_layout", "modelpatch::routing_route", "modelpatch::routing_end"):
        torch.library._register_effectful_op(name, EffectType.ORDERED)  # noqa: SLF001 - torch.library's only way to order an opaque op under torch.compile


_register_effects()


@dataclass(frozen=True, eq=False)
class CompiledRouter:
    """What a compiled router call needs, without a reference to the module (cached per router)."""

    key: int
    num_experts: int
    top_k: int
    topk_kind: bool


@dataclass(frozen=True, eq=False)
class CompiledOwner:
    """The owner's ``id`` and the names of its forward's positional parameters (Dynamo cannot bind signatures)."""

    key: int
    params: tuple[str, ...]


_ROUTER_INFOS: weakref.WeakKeyDictionary[torch.nn.Module, CompiledRouter] = weakref.WeakKeyDictionary()
_OWNER_INFOS: weakref.WeakKeyDictionary[torch.nn.Module, CompiledOwner] = weakref.WeakKeyDictionary()


def compiled_router_info(site) -> CompiledRouter:
    """The cached :class:`CompiledRouter` of ``site.module`` (the same object for every block)."""
    info = _ROUTER_INFOS.get(site.module)
    if info is None or (info.num_experts, info.top_k, info.topk_kind) != (
        site.num_experts,
        site.top_k,
        site.kind is TOPK,
    ):
        info = _ROUTER_INFOS[site.module] = CompiledRouter(
            id(site.module), site.num_experts, site.top_k, site.kind is TOPK
        )
    return info


def compiled_owner_info(owner: torch.nn.Module, sig) -> CompiledOwner:
    """The cached :class:`CompiledOwner` of ``owner`` (``sig``: its forward's signature, or ``None``)."""
    params = tuple(sig.parameters) if sig is not None else ()
    info = _OWNER_INFOS.get(owner)
    if info is None or info.params != params:
        info = _OWNER_INFOS[owner] = CompiledOwner(id(owner), params)
    return info


class _CompiledTopKMode(TorchFunctionMode):
    """Inside one traced router call: the router's ``torch.topk`` over its experts goes through
    ``modelpatch::routing_route`` (same matching rule as the eager :class:`~.kinds.TopKSelection`)."""

    def __init__(self, info: CompiledRouter):
        super().__init__()
        self.info = info
        self.hits = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = self.info
        if is_router_topk(func, args, kwargs, info.top_k, info.num_experts):
            inp = args[0]
            self.hits += 1
            values, natural = func(*args, **kwargs)
            # one graph for record and replay: record gets its natural indices back, whose gathered scores
            # are the natural top-k values
            idx = torch.ops.modelpatch.routing_route(info.key, natural)
            values = inp.gather(-1, idx)
            if values.is_floating_point():  # kinds._floor_probabilities, without a data-dependent branch
                floored = values.clamp_min(torch.finfo(values.dtype).tiny)
                values = torch.where((inp < 0).any(), values, floored)
            return torch.return_types.topk((values, idx))
        return func(*args, **kwargs)


def compiled_router_call(info: CompiledRouter, forward, args: tuple, kwargs: dict) -> object:
    """One router call while Dynamo traces: ``forward`` (the router's own) under :class:`_CompiledTopKMode`.

    Raises:
        RouterContractError: (while tracing) the router did not call exactly one matching ``torch.topk``.
    """
    mode = _CompiledTopKMode(info)
    with mode:
        out = forward(*args, **kwargs)
    if mode.hits != 1:
        raise RouterContractError(
            f"router with {info.num_experts} experts: expected exactly one top-k with k={info.top_k} in its "
            f"forward under torch.compile, saw {mode.hits}"
        )
    return out


def compiled_owner_pre_forward(info: CompiledOwner, args: tuple, kwargs: dict) -> None:
    """While Dynamo traces the owner's pre-hook: hand the layout inputs to ``modelpatch::routing_layout``."""
    bound = dict(kwargs)
    for name, value in zip(info.params, args):
        bound.setdefault(name, value)
    ref = bound.get("input_ids")
    if ref is None:
        embeds = bound.get("inputs_embeds")
        if embeds is not None:
            ref = embeds[..., 0]
    if ref is None:
        ref = next(a for a in args if isinstance(a, torch.Tensor))
    cache = bound.get("past_key_values")
    if cache is None:
        cache = bound.get("cache")
    past = 0
    if cache is not None and hasattr(cache, "get_seq_length"):
        past = cache.get_seq_length()
    mask = bound.get("attention_mask")
    pos = bound.get("position_ids")
    cache_position = bound.get("cache_position")
    torch.ops.modelpatch.routing_layout(
        info.key,
        ref,
        mask if isinstance(mask, torch.Tensor) else None,
        pos if isinstance(pos, torch.Tensor) else None,
        cache_position if isinstance(cache_position, torch.Tensor) else None,
        past,
    )


def compiled_owner_post_forward(info: CompiledOwner) -> None:
    torch.ops.modelpatch.routing_end(info.key)
