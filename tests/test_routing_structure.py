"""Structure of ``modelpatch.routing``: blocks leave router instances exactly as they were (one undo stack), the
sessions read traces through public methods only, the modules import one way, and engine arrays given as
nested Python lists are read as the array they spell."""

from __future__ import annotations

import ast
import copy
import functools
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import modelpatch.routing
from modelpatch.deprecation import MOVED
from modelpatch.errors import ModelpatchError
from modelpatch.routing import (
    RouterContractError,
    RoutingDiscoveryError,
    RoutingReplayError,
    RoutingTrace,
    RoutingTraceError,
    find_router_sites,
    record_routing,
    replay_routing,
)
from routing_models import perturb_routers, tiny_model

_ROUTING = Path(modelpatch.routing.__file__).parent
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
)
_IDS = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
_BASE: dict[str, torch.nn.Module] = {}


def _qwen(**overrides) -> torch.nn.Module:
    key = repr(sorted(overrides.items()))
    if key not in _BASE:
        _BASE[key] = tiny_model("qwen3_moe", **overrides)  # 2 decoder layers, both MoE: 8 experts, top-2
    return copy.deepcopy(_BASE[key])


# -- blocks leave every router / experts module exactly as it was ----------------------------------------------


def _watched(model) -> dict[str, torch.nn.Module]:
    """Every router, every experts module, and every module on the path from the model to a router (where
    checkpoint functions live)."""
    sites = find_router_sites(model)[0]
    names = {""}
    for s in sites:
        parts = s.name.split(".")
        names |= {".".join(parts[:i]) for i in range(len(parts) + 1)}
    names |= {n for n, m in model.named_modules() if type(m).__name__.endswith("Experts")}
    return {n: model.get_submodule(n) for n in sorted(names)}


def _snapshot(model):
    return {
        name: (dict(m.__dict__), {t: dict(getattr(m, t)) for t in _HOOK_TABLES}) for name, m in _watched(model).items()
    }


def _assert_unchanged(model, before) -> None:
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for name, (attrs, hooks) in before.items():
        now_attrs, now_hooks = after[name]
        assert now_attrs.keys() == attrs.keys(), f"{name!r}: {set(now_attrs) ^ set(attrs)}"
        changed = [k for k in attrs if now_attrs[k] is not attrs[k]]
        assert changed == [], f"{name!r}: attributes replaced: {changed}"
        for table, entries in hooks.items():
            assert now_hooks[table].keys() == entries.keys(), f"{name!r}.{table}"
            assert all(now_hooks[table][k] is entries[k] for k in entries), f"{name!r}.{table}"


