"""Routing failures found by a fresh-user test; each stays as a test."""

import copy
import functools

import pytest
import torch
import torch.utils.checkpoint
from transformers import GenerationConfig

import modelpatch.routing.session as routing_session
from modelpatch.routing import (
    RoutingReplayError,
    RoutingTraceError,
    find_router_sites,
    record_routing,
    replay_routing,
)
from routing_models import perturb_routers, tiny_model

IDS = torch.tensor([[3, 5, 9, 17, 33, 4, 4, 4], [3, 8, 21, 40, 2, 7, 4, 4]])


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "olmoe"])
def test_replay_after_large_router_drift_stays_finite(family):
    # a drifted router can give the recorded experts probability 0: the family's p / p.sum() was 0/0 -> NaN
    model = tiny_model(family, norm_topk_prob=True).train()
    with torch.no_grad(), record_routing(model) as trace:
        model(IDS)
    perturb_routers(model, scale=50.0)
    with replay_routing(model, trace):
        loss = model(IDS, labels=IDS).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_record_refuses_beam_search_and_restores_generate():
    model = tiny_model("qwen3_moe").eval()
    with pytest.raises(RoutingTraceError, match="num_beams=3"):
        with torch.no_grad(), record_routing(model):
            model.generate(IDS[:, :5], max_new_tokens=2, num_beams=3, do_sample=False, pad_token_id=0)
    assert "generate" not in model.__dict__
    with torch.no_grad(), record_routing(model) as trace:  # greedy still records prefill + decode steps
        model.generate(IDS[:1, :5], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert trace[trace.layers[0]][0].shape[0] == 5 + 2


# -- activation checkpointing: each recomputation replays the indices of its own forward ------------------------

_A = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(10))
_B = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(11))  # same shape as _A


def _drifted(family):
    """A tiny model whose routers moved on after recording two micro-batches of the same shape."""
    model = tiny_model(family)
    with torch.no_grad(), record_routing(model) as trace:
        model(_A)
        model(_B)
    sites = find_router_sites(model)[0]
    assert any(not torch.equal(trace[s.layer_idx][0], trace[s.layer_idx][2]) for s in sites)  # a, b route apart
    perturb_routers(model)
    with torch.no_grad(), record_routing(model) as natural:
        model(_A)
        model(_B)
    assert natural != trace, "the drifted routers must route differently, or replay is not exercised"
    return model.train(), trace


def _grads(model, trace, schedule, enable=None):
    """Gradients of the losses of micro-batches a and b under ``schedule``; ``enable(model)`` turns on
    checkpointing (before the block, or inside it when the schedule says so)."""
    if enable is not None and schedule != "enable_inside_block":
        enable(model)
    kw = dict(use_cache=False)
    with replay_routing(model, trace):
        if schedule == "enable_inside_block" and enable is not None:
            enable(model)
        la = model(_A, labels=_A, **kw).loss
        lb = model(_B, labels=_B, **kw).loss
        if schedule == "fwd_a_fwd_b_bwd_a_bwd_b_inside":
            la.backward()
            lb.backward()
    if schedule in ("bwd_after_block", "enable_inside_block"):
        (la + lb).backward()
    elif schedule == "bwd_b_then_a_after_block":
        lb.backward()
        la.backward()
    for site in find_router_sites(model)[0]:  # the model is left exactly as it was
        assert "forward" not in site.module.__dict__
    for m in model.modules():
        fn = m.__dict__.get("_gradient_checkpointing_func", m.__dict__.get("checkpoint_fn"))
        assert not getattr(fn, "_modelpatch_routing_bound", False)
    return {
        n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.fixture(scope="module")
def drifted():
    """``drifted(family)``: a deep copy of the family's drifted model and of its trace (``_drifted`` runs once per
    family for the whole module; every test gets copies of its own, so nothing one test does reaches another)."""
    built = {}

    def get(family):
        if family not in built:
            built[family] = _drifted(family)
        model, trace = built[family]
        return copy.deepcopy(model), copy.deepcopy(trace)

    return get


@pytest.fixture(scope="module")
def reference_grads(drifted):
    """``reference_grads(family, schedule)``: the gradients without checkpointing (``_grads`` with no ``enable``), on
    a copy of the drifted model; computed once per (family, schedule), the same for every checkpointing variant."""
    computed = {}

    def get(family, schedule):
        if (family, schedule) not in computed:
            model, trace = drifted(family)
            computed[family, schedule] = _grads(model, trace, schedule)
        return computed[family, schedule]

    return get


def _max_diff(got, ref):
    assert got.keys() == ref.keys()
    return max(float((got[n] - ref[n]).abs().max()) for n in ref)


_SCHEDULES = ["bwd_after_block", "fwd_a_fwd_b_bwd_a_bwd_b_inside", "bwd_b_then_a_after_block", "enable_inside_block"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("schedule", _SCHEDULES)
def test_checkpointed_replay_gradients_equal_uncheckpointed(family, reentrant, schedule, drifted, reference_grads):
    # was: backward after the block recomputed with the drifted router (CheckpointError / grads off by 0.046);
    # fwd a, fwd b, bwd a, bwd b recomputed a with b's indices (the latest of the same shape; grads off by 0.097)
    ref = reference_grads(family, schedule)
    model, trace = drifted(family)

    def enable(m):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})

    got = _grads(model, trace, schedule, enable)
    assert _max_diff(got, ref) < 1e-6


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_wrapper_layers_replay_in_any_order(reentrant, drifted, reference_grads):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    ref = reference_grads("qwen3_moe", "bwd_b_then_a_after_block")
    model, trace = drifted("qwen3_moe")
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT

    def enable(m):
        apply_activation_checkpointing(
            m,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda mod: type(mod).__name__.endswith("DecoderLayer"),
        )

    got = _grads(model, trace, "bwd_b_then_a_after_block", enable)
    assert _max_diff(got, ref) < 1e-6


