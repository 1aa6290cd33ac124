"""Binding the expert indices of a checkpointed forward to its recomputation.

Activation checkpointing runs a layer's forward twice: once in the forward pass, once more when the backward
needs its activations. The recomputation must route exactly as the original forward did, yet it may run
*after* the replay block has exited (``loss.backward()`` after the ``with``), and in any order relative to
other forwards (forward a, forward b, backward a, backward b). So the indices are not kept by the session;
they travel with the checkpoint itself:

- While a record/replay block is open, the checkpoint entry points of the model are wrapped per instance:
  Transformers' ``_gradient_checkpointing_func`` (set by ``gradient_checkpointing_enable`` /
  ``activation_checkpointing_enable``, on the decoder layers or, in older remote code, on the module owning
  them) and ``checkpoint_fn`` of torch's ``CheckpointWrapper`` (``checkpoint_wrapper`` /
  ``apply_activation_checkpointing``). The wrapper hands the checkpoint, instead of the function it was
  given, :meth:`RecomputeFrame.run` of a new :class:`RecomputeFrame`; the checkpoint keeps that bound method in
  its autograd graph (``ctx.run_function`` for ``use_reentrant=True``, the recompute closure for
  ``use_reentrant=False``) and calls it again to recompute.
- The first call of ``run`` is the original forward: every router call inside it appends the indices it used
  (``None`` for natural routing) to the frame. Every later call is a recomputation: router calls take the
  frame's indices in the same order, whichever block is open, or none. With no block open, ``run`` drives the
  routers of the frame per instance for the length of the recomputation and restores them exactly after.

The frame lives exactly as long as the checkpoint's graph. A router running inside a ``torch.utils.checkpoint``
that was *not* reached through a wrapped entry point cannot be bound: replay refuses it when the forward runs
(see :func:`unbound_checkpoint_on_stack`) and refuses any unbound recomputation during backward.
"""

from __future__ import annotations

import inspect
import sys
import types
from contextvars import ContextVar
from typing import NamedTuple

import torch

from ..undo import UndoStack
from .errors import RoutingReplayError

__all__ = [
    "RoutingReplayError",
    "RecomputeFrame",
    "bind_checkpoint_fn",
    "is_bound",
    "active_frames",
    "unbound_checkpoint_on_stack",
    "MARK",
]

#: instance attribute of a router module while a record/replay block drives it (value: the session)
MARK = "_modelpatch_routing_session"
_BOUND = "_modelpatch_routing_bound"


def ignore_indices(idx) -> None:
    return None


class _Active(NamedTuple):
    frame: RecomputeFrame
    recompute: bool
    parent: _Active | None


# The frames whose function is running in this thread / task, innermost first (set and reset by ``run`` around
# its own synchronous call, so it is right in autograd's worker threads too).
_ACTIVE: ContextVar[_Active | None] = ContextVar("modelpatch_routing_recompute", default=None)


