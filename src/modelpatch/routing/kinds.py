"""Router math, one implementation per *kind* of router.

Replay follows Megatron-LM's router replay / R3 (arXiv 2510.11370): the expert indices are forced, the
routing weights are gathered from the *full* score distribution the live router computes (softmax or
sigmoid, whatever the family does) and then normalised exactly as the family normalises them
(``norm_topk_prob``, ``routed_scaling_factor``, softmax over the selected logits...). Selection-only terms
(DeepSeek-style ``e_score_correction_bias``, group-limited routing) therefore never reach the weights.

Kinds:

``TOPK`` (:class:`TopKSelection`)
    Every router whose expert choice is one ``torch.topk(scores, top_k, dim=-1)`` over a ``(tokens,
    num_experts)`` score tensor. The family's own ``forward`` runs unchanged; a
    :class:`torch.overrides.TorchFunctionMode` active only for the duration of that one router call swaps the
    result of that single ``topk`` for ``(scores.gather(-1, forced), forced)``. Whatever the family computes
    before the ``topk`` (softmax, sigmoid, bias for selection, group masking) and after it (renormalisation,
    scaling, softmax over the selected values, gathering from the unbiased scores) is the family's own code,
    so the weights are normalised exactly as that family does. Router logits keep their original meaning.

``SPARSEMIXER`` (:class:`SparseMixerSelection`)
    PhiMoE's sparsemixer (arXiv 2409.12136): two successive arg-max steps, each with a threshold mask relative
    to the chosen score and a masked softmax. Replay re-runs the same equations with the chosen expert of each
    step forced, so the threshold is taken relative to the forced expert's score (for natural indices this is
    the original computation bit for bit; for forced ones the forced expert is never masked out, its weight is
    > 0 and gradients reach the router).

``HASH_LOOKUP`` (:class:`HashLookupSelection`)
    DeepSeek-V4's hash routers (``DeepseekV4HashRouter``, the ``"hash_moe"`` layers): the experts are a lookup
    ``tid2eid[input_ids]`` in a frozen token-id -> expert-ids table, the learned gate only weights them. As for
    ``TOPK``, the family's ``forward`` runs unchanged; a :class:`~torch.overrides.TorchFunctionMode` swaps the
    result of that one lookup (an indexing of the router's own table, found by identity) for the forced ids, and
    the family gathers and normalises their scores. Recording reads the lookup. The routes of such a layer depend
    only on the token ids and the table, so replay differs from natural routing only where the table or the
    tokens changed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from .errors import RouterContractError

__all__ = [
    "RouterKind",
    "TopKSelection",
    "SparseMixerSelection",
    "HashLookupSelection",
    "TOPK",
    "SPARSEMIXER",
    "HASH_LOOKUP",
    "FAMILY_KINDS",
    "ROUTER_KINDS",
    "UNSUPPORTED_FAMILIES",
    "kind_for_family",
    "kind_for_router",
    "RouterContractError",
]


def merge_forced(natural: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Rows of ``forced`` equal to -1 ("no route") take the natural choice of the live router."""
    forced = forced.to(natural.device)
    free = forced[..., :1] < 0
    if not bool(free.any()):
        return forced.clone()  # the family's code owns its indices; never hand out the trace's storage
    return torch.where(free, natural, forced)


class RouterKind:
    """Strategy for one kind of router math.

    ``call(site, forward, args, kwargs, forced, sink)`` runs one router call: ``forward`` is the router's
    original bound forward; ``forced`` is ``None`` (record / plain) or a LongTensor ``(tokens, top_k)`` of
    expert ids with ``-1`` rows meaning "route naturally"; ``sink`` receives the LongTensor ``(tokens, top_k)``
    of the experts actually used; ``natural_sink`` (replay only, kinds that can tell) receives the indices the live
    router would have chosen, for drift measures. Returns the router's output with the family's own output
    contract.
    """

    name = "abstract"

    def call(
        self,
        site,
        forward: Callable,
        args,
        kwargs,
        forced: torch.Tensor | None,
        sink: Callable,
        natural_sink: Callable | None = None,
    ) -> object:
        raise NotImplementedError


