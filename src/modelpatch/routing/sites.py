"""Discovery of the routers of a model instance.

A *router site* is one router module of a loaded model together with what routing needs to know about it:
the decoder layer it belongs to, its number of experts, its top-k and the *kind* of router math it uses
(see :mod:`modelpatch.routing.kinds`).  Discovery only reads the module tree; it never mutates it.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .errors import RoutingDiscoveryError
from .kinds import UNSUPPORTED_FAMILIES, RouterKind, kind_for_router

__all__ = ["RouterSite", "find_router_sites", "RoutingDiscoveryError"]

# n_routed_experts first: LongCat counts its zero-computation experts there, and its top-k runs over them too
_EXPERT_ATTRS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_topk", "moe_k", "k")
_LAYER_RE = re.compile(r"^(?P<stack>(?:.*\.)?[A-Za-z_]\w*)\.(?P<idx>\d+)(?:\.|$)")


@dataclass(frozen=True)
class RouterSite:
    """One router of a model instance.

    Attributes:
        name: qualified module name inside the model (e.g. ``"model.layers.3.mlp.gate"``).
        module: the router module itself.
        layer_idx: index of the decoder layer holding the router (key of the routing trace).
        num_experts: number of routed experts the router chooses from.
        top_k: experts chosen per token.
        family: Transformers ``model_type`` of the modeling module that defines the router class.
        kind: the router-math kind that records and replays it.
    """

    name: str
    module: nn.Module
    layer_idx: int
    num_experts: int
    top_k: int
    family: str
    kind: RouterKind


def _first_int_attr(module: nn.Module, names) -> int | None:
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _family_of(cls: type) -> str:
    m = re.match(r"transformers\.models\.([\w]+)\.modeling_", cls.__module__)
    return m.group(1) if m else cls.__module__


_ROUTER_SUFFIXES = ("Router", "Gate", "Gating")


def _is_router_class(cls: type) -> bool:
    # "Router" classes must be routers; "Gate"/"Gating" classes (HunYuan, JetMoE) count only when they carry a
    # top-k and a number of experts (checked in _discover).
    return cls.__name__.endswith(_ROUTER_SUFFIXES) and cls.__module__.startswith("transformers.models.")


_ROUTER_BASE: dict[type, type | None] = {}
_SITES_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def _router_base(cls: type) -> type | None:
    """The Transformers router class of ``cls`` (through FSDP2's dynamic subclass), memoised per class."""
    try:
        return _ROUTER_BASE[cls]
    except KeyError:
        base = _ROUTER_BASE[cls] = next((c for c in cls.__mro__ if _is_router_class(c)), None)
        return base


def find_router_sites(model: nn.Module) -> tuple[list[RouterSite], str, int]:
    """Find every top-k router of ``model``.

    Args:
        model: any Transformers model instance (a bare ``nn.Module`` wrapper such as DDP is accepted too).

    Returns:
        ``(sites, stack_name, num_layers)``: the routers sorted by decoder layer index, the qualified name of
        the ``nn.ModuleList`` of decoder layers holding them, and that list's length (all hidden layers).

    Raises:
        RoutingDiscoveryError: no router found, routers spread over several layer stacks, two routers in the
            same decoder layer, a router whose number of experts / top-k cannot be read, or a family listed in
            :data:`~modelpatch.routing.kinds.UNSUPPORTED_FAMILIES` (the message gives the reason).
    """
    cached = _SITES_CACHE.get(model)
    if cached is not None:
        sites = cached[0]
        try:  # still the same routers at the same places, and no other router (one walk, no names)?
            if all(submodule(model, s.name) is s.module and _router_base(type(s.module)) for s in sites):
                if _count_routers(model) == len(sites):
                    return list(sites), cached[1], cached[2]
        except AttributeError:
            pass
    result = _discover(model)
    _SITES_CACHE[model] = (tuple(result[0]), result[1], result[2])
    return result


def submodule(model: nn.Module, name: str) -> nn.Module:
    """``model.get_submodule(name)``, through the ``_modules`` dictionaries where they hold the names (about ten
    times faster; every record / replay block resolves its routers and their ancestors).

    Raises:
        AttributeError: as ``get_submodule``, if ``name`` is not a submodule.
    """
    module = model
    for part in name.split(".") if name else ():
        child = module._modules.get(part)
        module = child if child is not None else module.get_submodule(part)
    return module


def _count_routers(model: nn.Module) -> int:
    """The number of distinct router modules in ``model`` (what ``model.modules()`` walks, without building
    names)."""
    seen: set[int] = set()
    stack = [model]
    count = 0
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if _router_base(type(module)) is not None:
            count += 1
        stack.extend(child for child in module._modules.values() if child is not None)
    return count


def _discover(model: nn.Module) -> tuple[list[RouterSite], str, int]:
    sites: list[RouterSite] = []
    stacks: set[str] = set()
    for name, module in model.named_modules():
        # FSDP2 swaps in a dynamic subclass: look through it to the Transformers class.
        base = _router_base(type(module))
        if base is None:
            continue
        m = _LAYER_RE.match(name)
        if m is None:
            raise RoutingDiscoveryError(f"router {name!r} ({base.__name__}) is not inside a numbered layer stack")
        num_experts = _first_int_attr(module, _EXPERT_ATTRS)
        if num_experts is None:  # fall back to the router projection's output size
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor):
                weight = getattr(getattr(module, "classifier", None), "weight", None)
            if not isinstance(weight, torch.Tensor):
                weight = getattr(getattr(module, "layer", None), "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                num_experts = int(weight.shape[0])
        top_k = _first_int_attr(module, _TOP_K_ATTRS)
        if (num_experts is None or top_k is None) and not base.__name__.endswith("Router"):
            continue  # a gate that is not a top-k router
        if num_experts is None or top_k is None:
            raise RoutingDiscoveryError(
                f"router {name!r} ({base.__name__}): cannot read its number of experts and top-k "
                f"(looked for {_EXPERT_ATTRS} and {_TOP_K_ATTRS})"
            )
        family = _family_of(base)
        if family in UNSUPPORTED_FAMILIES:
            raise RoutingDiscoveryError(
                f"router {name!r} ({base.__name__}) is not supported: {UNSUPPORTED_FAMILIES[family]}"
            )
        stacks.add(m.group("stack"))
        kind = kind_for_router(base.__name__, family)
        sites.append(RouterSite(name, module, int(m.group("idx")), num_experts, top_k, family, kind))
    if not sites:
        family = _family_of(type(model))
        if family in UNSUPPORTED_FAMILIES:
            raise RoutingDiscoveryError(f"{type(model).__name__} is not supported: {UNSUPPORTED_FAMILIES[family]}")
        raise RoutingDiscoveryError(
            f"{type(model).__name__} has no top-k router module (a Transformers class named *Router, or *Gate / "
            "*Gating with top_k and num_experts attributes)"
        )
    if len(stacks) > 1:
        raise RoutingDiscoveryError(f"routers found in several layer stacks {sorted(stacks)}; only one is supported")
    sites.sort(key=lambda s: s.layer_idx)
    for a, b in zip(sites, sites[1:]):
        if a.layer_idx == b.layer_idx:
            raise RoutingDiscoveryError(
                f"two routers in decoder layer {a.layer_idx} ({a.name!r} and {b.name!r}): a routing trace holds the "
                "routes of one router per decoder layer (keyed by layer index)"
            )
    stack_name = stacks.pop()
    stack = model.get_submodule(stack_name)
    num_layers = len(stack) if isinstance(stack, (nn.ModuleList, nn.Sequential)) else sites[-1].layer_idx + 1
    return sites, stack_name, num_layers


def stack_owner(model: nn.Module, stack_name: str) -> nn.Module:
    """The module owning the decoder-layer list (its forward sees input ids, attention mask, position ids)."""
    parent = stack_name.rpartition(".")[0]
    return submodule(model, parent) if parent else model