class RecomputeFrame:
    """The routes used by the router calls of one checkpointed function call, in call order per router."""

    __slots__ = ("function", "routes", "cursor", "ran", "__weakref__")

    def __init__(self, function) -> None:
        self.function = function
        self.routes: dict[torch.nn.Module, tuple[object, list[torch.Tensor | None]]] = {}
        self.cursor: dict[torch.nn.Module, int] = {}
        self.ran = False

    def add(self, site, forced: torch.Tensor | None) -> None:
        self.routes.setdefault(site.module, (site, []))[1].append(forced)

    def take(self, site) -> torch.Tensor | None:
        entry = self.routes.get(site.module)
        i = self.cursor.get(site.module, 0)
        if entry is None or i >= len(entry[1]):
            raise RoutingReplayError(
                f"layer {site.layer_idx}: the recomputed forward (activation checkpointing) called the router "
                f"{i + 1} time(s), its original forward {0 if entry is None else len(entry[1])}; the recomputation "
                "does not follow the forward it recomputes"
            )
        self.cursor[site.module] = i + 1
        return entry[1][i]

    def run(self, *args, **kwargs):
        recompute = self.ran
        self.ran = True
        with UndoStack() as undo:  # routers driven, and this frame active, for the length of this run only
            if recompute:
                self.cursor.clear()
                self._drive_idle_routers(undo)
            undo.callback(_ACTIVE.reset, _ACTIVE.set(_Active(self, recompute, _ACTIVE.get())))
            return self.function(*args, **kwargs)

    def _drive_idle_routers(self, undo: UndoStack) -> None:
        """Routers of this frame that no block drives now (the block exited before the backward): give them,
        for the length of the recomputation, an instance ``forward`` that replays the frame's routes (pushed on
        ``undo``, which the caller undoes when the recomputation ends)."""
        for router, (site, routes) in self.routes.items():
            if router.__dict__.get(MARK) is not None or all(r is None for r in routes):
                continue
            original = router.forward

            def forward(*args, _site=site, _orig=original, **kwargs):
                source, originals = active_frames()
                if source is None:
                    return _orig(*args, **kwargs)
                forced = source.take(_site)
                for frame in originals:
                    frame.add(_site, forced)
                return _site.kind.call(_site, _orig, args, kwargs, forced, ignore_indices)

            undo.setattr(router, "forward", forward, raw=True)


_RUN_CODE = RecomputeFrame.run.__code__


def active_frames() -> tuple[RecomputeFrame | None, list[RecomputeFrame]]:
    """``(source, originals)``: the innermost frame being recomputed (``None`` if none), and the frames inside
    it running their original forward (they record whatever the router uses now)."""
    node = _ACTIVE.get()
    originals: list[RecomputeFrame] = []
    while node is not None:
        if node.recompute:
            return node.frame, originals
        originals.append(node.frame)
        node = node.parent
    return None, originals


def bind_checkpoint_fn(fn):
    """``fn`` (a checkpoint function ``fn(function, *args, **kwargs)``) made to checkpoint a new frame's ``run``."""
    if getattr(fn, _BOUND, False):
        return fn

    def checkpoint_bound(function, *args, **kwargs):
        return fn(RecomputeFrame(function).run, *args, **kwargs)

    checkpoint_bound.__wrapped__ = fn  # type: ignore[attr-defined]
    setattr(checkpoint_bound, _BOUND, True)
    return checkpoint_bound


def is_bound(fn) -> bool:
    return bool(getattr(fn, _BOUND, False))


def _checkpoint_codes() -> frozenset:
    import torch.utils.checkpoint as ckpt

    return frozenset({inspect.unwrap(ckpt.checkpoint).__code__})


_CKPT_CODES: frozenset | None = None


_TOP_SAVED_TENSORS_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # noqa: SLF001 - the saved-tensor hooks in force (no public getter)


def unbound_checkpoint_on_stack() -> bool:
    """Whether the caller runs inside a ``torch.utils.checkpoint.checkpoint`` call that no frame's ``run`` sits
    in (a checkpoint modelpatch could not bind: its recomputation would route with whatever the router does
    then). Walks the Python stack (about 10 microseconds), unless grad mode is on and no saved-tensors hook is
    set, which rules out both kinds of checkpoint (reentrant runs its forward without grad, non-reentrant under
    its saved-tensors hooks)."""
    if torch.is_grad_enabled() and _TOP_SAVED_TENSORS_HOOKS is not None:
        try:
            if _TOP_SAVED_TENSORS_HOOKS(False) is None:
                return False
        except Exception:  # noqa: BLE001 - private API changed: walk the stack
            pass
    global _CKPT_CODES
    if _CKPT_CODES is None:
        _CKPT_CODES = _checkpoint_codes()
    codes = _CKPT_CODES
    pending = 0
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code is _RUN_CODE:
            pending += 1
        elif code in codes:
            if not pending:
                return True
            pending -= 1
        f = f.f_back
    return False