def is_router_topk(func, args: tuple, kwargs: dict, top_k: int, num_experts: int) -> bool:
    """Whether a ``__torch_function__`` call is the router's expert choice: ``torch.topk(scores, top_k, dim=-1)``
    (largest) over ``(tokens, num_experts)`` scores. The one matching rule of eager and compiled routing."""
    if func is not torch.topk and func is not torch.Tensor.topk:
        return False
    inp = args[0]
    k = args[1] if len(args) > 1 else kwargs.get("k")
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    return bool(k == top_k and largest and inp.dim() == 2 and inp.shape[-1] == num_experts and dim in (-1, 1))


class _RoutingTopKMode(TorchFunctionMode):
    def __init__(self, site, forced: torch.Tensor | None):
        super().__init__()
        self.num_experts = site.num_experts
        self.top_k = site.top_k
        self.forced = forced
        self.indices: torch.Tensor | None = None
        self.natural: torch.Tensor | None = None  # what the live router chose (before forcing)
        self.hits = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_router_topk(func, args, kwargs, self.top_k, self.num_experts):
            inp = args[0]
            self.hits += 1
            out = func(*args, **kwargs)
            self.natural = out[1]
            if self.forced is None:
                self.indices = out[1]
                return out
            if self.forced.shape != out[1].shape:
                raise RouterContractError(
                    f"expected forced indices of shape {tuple(out[1].shape)} (tokens, top_k), "
                    f"received {tuple(self.forced.shape)}"
                )
            idx = merge_forced(out[1], self.forced)
            self.indices = idx
            return torch.return_types.topk((_floor_probabilities(inp, inp.gather(-1, idx)), idx))
        return func(*args, **kwargs)


_INDEX_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _check_returned_ids(site, out: object, indices: torch.Tensor) -> None:
    """Refuse a router whose output carries expert ids other than those of its routing top-k (``indices``,
    ``(tokens, top_k)``): the MoE block combines the experts the router *returns*, so a trace of the top-k's
    ids would not be what the block used, and forcing the top-k would not force the block.

    The output's integer tensors of ``tokens * top_k`` elements are the candidates; the tensor the top-k
    returned itself (the stock routers) is accepted without a comparison (no device sync). With one other
    candidate its top-k *sets* must equal ``indices``' (the order within a top-k does not change the combine).

    Raises:
        RouterContractError: the router returns other expert ids than its top-k chose.
    """
    if torch.compiler.is_compiling():
        return
    outs = out if isinstance(out, (tuple, list)) else (out,)
    tokens, top_k = indices.shape[0], indices.shape[-1]
    candidates = [
        t
        for t in outs
        if isinstance(t, torch.Tensor) and t.dtype in _INDEX_DTYPES and t.numel() == tokens * top_k and t.dim() >= 1
    ]
    if len(candidates) != 1 or candidates[0] is indices or candidates[0].shape[-1] != top_k:
        return
    returned = candidates[0].reshape(tokens, top_k).long().sort(dim=-1).values
    differs = (returned != indices.long().sort(dim=-1).values).any(dim=-1)
    if bool(differs.any()):
        token = int(differs.nonzero()[0])
        raise RouterContractError(
            f"layer {site.layer_idx} ({type(site.module).__name__}): the router returns other expert ids than its "
            f"torch.topk chose ({int(differs.sum())} of {tokens} tokens; first token {token}: returns "
            f"{returned[token].tolist()}, topk {sorted(indices[token].tolist())}): a routing record or replay "
            "would not be the experts its MoE block uses"
        )