@pytest.mark.parametrize("reentrant", [False, True])
def test_router_inside_unbound_checkpoint_raises_at_forward(reentrant, drifted):
    model, trace = drifted("qwen3_moe")
    mlp = model.model.layers[1].mlp  # checkpointed by hand: replay cannot reach its recomputation
    original = mlp.forward
    mlp.forward = lambda x: torch.utils.checkpoint.checkpoint(original, x, use_reentrant=reentrant)
    with pytest.raises(
        RoutingReplayError,
        match=r"layer 1: the router runs inside a torch.utils.checkpoint call "
        r"that replay_routing is not bound to",
    ):
        with replay_routing(model, trace):
            model(_A, labels=_A)
    assert "forward" not in find_router_sites(model)[0][1].module.__dict__


# -- generate: modes whose forwards do not extend the recorded sequences one token at a time are refused --------

_PROMPT = torch.tensor([[5, 9, 17, 5, 9, 17, 5, 9]])


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(use_cache=False), r"use_cache=False: every decode step re-runs the whole prefix"),
        (dict(prompt_lookup_num_tokens=3), r"assisted / speculative decoding \(prompt_lookup_num_tokens=3\)"),
        (dict(assistant_model="copy"), r"assisted / speculative decoding \(assistant_model\)"),
        (dict(guidance_scale=1.5), r"classifier-free guidance \(guidance_scale=1.5\)"),
        (dict(generation_config="no_cache"), r"use_cache=False"),
    ],
)
def test_record_refuses_generate_modes_that_do_not_extend_one_token_at_a_time(options, message):
    # was: use_cache=False recorded 6 sequences of 8..13 tokens, prompt lookup 1 sequence of 16 (13 expected)
    model = tiny_model("qwen3_moe").eval()
    if options.get("assistant_model") == "copy":
        options = dict(assistant_model=copy.deepcopy(model))
    if options.get("generation_config") == "no_cache":
        options = dict(generation_config=GenerationConfig(use_cache=False, max_new_tokens=6, pad_token_id=0))
    else:
        options = dict(options, max_new_tokens=6, pad_token_id=0)
    with pytest.raises(RoutingTraceError, match="record_routing cannot record generate with " + message):
        with torch.no_grad(), record_routing(model):
            model.generate(_PROMPT, do_sample=False, **options)
    assert "generate" not in model.__dict__


