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
from torch.overrides import TorchFunctionMode

from .errors import RoutingDiscoveryError
from .kinds import UNSUPPORTED_FAMILIES, RouterKind, kind_for_router

__all__ = ["RouterSite", "find_router_sites", "experts_count", "probe_top_k", "RoutingDiscoveryError"]

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
_UNSEEN = object()
_SITES_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def _router_base(cls: type) -> type | None:
    """The Transformers router class of ``cls`` (through FSDP2's dynamic subclass), memoised per class."""
    try:
        return _ROUTER_BASE[cls]
    except KeyError:
        base = _ROUTER_BASE[cls] = next((c for c in cls.__mro__ if _is_router_class(c)), None)
        return base


def experts_count(module: nn.Module) -> int | None:
    """The number of experts of an *experts module*, read from its structure, or ``None`` if it is not one.

    An experts module holds one set of weights per expert: fused 3-D parameters of its own whose first
    dimension (the expert axis, >= 2) they share (Transformers' ``@use_experts_implementation`` classes), or an
    ``nn.ModuleList`` of >= 2 modules of one class with parameters (per-expert modules, e.g. modelpatch's linear
    experts).
    """
    if isinstance(module, nn.ModuleList):
        kinds = {type(m) for m in module}
        if len(module) >= 2 and len(kinds) == 1 and any(True for _ in module[0].parameters()):
            return len(module)
        return None
    counts = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
    if len(counts) == 1 and (count := counts.pop()) >= 2:
        return int(count)
    return None


def _projection_rows(module: nn.Module, experts: int | None) -> int | None:
    """The number of scores a router module computes: the rows of its projection, a 2-D parameter of its subtree
    (``weight``, ``classifier.weight``, ``linear.weight``, ...). With ``experts`` known (the count of a sibling
    experts module), a projection with that many rows; otherwise the rows of its only 2-D parameter."""
    rows = [int(p.shape[0]) for p in module.parameters() if p.dim() == 2]
    if experts is not None and experts in rows:
        return experts
    return rows[0] if len(rows) == 1 else None


def _in_features(module: nn.Module, rows: int) -> int | None:
    return next((int(p.shape[1]) for p in module.parameters() if p.dim() == 2 and p.shape[0] == rows), None)