def _floor_probabilities(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Keep forced weights gathered from probabilities (softmax/sigmoid, all >= 0) above zero.

    A router that drifted far from the one that chose the recorded experts can give them probabilities
    that underflow to 0; the family's own ``p / p.sum()`` (``norm_topk_prob``) is then 0/0 and the loss or
    the router gradients become NaN. Flooring at the smallest normal float changes nothing else (natural
    top-k probabilities are >= 1/num_experts); the floored entries get zero gradient, the others keep
    theirs. Raw logits (which can be negative) are left as they are: a softmax over them cannot underflow
    to 0/0.
    """
    if not values.is_floating_point() or bool((scores < 0).any()):
        return values
    return values.clamp_min(torch.finfo(values.dtype).tiny)


class TopKSelection(RouterKind):
    """Routers that choose experts with one ``torch.topk(scores, top_k, dim=-1)`` (see module docstring)."""

    name = "topk"

    def call(self, site, forward, args, kwargs, forced, sink, natural_sink=None):
        mode = _RoutingTopKMode(site, forced)
        with mode:
            out = forward(*args, **kwargs)
        if mode.hits != 1:
            raise RouterContractError(
                f"layer {site.layer_idx} ({type(site.module).__name__}): expected exactly one top-k over "
                f"{site.num_experts} experts with k={site.top_k} in the router forward, saw {mode.hits}"
            )
        if mode.indices is not None:  # one hit sets it
            _check_returned_ids(site, out, mode.indices)
        sink(mode.indices)
        if natural_sink is not None and forced is not None:
            natural_sink(mode.natural)
        return out


def _forced_sparsemixer(scores, forced, jitter_eps, training, multiplier_fn):
    """PhiMoE's ``sparsemixer`` with the arg-max of each of its two steps replaced by ``forced[:, step]``.

    Args:
        scores: router logits ``(tokens, num_experts)``.
        forced: LongTensor ``(tokens, 2)`` of expert ids (no ``-1`` left).
    Returns:
        ``(multiplier (tokens, 2), selected_experts (tokens, 2))`` as ``sparsemixer`` returns them.
    """
    multipliers = []
    current = scores
    for step in range(2):
        selected = forced[:, step : step + 1]
        with torch.no_grad():
            threshold = current.gather(-1, selected)
            factor = scores.abs().clamp(min=threshold)
            mask = ((threshold - scores) / factor) > (2 * jitter_eps)
        masked_gates = torch.softmax(current.masked_fill(mask, float("-inf")), dim=-1)
        multiplier = masked_gates.gather(dim=-1, index=selected)
        if training:
            max_scores, max_ind = masked_gates.max(dim=-1, keepdim=True)
            mask_for_one = torch.logical_or(selected == max_ind, torch.rand_like(max_scores) > 0.75)
            mask_for_one = torch.add(0.3333, mask_for_one, alpha=0.6667).type_as(masked_gates)
            multiplier = multiplier_fn(scores, multiplier, selected, masked_gates, mask_for_one)
        multipliers.append(multiplier)
        if step == 0:
            current = torch.scatter(scores, -1, selected, float("-inf"))
    return torch.cat(multipliers, dim=-1), forced


class SparseMixerSelection(RouterKind):
    """PhiMoE's sparsemixer router (top-2 by two masked arg-max steps; see module docstring)."""

    name = "sparsemixer"

    def call(self, site, forward, args, kwargs, forced, sink, natural_sink=None):
        router = site.module
        if forced is None:
            out = forward(*args, **kwargs)
            sink(out[2])
            return out
        if site.top_k != 2:
            raise RouterContractError(
                f"layer {site.layer_idx}: sparsemixer routes top-2, router has top_k={site.top_k}"
            )
        # PhimoeMultiplier (the training-time gradient estimator) lives in the router's modeling module; look
        # through a dynamic subclass (FSDP2) to find it.
        modeling = next(sys.modules[c.__module__] for c in type(router).__mro__ if "modeling_" in c.__module__)
        forced = forced.to(router.weight.device)
        free = forced[:, :1] < 0
        if bool(free.any()):
            natural = forward(*args, **kwargs)[2]
            forced = torch.where(free, natural, forced)
        hidden_states = args[0] if args else kwargs["hidden_states"]
        if router.training and router.input_jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - router.input_jitter_noise, 1.0 + router.input_jitter_noise
            )
        router_logits = torch.nn.functional.linear(hidden_states, router.weight, router.bias)
        weights, selected = _forced_sparsemixer(
            router_logits, forced, router.router_jitter_noise, router.training, modeling.PhimoeMultiplier.apply
        )
        sink(selected)
        return router_logits, weights, selected


class _TableLookupMode(TorchFunctionMode):
    def __init__(self, table: torch.Tensor, forced: torch.Tensor | None):
        super().__init__()
        self.table = table
        self.forced = forced
        self.indices: torch.Tensor | None = None
        self.hits = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and args and args[0] is self.table:
            self.hits += 1
            out = func(*args, **kwargs)
            if self.forced is None:
                self.indices = out.long()
                return out
            if self.forced.shape != out.shape:
                raise RouterContractError(
                    f"expected forced indices of shape {tuple(out.shape)} (tokens, top_k), "
                    f"received {tuple(self.forced.shape)}"
                )
            self.indices = merge_forced(out.long(), self.forced)
            return self.indices.to(out.dtype)
        return func(*args, **kwargs)