def test_generate_steps_are_checked_to_continue_the_cache(monkeypatch):
    # the backstop behind the option checks: a step that re-runs the prefix or restarts inside the cache raises
    model = tiny_model("qwen3_moe").eval()
    monkeypatch.setattr(routing_session, "_refused_generation", lambda *a: None)
    with pytest.raises(RoutingTraceError, match="ran the whole sequence again instead of continuing the KV cache"):
        with torch.no_grad(), record_routing(model):
            model.generate(_PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=False)
    with pytest.raises(
        RoutingTraceError,
        match=r"continues the KV cache from position \d+, the previous forward "
        r"ended at \d+: the cache was cropped",
    ):
        with torch.no_grad(), record_routing(model):
            model.generate(_PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("family", ["minimax", "qwen3_moe"])
def test_generate_trace_equals_routes_of_the_generated_sequence(family):
    # was (minimax): layer 0's cache holds no keys (linear attention), decode steps were read as new sequences
    model = tiny_model(family).eval()
    with torch.no_grad(), record_routing(model) as trace:
        out = model.generate(_PROMPT[:, :6], max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad(), record_routing(model) as full:
        model(out)
    assert trace.sequence_lengths == [out.shape[1] - 1]
    for layer in trace.layers:
        assert torch.equal(trace[layer][0], full[layer][0][:-1])


def test_routers_added_or_replaced_after_first_use_are_recorded_and_replayed():
    from routing_models import ExpertsObserver

    model = tiny_model("deepseek_v3", num_hidden_layers=3)  # layer 0 dense, layers 1-2 MoE
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(model) as first:
        model(ids)
    assert first.layers == (1, 2)
    model.model.layers[0].mlp = copy.deepcopy(model.model.layers[1].mlp)  # upcycled: layer 0 becomes MoE
    model.model.layers[2].mlp = copy.deepcopy(model.model.layers[1].mlp)  # layer 2's block replaced
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)
    assert trace.layers == (0, 1, 2)  # the cached discovery of the first block missed layer 0 before
    perturb_routers(model, seed=4)
    with torch.no_grad(), ExpertsObserver(model) as seen, replay_routing(model, trace):
        model(ids)
    for layer in (0, 1, 2):
        assert torch.equal(seen.indices(layer).sort(-1).values, trace[layer][0].sort(-1).values)
    with pytest.raises(RoutingTraceError, match=r"trace MoE layers \[1, 2\] do not match .* \[0, 1, 2\]"):
        with replay_routing(model, first):
            pass


@pytest.mark.parametrize(
    ("family", "overrides", "cache"),
    [
        ("qwen3_moe", {}, "static"),
        ("mixtral", {"sliding_window": 4}, "static"),
        ("mixtral", {"sliding_window": 4}, None),
    ],
)
def test_generate_with_any_cache_records_exactly_the_real_tokens(family, overrides, cache):
    model = tiny_model(family, **overrides)
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 20, 21, 22, 23, 24, 25]])
    mask = (ids != 0).long()
    with torch.no_grad(), record_routing(model) as reference:  # the default cache, a 2-D mask at every forward
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with torch.no_grad(), record_routing(model) as trace:
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation=cache
        )
    assert trace.sequence_lengths == [9 + 2, 6 + 2]  # left padding is not a token; the last token is never fed
    for layer in trace.layers:
        assert all(torch.equal(a, b) for a, b in zip(trace[layer], reference[layer]))


@pytest.mark.parametrize("cache", ["static", None])
def test_generate_with_num_return_sequences_expands_the_padding_mask(cache):
    """``num_return_sequences=2`` repeats each prompt row: with a static cache (4-D masks, padding read from the
    prompt's 2-D mask) the padded row's pad positions were recorded as tokens ([10, 10, 10, 10] instead of
    [7, 7, 10, 10] here: the prompt mask was not expanded to the generated batch)."""
    model = tiny_model("qwen3_moe")
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 20, 21, 22, 23, 24, 25]])
    mask = (ids != 0).long()
    # sampling with top_k=1: what num_return_sequences needs, and deterministic
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=True, top_k=1, num_return_sequences=2)
    with torch.no_grad(), record_routing(model) as reference:  # the default cache: a 2-D mask at every forward
        model.generate(**kwargs)
    with torch.no_grad(), record_routing(model) as trace:
        model.generate(**kwargs, cache_implementation=cache)
    assert reference.sequence_lengths == [10, 10, 7, 7]
    assert trace.sequence_lengths == [10, 10, 7, 7]
    for layer in trace.layers:
        assert all(torch.equal(a, b) for a, b in zip(trace[layer], reference[layer]))


def test_a_layer_that_took_no_routes_in_a_replay_block_is_named_at_exit():
    model = tiny_model("deepseek_v3", num_hidden_layers=3)  # MoE layers 1 and 2
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)
    layer = model.model.layers[2]
    forward = layer.forward

    def skip(hidden_states, *args, **kwargs):  # layer dropping: layer 2 does nothing in this forward
        return hidden_states

    with pytest.raises(RoutingReplayError, match=r"layer 2: 0 of 1"):
        with torch.no_grad(), replay_routing(model, trace):
            layer.forward = skip
            try:
                model(ids)
            finally:
                layer.forward = forward
    inside = copy.deepcopy(model.model.layers[1].mlp)
    with pytest.raises(RoutingReplayError, match=r"layer 1: 0 of 1"):
        with torch.no_grad(), replay_routing(model, trace):
            original, model.model.layers[1].mlp = model.model.layers[1].mlp, inside  # a router the block does not drive
            try:
                model(ids)
            finally:
                model.model.layers[1].mlp = original
