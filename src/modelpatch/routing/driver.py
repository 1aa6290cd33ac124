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

:class:`SessionDriver` is what the record and replay sessions share: router discovery, installing and undoing the
per-instance changes, the layout hooks, and the dispatch of each router call (checkpoint recomputation first).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ModelpatchRuntimeError
from ..undo import UndoStack
from .compiled import (
    HANDLERS,
    compiled_owner_info,
    compiled_owner_post_forward,
    compiled_owner_pre_forward,
    compiled_router_call,
    compiled_router_info,
)
from .layout import ForwardLayout, layout_from_call, signature_binder
from .recompute import MARK as _MARK
from .recompute import (
    RecomputeFrame,
    active_frames,
    bind_checkpoint_fn,
    ignore_indices,
    is_bound,
)
from .sites import RouterSite, find_router_sites, stack_owner, submodule

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["SessionDriver", "CHECKPOINT_HINT", "in_backward", "module_device"]


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
    return session._router_call(site, getattr(router, _ORIGINAL), args, kwargs)  # noqa: SLF001 - same module: the router forward installed by the driver


def _owner_pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if torch.compiler.is_compiling():
        compiled_owner_pre_forward(getattr(module, _COMPILED), args, kwargs)
        return None
    HANDLERS[id(module)]._pre_forward(module, args, kwargs)  # noqa: SLF001 - same module: the hooks installed by the driver
    return None


def _owner_post_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    if torch.compiler.is_compiling():
        compiled_owner_post_forward(getattr(module, _COMPILED))
        return None
    session = HANDLERS.get(id(module))
    if session is not None:
        session._post_forward(module, args, kwargs, output)  # noqa: SLF001 - same module: the hooks installed by the driver
    return None


CHECKPOINT_HINT = (
    "checkpoint the decoder layers with model.gradient_checkpointing_enable() / "
    "activation_checkpointing_enable() or torch's checkpoint_wrapper (CheckpointWrapper), which replay binds"
)


def in_backward() -> bool:
    # Activation-checkpoint recomputation (reentrant or not) runs inside the autograd engine.
    return torch._C._current_graph_task_id() != -1  # noqa: SLF001 - autograd's only test for a running backward


class SessionDriver:
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
        self._last_seqs: list[int] = []
        # modules that may carry a checkpoint function around a router: every ancestor of every router
        hosts: dict[int, nn.Module] = {id(model): model}
        for s in self.sites:
            m = model
            for part in s.name.split(".")[:-1]:  # one level at a time (not get_submodule of each prefix)
                m = submodule(m, part)
                hosts.setdefault(id(m), m)
        self._hosts = list(hosts.values())

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
        if in_backward():
            return None
        self._bind_checkpoints()  # checkpointing may have been enabled inside the block
        layout = layout_from_call(module, args, kwargs, self._sig)
        self._assign(layout)
        self.layout = layout
        return None

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not in_backward():
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
        if in_backward():  # recomputed by a checkpoint no frame is bound to
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
                # undo puts ``fn`` back only where our wrapper is still in place: a checkpoint function the user
                # replaced (or deleted) inside the block is theirs, and stays
                self._undo.wrap(host, attr, bind_checkpoint_fn(fn), raw=True)

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
            self._undo.callback(owner.register_forward_pre_hook(_owner_pre_hook, with_kwargs=True).remove)
            # not always_call: Dynamo guards on the handle ids of always-called hooks (a recompile per block)
            self._undo.callback(owner.register_forward_hook(_owner_post_hook, with_kwargs=True).remove)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks and undo every change to the model (idempotent)."""
        self.layout = None
        self._undo.undo()


def module_device(module: nn.Module) -> torch.device:
    """The device of the router's first parameter (its own ones first: no generator over the subtree); CPU if it
    has none."""
    for p in module._parameters.values():
        if p is not None:
            return p.device
    return next(iter(module.parameters()), torch.empty(0)).device