class HashLookupSelection(RouterKind):
    """Routers whose experts are one lookup in a token-id -> expert-ids table (see module docstring).

    Args:
        table: name of the router's buffer holding the table, ``(vocab_size, top_k)`` of expert ids.
    """

    name = "hash-lookup"

    def __init__(self, table: str) -> None:
        self.table = table

    def call(self, site, forward, args, kwargs, forced, sink, natural_sink=None):
        table = getattr(site.module, self.table, None)
        if not isinstance(table, torch.Tensor):
            raise RouterContractError(
                f"layer {site.layer_idx} ({type(site.module).__name__}): no {self.table!r} table of expert ids"
            )
        mode = _TableLookupMode(table, forced)
        with mode:
            out = forward(*args, **kwargs)
        if mode.hits != 1:
            raise RouterContractError(
                f"layer {site.layer_idx} ({type(site.module).__name__}): expected exactly one lookup in its "
                f"{self.table!r} table in the router forward, saw {mode.hits}"
            )
        sink(mode.indices)
        return out


TOPK = TopKSelection()
SPARSEMIXER = SparseMixerSelection()
HASH_LOOKUP = HashLookupSelection("tid2eid")

#: Family (Transformers ``model_type`` of the modeling module defining the router class) -> router kind.
#: Families not listed use ``TOPK``; the coverage test (tests/test_routing_coverage.py) checks every family of
#: the installed Transformers against this and regenerates the support table in README.md.
#: Comments give each router's math as read in Transformers 5.23.
FAMILY_KINDS: dict[str, RouterKind] = {
    # softmax over all experts -> topk -> optional renormalisation (norm_topk_prob)
    "qwen2_moe": TOPK,
    "qwen3_moe": TOPK,
    "qwen3_next": TOPK,
    "olmoe": TOPK,
    "flex_olmo": TOPK,
    "qwen3_vl_moe": TOPK,
    "qwen3_omni_moe": TOPK,
    "qwen3_5_moe": TOPK,
    # softmax -> topk -> always renormalised
    "mixtral": TOPK,
    "minimax": TOPK,
    # softmax -> topk, weights left unnormalised
    "jamba": TOPK,
    # topk over raw logits -> softmax over the k selected logits
    "granitemoe": TOPK,
    "granitemoeshared": TOPK,
    "granitemoehybrid": TOPK,
    "gpt_oss": TOPK,
    # sigmoid; selection on sigmoid + e_score_correction_bias with group-limited masking; weights gathered from
    # the unbiased sigmoid, optionally renormalised, times routed_scaling_factor
    "deepseek_v3": TOPK,
    "glm4_moe": TOPK,
    "glm4v_moe": TOPK,
    "dots1": TOPK,
    "kimi_linear": TOPK,
    # PhiMoE sparsemixer
    "phimoe": SPARSEMIXER,
}

#: Router classes (Transformers class name) whose kind differs from the rest of their family; takes precedence over
#: :data:`FAMILY_KINDS`.
ROUTER_KINDS: dict[str, RouterKind] = {
    # DeepSeek-V4: "hash_moe" layers look their experts up by token id; its other MoE layers are TOPK
    "DeepseekV4HashRouter": HASH_LOOKUP,
}

#: Families whose router is not a top-k router at all (reason shown in the support table).
UNSUPPORTED_FAMILIES: dict[str, str] = {
    "switch_transformers": "top-1 arg-max router with expert capacity (token dropping), no top-k",
    "nllb_moe": "top-2 router with expert capacity and random second-expert policy, no top-k",
    "doge": (
        "product-key expert retrieval inside DogeCDMoE, no router module: experts are a top-k over the sums of "
        "two top-k's over key halves, and the router logits are split along the token axis (view(2, tokens, -1)), "
        "so a token's experts depend on other tokens of the batch"
    ),
    "zaya": (
        "top-1 over num_experts + 1 classes of (batch, seq, classes) scores, the last class a compute-free skip "
        "expert that the router masks to expert 0 with weight 0: a route would have to record the skip class"
    ),
}


def kind_for_family(family: str) -> RouterKind:
    """Router kind for a Transformers ``model_type`` (``TOPK`` unless listed in :data:`FAMILY_KINDS`)."""
    return FAMILY_KINDS.get(family, TOPK)


def kind_for_router(router_class: str, family: str) -> RouterKind:
    """Router kind for a Transformers router class of ``family``: :data:`ROUTER_KINDS`, else
    :func:`kind_for_family`."""
    return ROUTER_KINDS.get(router_class) or kind_for_family(family)