def _warm(model):
    """Let Transformers install what it installs on first use (output-capture hooks, generation state)."""
    with torch.no_grad():
        model(_IDS, output_router_logits=True)
        model.generate(_IDS[:1, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)


def _routers(model):
    return [s.module for s in find_router_sites(model)[0]]


def test_watched_modules_are_the_routers_experts_and_their_ancestors():
    model = _qwen()
    watched = _watched(model)
    assert sum(type(m).__name__ == "Qwen3MoeTopKRouter" for m in watched.values()) == 2
    assert sum(type(m).__name__.endswith("Experts") for m in watched.values()) == 2
    assert {"", "model", "model.layers", "model.layers.0", "model.layers.1.mlp"} <= watched.keys()


@pytest.mark.parametrize("fails", [False, True], ids=["normal_exit", "exception"])
@pytest.mark.parametrize("what", ["record_forward", "record_generate", "replay_train_step"])
def test_blocks_leave_router_and_experts_modules_exactly_as_before(what, fails):
    model = _qwen()
    _warm(model)
    with torch.no_grad(), record_routing(model) as trace:
        model(_IDS)
    before = _snapshot(model)
    router_dicts = [dict(r.__dict__) for r in _routers(model)]

    def body():
        if what == "record_forward":
            with torch.no_grad(), record_routing(model) as rec:
                model(_IDS, output_router_logits=True)
                inside = [set(r.__dict__) - set(d) for r, d in zip(_routers(model), router_dicts)]
                driven = {
                    "forward",
                    "_modelpatch_routing_session",
                    "_modelpatch_routing_original",
                    "_modelpatch_routing_compiled",
                }
                assert inside == [driven] * 2  # driven per instance...
                assert "generate" in model.__dict__
                if fails:
                    raise KeyError("boom")
            assert rec.sequence_lengths == [9, 9]
        elif what == "record_generate":
            with torch.no_grad(), record_routing(model) as rec:
                model.generate(_IDS[:1, :5], max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
                if fails:  # the guard refuses beam search: the block exits through RoutingTraceError
                    model.generate(_IDS[:1, :5], max_new_tokens=3, num_beams=2, pad_token_id=0)
            assert rec.sequence_lengths == [7]
        else:
            perturb_routers(model)
            with replay_routing(model, trace):
                loss = model(_IDS, labels=_IDS).loss
                loss.backward()
                if fails:
                    raise KeyError("boom")

    if fails:
        with pytest.raises((KeyError, RoutingTraceError)):
            body()
    else:
        body()
    _assert_unchanged(model, before)  # ...and nothing left after the block


def test_backward_after_the_block_leaves_routers_exactly_as_before():
    # a checkpoint recomputed after the block drives idle routers for the length of the recomputation only
    model = _qwen()
    _warm(model)
    with torch.no_grad(), record_routing(model) as trace:
        model(_IDS)
    perturb_routers(model)
    model.train().activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    seen = []
    for router in _routers(model):
        router.register_forward_pre_hook(lambda m, a: seen.append(set(m.__dict__)))  # during the recomputation
    before = _snapshot(model)  # with the witness hooks
    with replay_routing(model, trace):
        loss = model(_IDS, labels=_IDS, use_cache=False).loss
    n_forward = len(seen)
    loss.backward()
    assert n_forward == 2 and len(seen) == 4  # each router ran again in backward...
    assert all("forward" in keys for keys in seen[2:])  # ...driven by the frame's instance forward
    _assert_unchanged(model, before)


def test_a_recomputation_that_raises_leaves_the_routers_as_before():
    from modelpatch.routing.recompute import RecomputeFrame

    model = _qwen()
    site = find_router_sites(model)[0][0]
    before = dict(site.module.__dict__)
    inside = []

    def recomputed():
        inside.append(site.module.__dict__.get("forward"))
        raise KeyError("boom")

    frame = RecomputeFrame(recomputed)
    frame.add(site, torch.zeros(3, 2, dtype=torch.int64))
    frame.ran = True  # the next run is a recomputation: idle routers are driven for its length
    with pytest.raises(KeyError, match="boom"):
        frame.run()
    assert inside[0] is not None and inside[0] is not before.get("forward")
    assert site.module.__dict__.keys() == before.keys()
    assert all(site.module.__dict__[k] is v for k, v in before.items())


def test_a_checkpoint_function_the_user_changes_inside_the_block_is_kept():
    model = _qwen()
    model.activation_checkpointing_enable()
    layer0, layer1 = model.model.layers
    original0 = layer0.__dict__["_gradient_checkpointing_func"]
    mine = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    with torch.no_grad(), record_routing(model):
        model(_IDS)
        assert getattr(layer0.__dict__["_gradient_checkpointing_func"], "_modelpatch_routing_bound", False)
        layer0._gradient_checkpointing_func = mine  # the user's choice, made inside the block...
        model(_IDS)  # ...wrapped again at the next forward
        del layer1._gradient_checkpointing_func
    assert layer0.__dict__["_gradient_checkpointing_func"] is mine  # ...and not taken back on exit
    assert "_gradient_checkpointing_func" not in layer1.__dict__
    assert original0 is not mine


def test_a_second_block_on_the_same_model_is_refused_and_changes_nothing():
    model = _qwen()
    _warm(model)
    before = _snapshot(model)
    with torch.no_grad(), record_routing(model):
        inside = _snapshot(model)
        with pytest.raises(RuntimeError, match="do not nest on the same model") as err:
            with record_routing(model):
                pass
        assert isinstance(err.value, ModelpatchError)
        _assert_unchanged(model, inside)
    _assert_unchanged(model, before)


def test_an_instance_generate_set_by_the_user_is_restored_itself():
    model = _qwen()
    mine = functools.partial(type(model).generate, model)
    model.generate = mine
    with torch.no_grad(), record_routing(model):
        assert model.__dict__["generate"] is not mine
    assert model.__dict__["generate"] is mine


# -- RoutingTrace's public building / reading methods ------------------------------------------------------------


def test_trace_append_check_lengths_and_storage_dtypes():
    trace = RoutingTrace({}, num_experts={1: 8, 3: 300}, top_k=2)
    assert trace.layers == (1, 3) and trace.num_sequences == 0
    assert trace.storage_dtype(1) == torch.uint8 and trace.storage_dtype(3) == torch.uint16
    trace.append(1, 1, torch.tensor([[0, 3]], dtype=torch.int32))
    with pytest.raises(
        RoutingTraceError,
        match=r"layer 3: expected 2 sequences with token counts \[0, 1\] \(as "
        r"layer 1\), received 0 sequences",
    ):
        trace.check_lengths()
    trace.append(3, 1, torch.tensor([[299, 0]]))
    trace.check_lengths()
    assert trace.sequence_lengths == [0, 1]
    trace.append(1, 1, torch.tensor([[-1, -1], [5, 7]]))
    trace.append(3, 1, torch.tensor([[1, 2], [3, 4]]))
    routes = trace[1]
    assert [r.shape for r in routes] == [(0, 2), (3, 2)] and routes[1].dtype == torch.int64
    assert routes[1].tolist() == [[0, 3], [-1, -1], [5, 7]]
    assert trace.max_expert_id(1) == 7 and trace.max_expert_id(3) == 299
    with pytest.raises(RoutingTraceError, match=r"layer 1, sequence 0: expected expert ids in \[0, 8\)"):
        trace.append(1, 0, torch.tensor([[8, 1]]))
    with pytest.raises(KeyError, match="layer 2 is not an MoE layer of this trace"):
        trace.append(2, 0, torch.tensor([[0, 1]]))


def test_trace_append_unchecked_keeps_the_tensor_and_reads_are_cached_until_it_changes():
    trace = RoutingTrace({}, num_experts={0: 8}, top_k=2)
    ids = torch.tensor([[2, 4], [1, 0]], dtype=torch.uint8)
    trace.append(0, 0, ids, check=False)
    assert trace._blocks[0][0][-1].ids is ids  # the recorder's path: no copy, no conversion
    shared = trace.layer_routes(0, copy=False)
    assert trace.layer_routes(0, copy=False)[0] is shared[0]  # cached, not copied
    copied = trace.layer_routes(0)
    assert copied[0] is not shared[0] and torch.equal(copied[0], shared[0])
    assert shared[0].dtype == torch.int64 and shared[0].tolist() == [[2, 4], [1, 0]]
    trace.append(0, 0, torch.tensor([[7, 6]], dtype=torch.uint8), check=False)
    assert trace.layer_routes(0, copy=False)[0].tolist() == [[2, 4], [1, 0], [7, 6]]
    assert trace.max_expert_id(0) == 7
    empty = RoutingTrace({0: [torch.full((3, 2), -1)]}, num_experts=8)
    assert empty.max_expert_id(0) == -1


def test_trace_read_inside_a_record_block_sees_later_cache_continuations():
    # was: the decoded cache was only refreshed when the number of sequences changed, so a read between two
    # forwards of the same sequences (a KV-cache continuation) kept returning the first forward's tokens
    model = _qwen()
    with torch.no_grad(), record_routing(model) as trace:
        out = model(_IDS[:1, :6], use_cache=True)
        assert trace.sequence_lengths == [6] and trace[0][0].shape == (6, 2)
        model(_IDS[:1, 6:8], past_key_values=out.past_key_values, use_cache=True)
        assert trace.sequence_lengths == [8] and trace[0][0].shape == (8, 2)
        assert trace.layer_routes(1, copy=False)[0].shape == (8, 2)
    with torch.no_grad(), record_routing(model) as full:
        model(_IDS[:1, :8])
    assert trace == full


# -- engine arrays as nested Python lists ------------------------------------------------------------------------


def test_a_three_deep_nested_list_is_one_sequence():
    # was: read as one sequence per token, then refused with "sequence 0: expected shape ... received (1, 2)"
    one_layer = _qwen(num_hidden_layers=1)
    trace = RoutingTrace.from_routed_experts([[[1, 2]], [[0, 3]]], one_layer)
    assert trace.layers == (0,) and trace.num_sequences == 1 and trace.sequence_lengths == [2]
    assert trace[0][0].tolist() == [[1, 2], [0, 3]]

    model = _qwen()
    with torch.no_grad(), record_routing(model) as recorded:
        model(_IDS[:1])
    arr = recorded.to_routed_experts(0)  # (9, 2, 2)
    assert RoutingTrace.from_routed_experts(arr.tolist(), model) == recorded
    assert RoutingTrace.from_routed_experts(tuple(arr.tolist()), model) == recorded


def test_a_four_deep_nested_list_is_a_batch_and_takes_its_attention_mask():
    # was: read as a list of per-sequence arrays, attention_mask silently ignored: padding became routes
    model = _qwen()
    arr = np.array([[[[1, 2], [3, 4]]] * 4, [[[5, 6], [7, 0]]] * 4])  # (2, 4, 2, 2)
    mask = [[0, 1, 1, 1], [1, 1, 1, 1]]
    from_list = RoutingTrace.from_routed_experts(arr.tolist(), model, attention_mask=mask)
    from_array = RoutingTrace.from_routed_experts(arr, model, attention_mask=mask)
    assert from_list.sequence_lengths == [3, 4] and from_list == from_array
    ragged = [arr[0, :3].tolist(), arr[1].tolist()]  # sequences of different lengths: one entry each
    assert RoutingTrace.from_routed_experts(ragged, model).sequence_lengths == [3, 4]
    with pytest.raises(RoutingTraceError, match=r"attention_mask: given with a list of 2 per-sequence arrays"):
        RoutingTrace.from_routed_experts(ragged, model, attention_mask=mask)


def test_a_list_of_arrays_is_one_sequence_each_and_ambiguous_shapes_are_refused():
    model = _qwen()
    seqs = [np.tile(np.array([0, 1], np.int32), (n, 2, 1)) for n in (3, 5)]
    trace = RoutingTrace.from_routed_experts(seqs, model)
    assert trace.sequence_lengths == [3, 5] and trace[1][1].tolist() == [[0, 1]] * 5
    assert RoutingTrace.from_routed_experts([torch.from_numpy(s) for s in seqs], model) == trace
    with pytest.raises(RoutingTraceError, match=r"attention_mask: given with a list of 2 per-sequence arrays"):
        RoutingTrace.from_routed_experts(seqs, model, attention_mask=np.ones((2, 5)))
    with pytest.raises(
        RoutingTraceError,
        match=r"sequence 0: expected shape \(seq_len, num_layers, top_k\), "
        r"received \(2, 2\); a list is read as one array per sequence",
    ):
        RoutingTrace.from_routed_experts(list(seqs[0]), model)  # per-token rows: one sequence split in three
    with pytest.raises(RoutingTraceError, match=r"routed_experts: a nested list must be rectangular"):
        RoutingTrace.from_routed_experts([[[0, 1], [2, 3]], [[0, 1]]], model)
    with pytest.raises(
        RoutingTraceError,
        match=r"routed_experts: expected one sequence \(seq_len, num_layers, "
        r"top_k\), a padded batch .*; received shape \(3, 4\)",
    ):
        RoutingTrace.from_routed_experts(np.zeros((3, 4), np.int32), model)
    with pytest.raises(RoutingTraceError, match=r"received shape \(1, 1, 3, 2, 2\)"):
        RoutingTrace.from_routed_experts(np.zeros((1, 1, 3, 2, 2), np.int32).tolist(), model)
    assert RoutingTrace.from_routed_experts([], model).num_sequences == 0


# -- modules: one-way imports, public trace methods, documented map ----------------------------------------------


def _modules() -> dict[str, ast.Module]:
    aliases = {name.rpartition(".")[2] for name in MOVED if name.startswith("modelpatch.routing.")}  # deprecated
    return {p.stem: ast.parse(p.read_text()) for p in sorted(_ROUTING.glob("*.py")) if p.stem not in aliases}


def _routing_imports(tree: ast.Module) -> set[str]:
    """Routing modules imported anywhere in the file, at module level or inside functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                found |= {a.name for a in node.names} if node.module is None else {node.module.split(".")[0]}
            elif node.level == 0 and (node.module or "").startswith("modelpatch.routing."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("modelpatch.routing.")}
    return found


def _documented_order() -> list[str]:
    doc = ast.get_docstring(_modules()["__init__"])
    return re.findall(r"^- ``(\w+)`` — ", doc, flags=re.M)


def test_init_docstring_maps_every_module_top_down():
    order = _documented_order()
    assert sorted(order) == sorted(set(_modules()) - {"__init__"})
    assert order == [
        "agreement",
        "record",
        "replay",
        "generate",
        "driver",
        "compiled",
        "trace",
        "engine_arrays",
        "recompute",
        "layout",
        "sites",
        "kinds",
        "measures",
        "errors",
    ]


def test_each_module_imports_only_modules_below_it_not_even_inside_functions():
    order = _documented_order()
    trees = _modules()
    for i, name in enumerate(order):
        above = set(order[: i + 1])
        assert _routing_imports(trees[name]) & above == set(), f"{name} imports {_routing_imports(trees[name]) & above}"
    assert "trace" not in _routing_imports(trees["engine_arrays"])  # the former cycle
    assert _routing_imports(trees["trace"]) == {"engine_arrays", "errors"}


def test_routing_imports_no_patching_conversion_cli_or_recipes():
    banned = ("patching", "conversion", "cli", "recipes")
    for name, tree in _modules().items():
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level in (0, 2):
                base = node.module if node.level == 0 else ".".join(filter(None, ["modelpatch", node.module]))
                imported |= {base} | {f"{base}.{a.name}" for a in node.names}
        bad = sorted(m for m in imported if m.split(".")[:2] in [["modelpatch", b] for b in banned])
        assert bad == [], f"{name} imports {bad}"


def test_only_trace_touches_the_trace_storage():
    for name, tree in _modules().items():
        if name == "trace":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
                assert owner_name not in ("trace", "next_turn"), f"{name}: {owner_name}.{node.attr}"
            if isinstance(node, ast.Name):
                assert node.id not in ("_Block",), f"{name}: {node.id}"
            if isinstance(node, ast.alias):
                assert node.name not in ("_Block", "_check_rows"), f"{name} imports {node.name}"


def test_docstrings_cite_nothing_a_reader_cannot_open():
    for path in _ROUTING.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"SPEC|[Ii]ssue \d", text), path.name


@pytest.mark.parametrize(
    "error, builtin",
    [
        (RoutingTraceError, ValueError),
        (RoutingReplayError, RuntimeError),
        (RoutingDiscoveryError, RuntimeError),
        (RouterContractError, RuntimeError),
    ],
)
def test_routing_errors_are_modelpatch_errors_and_keep_their_builtin_base(error, builtin):
    assert issubclass(error, ModelpatchError) and issubclass(error, builtin)
    assert error.__module__ == "modelpatch.routing.errors"


# -- discovery by structure: a router is what computes a top-k over its experts' scores -------------------------


class _Selector(torch.nn.Module):
    """A router with none of a router's names: no *Router class name, no num_experts / top_k attributes, its
    projection in ``scorer.weight``; Qwen3-MoE's math (softmax, top-k; the tiny config does not renormalise)."""

    def __init__(self, weight: torch.Tensor, picks: int):
        super().__init__()
        self.scorer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.scorer.weight.copy_(weight)
        self.picks = picks

    def forward(self, hidden_states):
        logits = self.scorer(hidden_states)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        values, indices = torch.topk(probs, self.picks, dim=-1)
        return logits, values.to(logits.dtype), indices


def test_a_router_without_a_routers_names_is_found_by_what_it_computes():
    from routing_models import ExpertsObserver

    model = _qwen()
    reference = model(_IDS).logits
    for layer in model.model.layers:
        layer.mlp.gate = _Selector(layer.mlp.gate.weight.detach(), picks=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sites, stack, layers = find_router_sites(model)
    assert [(s.name, type(s.module), s.num_experts, s.top_k) for s in sites] == [
        (f"model.layers.{i}.mlp.gate", _Selector, 8, 2) for i in range(2)
    ]
    assert (stack, layers, sites[0].kind.name) == ("model.layers", 2, "topk")
    # the probe ran on the meta device: every tensor as it was
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with torch.no_grad():
        with ExpertsObserver(model) as seen, record_routing(model) as trace:
            logits = model(_IDS).logits
        assert torch.equal(logits, reference)  # same router math under another name
        for layer in (0, 1):
            assert torch.equal(seen.indices(layer), torch.cat(trace[layer]))
        for layer in model.model.layers:  # other routes without replay
            layer.mlp.gate.scorer.weight.add_(torch.randn(layer.mlp.gate.scorer.weight.shape) * 2)
        with ExpertsObserver(model) as seen, replay_routing(model, trace):
            model(_IDS)
        for layer in (0, 1):
            assert torch.equal(seen.indices(layer), torch.cat(trace[layer]))


def test_a_module_beside_the_experts_without_a_top_k_is_not_a_router():
    model = _qwen()
    for layer in model.model.layers:  # a projection with one row per expert, but no choice of experts
        layer.mlp.gate = torch.nn.Linear(64, 8, bias=False)
    with pytest.raises(RoutingDiscoveryError, match="has no top-k router module"):
        find_router_sites(model)
