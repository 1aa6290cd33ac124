"""Record / replay of MoE routing on twelve representative MoE families (tiny configs, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint

from modelpatch.routing import (
    RoutingReplayError,
    RoutingTrace,
    RoutingTraceError,
    find_router_sites,
    record_routing,
    replay_routing,
)
from routing_models import REQUIRED_FAMILIES, ExpertsObserver, perturb_routers, tiny_model

_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return copy.deepcopy(_MODELS[family])


def _ids(batch=2, seq=9, seed=0):
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _state(model):
    """Everything record/replay may touch on the instance: router instance dicts and hook tables."""
    sites, _, _ = find_router_sites(model)
    return [
        (sorted(m.__dict__), len(m._forward_pre_hooks), len(m._forward_hooks), type(m), type(m).forward)
        for m in [s.module for s in sites] + list(model.modules())[:3]
    ]


@pytest.mark.parametrize("family", REQUIRED_FAMILIES)
def test_record_matches_experts_and_natural_replay_is_exact(family):
    model = _model(family)
    ids = _ids()
    with torch.no_grad():
        plain = model(ids, output_router_logits=True)
        before = _state(model)  # (Transformers installs its own output-capture hooks on first use)
        with ExpertsObserver(model) as seen, record_routing(model) as trace:
            recorded = model(ids, output_router_logits=True)
            router = find_router_sites(model)[0][0].module
            assert "forward" in router.__dict__  # driven per instance...
            assert [x[3:] for x in _state(model)] == [x[3:] for x in before]  # ...never through its class
        assert _state(model) == before
        # the trace is what the experts were called with, per layer, batch rows in order
        assert trace.num_sequences == 2 and trace.sequence_lengths == [9, 9]
        for layer in trace.layers:
            assert torch.equal(torch.cat(trace[layer]), seen.indices(layer))
            assert trace[layer][0].dtype == torch.int64 and trace[layer][0].shape == (9, 2)
        with ExpertsObserver(model) as seen, replay_routing(model, trace):
            replayed = model(ids, output_router_logits=True)
        assert _state(model) == before
        after = model(ids, output_router_logits=True)
    torch.testing.assert_close(recorded.logits, plain.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(replayed.logits, plain.logits, atol=1e-6, rtol=0)
    assert torch.equal(after.logits, plain.logits)  # idle: bit-identical once the blocks exit
    # router logits keep their meaning (raw logits, not probabilities): aux losses unchanged
    for a, b in zip(replayed.router_logits, plain.router_logits):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    if plain.aux_loss is not None:
        torch.testing.assert_close(replayed.aux_loss, plain.aux_loss, atol=1e-6, rtol=0)
    for layer in trace.layers:
        assert torch.equal(seen.indices(layer), torch.cat(trace[layer]))


@pytest.mark.parametrize("family", REQUIRED_FAMILIES)
def test_replay_forces_indices_and_router_gets_gradients(family):
    model = _model(family)
    ids = _ids(seed=1)
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)
    perturb_routers(model)  # the live routers would now pick other experts
    with torch.no_grad(), ExpertsObserver(model) as natural:
        model(ids)
    assert any(not torch.equal(natural.indices(layer), torch.cat(trace[layer])) for layer in trace.layers), (
        "perturbation should change the natural routing"
    )

    model.train()
    with ExpertsObserver(model) as seen, replay_routing(model, trace):
        out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for site in find_router_sites(model)[0]:
        idx, weights = seen.calls[site.layer_idx][-1]
        assert torch.equal(idx, torch.cat(trace[site.layer_idx]))  # forced experts actually used
        assert bool((weights > 0).all()), f"layer {site.layer_idx}: forced experts must get weight > 0"
        grad = site.module.weight.grad
        assert grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "phimoe", "gpt_oss"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_replays_same_indices(family, reentrant):
    model = _model(family)
    ids = _ids(seed=2)
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)
    perturb_routers(model)
    model.train()
    ref_model = copy.deepcopy(model)
    torch.manual_seed(0)  # phimoe's sparsemixer draws random numbers in training mode
    with replay_routing(ref_model, trace):
        ref = ref_model(ids, labels=ids)
    ref.loss.backward()

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    torch.manual_seed(0)
    with ExpertsObserver(model) as seen, replay_routing(model, trace):
        out = model(ids, labels=ids)
        out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=0)
    for site, ref_site in zip(find_router_sites(model)[0], find_router_sites(ref_model)[0]):
        calls = seen.calls[site.layer_idx]
        assert len(calls) == 2, "forward + checkpoint recompute"
        for idx, _ in calls:  # the recomputed forward replays the same indices
            assert torch.equal(idx, torch.cat(trace[site.layer_idx]))
        torch.testing.assert_close(site.module.weight.grad, ref_site.module.weight.grad, atol=1e-6, rtol=1e-5)


def test_leftover_and_missing_routes_raise_and_state_is_cleared():
    model = _model("qwen3_moe")
    ids = _ids()
    before = _state(model)
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)
    with pytest.raises(RoutingReplayError, match="leftover routes.*sequence 1: 0 of 9"):
        with torch.no_grad(), replay_routing(model, trace):
            model(ids[:1])
    assert _state(model) == before
    with pytest.raises(RoutingReplayError, match="missing routes: sequence 0 needs tokens \\[0, 11\\)"):
        with torch.no_grad(), replay_routing(model, trace):
            model(torch.cat([ids, ids[:, :2]], dim=1))
    assert _state(model) == before
    with pytest.raises(KeyError):
        with replay_routing(model, trace):
            raise KeyError("user error inside the block")
    assert _state(model) == before
    # one fewer row than tokens (engine convention): the last token routes naturally, no error
    short = RoutingTrace({layer: [t[:-1] for t in trace[layer]] for layer in trace.layers}, num_experts=8, top_k=2)
    with torch.no_grad(), ExpertsObserver(model) as seen, replay_routing(model, short):
        model(ids)
    assert torch.equal(seen.indices(0), torch.cat(trace[0]))


def test_trace_range_and_layer_errors_name_the_layer():
    model = _model("deepseek_v3")  # layer 0 dense, layer 1 MoE
    bad = RoutingTrace({1: [torch.tensor([[0, 1]])]}, num_experts=16, top_k=2)
    bad._blocks[1][0][0].ids[0, 1] = 9
    with pytest.raises(RoutingTraceError, match=r"layer 1: expected expert ids in \[0, 8\).*received max id 9"):
        with replay_routing(model, bad):
            pass
    with pytest.raises(RoutingTraceError, match=r"trace MoE layers \[0\] do not match the model's MoE layers \[1\]"):
        with replay_routing(model, RoutingTrace({0: [torch.tensor([[0, 1]])]}, num_experts=8, top_k=2)):
            pass
    with pytest.raises(
        RoutingTraceError, match=r"layer 3, sequence 0: expected shape \(num_tokens, 2\), received \(2, 3\)"
    ):
        RoutingTrace({3: [torch.zeros(2, 3, dtype=torch.long)]}, num_experts=8, top_k=2)
    with pytest.raises(RoutingTraceError, match=r"layer 3, sequence 0, token 0: expert ids must be distinct"):
        RoutingTrace({3: [torch.tensor([[4, 4]])]}, num_experts=8, top_k=2)


def test_generate_records_prefill_and_decode_per_sequence_with_left_padding():
    model = _model("mixtral")
    model.generation_config.pad_token_id = 0
    ids = _ids(seq=6, seed=3)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # left padding on row 0
    with torch.no_grad(), ExpertsObserver(model) as seen, record_routing(model) as trace:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert trace.sequence_lengths == [4 + 3, 6 + 3]  # real prompt + new tokens - the last (never fed)
    for layer in trace.layers:
        prefill = seen.indices(layer, 0).view(2, 6, 2)
        assert torch.equal(trace[layer][0][:4], prefill[0, 2:])
        assert torch.equal(trace[layer][1][:6], prefill[1])
        for step in range(3):
            step_idx = seen.indices(layer, 1 + step)
            assert torch.equal(trace[layer][0][4 + step], step_idx[0])
            assert torch.equal(trace[layer][1][6 + step], step_idx[1])
    # training-style replay on the generated sequences (left padded), last token free
    full_mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1)
    perturb_routers(model)
    with torch.no_grad(), ExpertsObserver(model) as seen, replay_routing(model, trace):
        model(out, attention_mask=full_mask)
    for layer in trace.layers:
        got = seen.indices(layer).view(2, 10, 2)
        assert torch.equal(got[0, 2:-1], trace[layer][0]) and torch.equal(got[1, :-1], trace[layer][1])


@pytest.mark.parametrize("padding", ["right", "packed"])
def test_replay_layouts_right_padding_and_packed(padding):
    model = _model("qwen2_moe")
    a, b = _ids(1, 5, seed=4)[0], _ids(1, 8, seed=5)[0]
    with torch.no_grad(), record_routing(model) as trace:
        model(a[None])
        model(b[None])
    assert trace.sequence_lengths == [5, 8]
    perturb_routers(model)
    if padding == "right":
        ids = torch.zeros(2, 8, dtype=torch.long)
        mask = torch.zeros(2, 8, dtype=torch.long)
        ids[0, :5], mask[0, :5], ids[1], mask[1] = a, 1, b, 1
        kwargs = dict(input_ids=ids, attention_mask=mask)
    else:
        kwargs = dict(
            input_ids=torch.cat([a, b])[None], position_ids=torch.cat([torch.arange(5), torch.arange(8)])[None]
        )
    with torch.no_grad(), ExpertsObserver(model) as seen, replay_routing(model, trace):
        model(**kwargs)
    for layer in trace.layers:
        got = seen.indices(layer)
        if padding == "right":
            got = got.view(2, 8, 2)
            assert torch.equal(got[0, :5], trace[layer][0]) and torch.equal(got[1], trace[layer][1])
        else:
            assert torch.equal(got, torch.cat(trace[layer]))
    # recording a packed row gives one sequence per segment
    with torch.no_grad(), record_routing(model) as packed:
        model(input_ids=torch.cat([a, b])[None], position_ids=torch.cat([torch.arange(5), torch.arange(8)])[None])
    assert packed.sequence_lengths == [5, 8]


def test_save_load_roundtrip_and_compact_storage(tmp_path):
    g = torch.Generator().manual_seed(0)
    trace = RoutingTrace(
        {layer: [torch.randperm(8, generator=g)[:2].repeat(5, 1), torch.full((3, 2), -1)] for layer in (1, 3)},
        num_experts={1: 8, 3: 8},
        top_k=2,
        num_hidden_layers=4,
    )
    trace.save(tmp_path / "t.safetensors")
    back = RoutingTrace.load(tmp_path / "t.safetensors")
    assert back == trace and back.num_hidden_layers == 4 and back[3][1].tolist() == [[-1, -1]] * 3
    assert back._blocks[1][0][0].ids.dtype == torch.uint8
    big = RoutingTrace({0: [torch.tensor([[300, 299]])]}, num_experts=320, top_k=2)
    big.save(tmp_path / "b.safetensors")
    assert RoutingTrace.load(tmp_path / "b.safetensors")[0][0].tolist() == [[300, 299]]
    assert big._blocks[0][0][0].ids.dtype == torch.uint16


def test_compact_trace_32k_tokens_60_layers_top8_fits_16mb():
    g = torch.Generator().manual_seed(0)
    # 8 distinct ids per token: a random offset plus 0, 31, ..., 217 (mod 256)
    ids = (torch.randint(0, 256, (32768, 1), generator=g) + torch.arange(8) * 31) % 256
    trace = RoutingTrace({layer: [ids] for layer in range(60)}, num_experts=256, top_k=8)
    assert trace.nbytes <= 16_000_000
    assert trace._blocks[0][0][0].ids.dtype == torch.uint8
    assert torch.equal(trace[59][0], ids)


# -- drift, routers changed after first use, layers skipped -----------------------------------------------------------


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