def probe_top_k(module: nn.Module, num_experts: int) -> int | None:
    """The ``k`` of the one ``torch.topk`` over ``num_experts`` scores that ``module``'s forward computes, or
    ``None`` (no such top-k, several, or the forward does not take one ``(tokens, hidden)`` tensor).

    The forward runs once on the ``meta`` device (its parameters and buffers swapped for meta tensors of the same
    shapes through :func:`torch.func.functional_call`, input ``(3, in_features)``): no memory, no computation, the
    module and its tensors untouched.
    """
    hidden = _in_features(module, num_experts)
    if hidden is None:
        return None
    seen: list[int] = []

    class _TopK(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.topk or func is torch.Tensor.topk:
                inp = args[0]
                k = args[1] if len(args) > 1 else kwargs.get("k")
                dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
                if isinstance(k, int) and dim in (-1, inp.dim() - 1) and inp.shape[-1] == num_experts:
                    seen.append(k)
            return func(*args, **kwargs)

    tensors = {n: torch.empty_like(t, device="meta") for n, t in (*module.named_parameters(), *module.named_buffers())}
    x = torch.empty(3, hidden, device="meta", dtype=next(iter(tensors.values())).dtype)
    try:
        with torch.no_grad(), _TopK():
            torch.func.functional_call(module, tensors, (x,))
    except Exception:  # noqa: BLE001 - a module whose forward needs other inputs is not a router found this way
        return None
    return seen[0] if len(seen) == 1 and 0 < seen[0] <= num_experts else None


def find_router_sites(model: nn.Module) -> tuple[list[RouterSite], str, int]:
    """Find every top-k router of ``model``.

    A router is found by what it computes, then by name. (1) Structure: in a module that holds an *experts
    module* (:func:`experts_count`: ``E`` experts), a sibling whose projection has ``E`` rows and whose forward
    computes one ``torch.topk`` over those ``E`` scores (:func:`probe_top_k`, on the meta device) is the router
    of those experts, whatever its class or attribute names. (2) Names: a Transformers class named ``*Router``
    (or ``*Gate`` / ``*Gating`` with a top-k and a number of experts), as for routers whose experts live
    elsewhere. Its number of experts is an attribute (``n_routed_experts``, ``num_experts``...) or the rows of its
    projection; its top-k an attribute (``top_k``, ``num_experts_per_tok``...) or what its forward computes.

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
        types = {type(s.module) for s in sites}
        try:  # still the same routers at the same places, and no other router (one walk, no names)?
            if all(submodule(model, s.name) is s.module for s in sites):
                if _count_routers(model, types) == len(sites):
                    return list(sites), cached[1], cached[2]
        except AttributeError:
            pass
    result = _discover(model)
    _SITES_CACHE[model] = (tuple(result[0]), result[1], result[2])
    return result


def _structural_routers(model: nn.Module, named: set[str]) -> dict[str, tuple[int, int]]:
    """``{name: (num_experts, top_k)}`` of the routers found by structure (see :func:`find_router_sites`) in
    the modules holding an experts module and no router found by name."""
    found: dict[str, tuple[int, int]] = {}
    for parent_name, parent in model.named_modules():
        children = list(parent.named_children())
        counts = {n: c for n, child in children if (c := experts_count(child)) is not None}
        if not counts:
            continue
        prefix = f"{parent_name}." if parent_name else ""
        if any(n.startswith(prefix) for n in named):
            continue  # its router has a router's name (and is found by it)
        for child_name, child in children:
            if child_name in counts or isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                continue
            for experts in dict.fromkeys(counts.values()):
                rows = _projection_rows(child, experts)
                if rows != experts:
                    continue
                top_k = probe_top_k(child, experts)
                if top_k is not None:
                    found[prefix + child_name] = (experts, top_k)
                    break
    return found


def _experts_beside(model: nn.Module, name: str) -> int | None:
    """The number of experts of an experts module next to module ``name`` (same parent), if there is one."""
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    counts = [c for _, child in parent.named_children() if (c := experts_count(child)) is not None]
    return counts[0] if len(counts) == 1 else None


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


def _count_routers(model: nn.Module, types: set[type]) -> int:
    """The number of distinct router modules in ``model``: of one of ``types`` (the routers found before, by name
    or by structure) or of a known router base (what ``model.modules()`` walks, without building names).

    Runs at every record / replay block (it validates the cached discovery), so it is a flat loop over the
    ``_modules`` dictionaries with the class lookups memoised."""
    seen: set[int] = set()
    stack: list[nn.Module | None] = [model]
    pop, extend, add = stack.pop, stack.extend, seen.add
    bases = _ROUTER_BASE
    count = 0
    while stack:
        module = pop()
        if module is None:
            continue
        key = id(module)
        if key in seen:
            continue
        add(key)
        cls = type(module)
        if cls in types:
            count += 1
        else:
            base = bases.get(cls, _UNSEEN)
            if base is _UNSEEN:
                base = _router_base(cls)
            if base is not None:
                count += 1
        extend(module._modules.values())
    return count


def _discover(model: nn.Module) -> tuple[list[RouterSite], str, int]:  # noqa: C901 - one walk over the modules; each branch is one kind of router site or one refusal
    sites: list[RouterSite] = []
    stacks: set[str] = set()
    candidates: list[tuple[str, nn.Module, type, int | None, int | None]] = []
    for name, module in model.named_modules():
        # FSDP2 swaps in a dynamic subclass: look through it to the Transformers class.
        base = _router_base(type(module))
        if base is None:
            continue
        num_experts = _first_int_attr(module, _EXPERT_ATTRS)
        if num_experts is None:  # fall back to the rows of the router's projection
            num_experts = _projection_rows(module, _experts_beside(model, name))
        top_k = _first_int_attr(module, _TOP_K_ATTRS)
        if top_k is None and num_experts is not None:
            top_k = probe_top_k(module, num_experts)
        if (num_experts is None or top_k is None) and not base.__name__.endswith("Router"):
            continue  # a gate that is not a top-k router
        candidates.append((name, module, base, num_experts, top_k))
    named = {c[0] for c in candidates}
    for name, (num_experts, top_k) in _structural_routers(model, named).items():
        module = model.get_submodule(name)
        candidates.append((name, module, type(module), num_experts, top_k))
    for name, module, base, num_experts, top_k in candidates:
        m = _LAYER_RE.match(name)
        if m is None:
            raise RoutingDiscoveryError(f"router {name!r} ({base.__name__}) is not inside a numbered layer stack")
        if num_experts is None or top_k is None:
            raise RoutingDiscoveryError(
                f"router {name!r} ({base.__name__}): cannot read its number of experts and top-k "
                f"(looked for {_EXPERT_ATTRS} and {_TOP_K_ATTRS}, the rows of its projection and a top-k its "
                "forward computes)"
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
            f"{type(model).__name__} has no top-k router module (a module beside an experts module that computes "
            "a top-k over the experts' scores, a Transformers class named *Router, or *Gate / *Gating with top_k "
            "and num_experts attributes)"
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
