"""Routing drift (R3's measures: router disagreement, token flip rate, top-k overlap) and the validation of engine
arrays (issue 12, section 2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelpatch.routing import (
    RoutingTrace,
    RoutingTraceError,
    compare_routing,
    record_routing,
    routing_drift,
)
from routing_models import perturb_routers, tiny_model


def _trace(layers: dict[int, list[list[list[int]]]], num_experts: int = 8) -> RoutingTrace:
    return RoutingTrace({k: [torch.tensor(s) for s in v] for k, v in layers.items()}, num_experts=num_experts)


def test_measures_by_hand():
    # 2 layers, one sequence of 4 tokens, top-2; order inside a top-k does not count
    reference = _trace({1: [[[0, 1], [2, 3], [4, 5], [6, 7]]], 3: [[[0, 1], [2, 3], [4, 5], [6, 7]]]})
    other = _trace({1: [[[1, 0], [2, 4], [4, 5], [0, 1]]], 3: [[[0, 1], [2, 3], [5, 6], [6, 7]]]})
    agreement = compare_routing(reference, other)
    # layer 1: token 1 shares 1 of 2, token 3 shares 0 of 2 -> 2 of 4 differ, overlap (1 + .5 + 1 + 0) / 4
    # layer 3: token 2 shares 1 of 2 -> 1 of 4 differ, overlap (1 + 1 + .5 + 1) / 4
    by_layer = {a.layer: a for a in agreement.layers}
    assert (by_layer[1].disagreement_rate, by_layer[1].mean_topk_overlap) == (0.5, 0.625)
    assert (by_layer[3].disagreement_rate, by_layer[3].mean_topk_overlap) == (0.25, 0.875)
    assert agreement.router_disagreement_rate == 3 / 8
    assert agreement.token_flip_rate == 3 / 4  # tokens 1, 2, 3
    assert agreement.mean_topk_overlap == 0.75
    assert agreement.tokens == 4
    assert [a.layer for a in agreement.worst_layers(1)] == [1]
    assert "router disagreement 37.50%" in agreement.table()
    assert agreement.as_dict()["layers"][0] == {
        "layer": 1,
        "tokens": 4,
        "disagreement_rate": 0.5,
        "mean_topk_overlap": 0.625,
    }


def test_rows_without_a_route_are_not_compared():
    reference = _trace({1: [[[0, 1], [-1, -1], [2, 3]]]})
    other = _trace({1: [[[0, 1], [4, 5], [3, 4]]]})
    agreement = compare_routing(reference, other)
    assert agreement.tokens == 2 and agreement.router_disagreement_rate == 0.5 and agreement.mean_topk_overlap == 0.75


def test_traces_of_other_tokens_are_refused():
    with pytest.raises(RoutingTraceError, match=r"sequence lengths \[2\] vs \[3\]"):
        compare_routing(_trace({1: [[[0, 1], [2, 3]]]}), _trace({1: [[[0, 1], [2, 3], [4, 5]]]}))
    with pytest.raises(RoutingTraceError, match="different MoE layers"):
        compare_routing(_trace({1: [[[0, 1]]]}), _trace({2: [[[0, 1]]]}))


def test_routing_drift_of_a_model_against_its_own_trace_and_after_a_perturbation():
    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: not compared
    with torch.no_grad(), record_routing(model) as rollout:
        model(input_ids=ids, attention_mask=mask)
    same = routing_drift(model, rollout, ids, mask)
    assert (same.router_disagreement_rate, same.token_flip_rate, same.mean_topk_overlap) == (0.0, 0.0, 1.0)
    assert same.tokens == 9 + 6
    perturb_routers(model, seed=5)
    drift = routing_drift(model, rollout, ids, mask)
    with torch.no_grad(), record_routing(model) as natural:
        model(input_ids=ids, attention_mask=mask)
    assert drift == compare_routing(rollout, natural)
    assert 0.0 < drift.router_disagreement_rate <= drift.token_flip_rate


def test_routing_drift_accepts_the_trace_recorded_around_generate():
    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with torch.no_grad(), record_routing(model) as rollout:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert tuple(out.shape) == (2, 10) and rollout.sequence_lengths == [9, 7]  # the last token is never fed
    full_mask = torch.cat([mask, mask.new_ones(2, 4)], dim=1)
    same = routing_drift(model, rollout, out, full_mask)
    assert (same.router_disagreement_rate, same.token_flip_rate, same.mean_topk_overlap) == (0.0, 0.0, 1.0)
    assert same.tokens == 9 + 7
    perturb_routers(model, seed=5)
    drift = routing_drift(model, rollout, out, full_mask)
    with torch.no_grad(), record_routing(model) as natural:
        model(input_ids=out[:, :-1], attention_mask=full_mask[:, :-1])
    assert drift == compare_routing(rollout, natural)
    assert 0.0 < drift.router_disagreement_rate <= drift.token_flip_rate
    # without the mask the pad positions count as tokens: the error says how to call
    with pytest.raises(RoutingTraceError) as caught:
        routing_drift(model, rollout, out)
    assert str(caught.value).startswith(
        "the trace is not of these tokens: sequence lengths [9, 7] (trace) vs [10, 10] (input_ids, no "
        "attention_mask); pass the tokens the trace was recorded on, or for a trace recorded around generate() its "
        "output with attention_mask=torch.cat([prompt_mask, prompt_mask.new_ones(batch, new_tokens)], dim=1)"
    )


@pytest.fixture(scope="module")
def deepseek():
    return tiny_model("deepseek_v3", num_hidden_layers=3)  # layer 0 dense, layers 1-2 MoE, 8 experts, top-2


def _array(rows: int = 5, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    arr = np.zeros((rows, 3, 2), dtype=np.int32)  # vLLM: all hidden layers, zeros on dense layer 0
    for r in range(rows):
        for layer in (1, 2):
            arr[r, layer] = rng.permutation(8)[:2]
    return arr


def test_zero_filled_rows_are_named_or_dropped(deepseek):
    arr = _array()
    arr[0, 1:] = 0  # the engine recorded nothing for the first prompt token
    with pytest.raises(
        RoutingTraceError, match=r"layer 1, sequence 0, row 0: expert ids repeated .* received \[0, 0\]"
    ):
        RoutingTrace.from_routed_experts(arr, deepseek)
    trace = RoutingTrace.from_routed_experts(arr, deepseek, validate=False)
    assert trace[1][0][0].tolist() == [-1, -1] and trace[2][0][0].tolist() == [-1, -1]
    assert trace[1][0][1:].tolist() == arr[1:, 1].tolist()


def test_ids_out_of_range_name_the_row(deepseek):
    arr = _array()
    arr[3, 2] = [1, 9]
    with pytest.raises(RoutingTraceError, match=r"layer 2, sequence 0, row 3: expert ids must be in \[0, 8\)"):
        RoutingTrace.from_routed_experts(arr, deepseek)
    assert RoutingTrace.from_routed_experts(arr, deepseek, validate=False)[2][0][3].tolist() == [-1, -1]


def test_routes_in_a_dense_slice_make_the_layer_axis_ambiguous(deepseek):
    arr = _array()
    arr[:, 0] = arr[:, 1]  # something routed in dense layer 0: not vLLM's all-layers convention
    with pytest.raises(RoutingTraceError, match=r"layer axis is ambiguous: sequence 0, row 0 .* dense layer 0"):
        RoutingTrace.from_routed_experts(arr, deepseek)
    explicit = RoutingTrace.from_routed_experts(arr, deepseek, layer_axis="all")
    assert explicit[1][0].tolist() == arr[:, 1].tolist()


def test_leading_all_zero_rows_with_top_1():
    model = tiny_model("qwen3_moe", num_experts_per_tok=1)
    arr = np.array([[[0], [0]], [[0], [0]], [[2], [0]], [[1], [3]]], dtype=np.int32)  # (4 tokens, 2 layers, top-1)
    with pytest.raises(RoutingTraceError, match=r"row 0: the first 2 rows are expert 0 in every MoE layer"):
        RoutingTrace.from_routed_experts(arr, model)
    trace = RoutingTrace.from_routed_experts(arr, model, validate=False)
    assert trace[0][0].tolist() == [[-1], [-1], [2], [1]] and trace[1][0].tolist() == [[-1], [-1], [0], [3]]


# --- modelpatch routing-check ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A tiny Qwen3-MoE saved to a folder, the vLLM-style routes of one sequence under perturbed routers (what an
    engine whose weights lag the trainer's would return), and the token ids."""
    folder = tmp_path_factory.mktemp("routing-check")
    model = tiny_model("qwen3_moe")
    model.save_pretrained(folder / "model")
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    engine = tiny_model("qwen3_moe")
    perturb_routers(engine, seed=9)
    with torch.no_grad(), record_routing(engine) as trace:
        engine(ids)
    np.save(folder / "routes.npy", trace.to_routed_experts(0).numpy().astype(np.int32))
    np.save(folder / "ids.npy", ids[0].numpy())
    with torch.no_grad(), record_routing(model) as natural:
        model(ids)
    return folder, compare_routing(trace, natural)


def test_routing_check_reports_the_agreement_and_plots(rollout, capsys):
    from modelpatch.cli import main

    folder, expected = rollout
    assert expected.router_disagreement_rate > 0
    argv = ["routing-check", "--model", str(folder / "model"), "--routes", str(folder / "routes.npy")]
    argv += ["--input-ids", str(folder / "ids.npy"), "--plot", str(folder / "drift.png")]
    assert main([*argv, "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["router_disagreement_rate"] == expected.router_disagreement_rate
    assert report["token_flip_rate"] == expected.token_flip_rate
    assert [layer["layer"] for layer in report["layers"]] == [0, 1]
    assert report["replayed_logits_max_abs_diff"] > 0  # forcing other experts changes the output
    from PIL import Image

    with Image.open(folder / "drift.png") as image:
        assert image.size[0] >= 300 and image.size[1] >= 200
    assert main(argv[:-2]) == 0
    out = capsys.readouterr().out
    assert f"router disagreement {expected.router_disagreement_rate:.2%}" in out


def test_routing_check_errors_are_one_line(rollout, capsys):
    from modelpatch.cli import main

    folder, _ = rollout
    base = ["routing-check", "--model", str(folder / "model")]
    assert main([*base, "--routes", str(folder / "routes.npy")]) == 2
    assert "--input-ids is required" in capsys.readouterr().err
    bad = np.load(folder / "routes.npy")
    bad[0] = 0  # a zero-filled row (top-2)
    np.save(folder / "bad.npy", bad)
    assert main([*base, "--routes", str(folder / "bad.npy"), "--input-ids", str(folder / "ids.npy")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layer 0, sequence 0, row 0: expert ids repeated" in err
    np.save(folder / "batch.npy", np.stack([np.load(folder / "routes.npy")] * 2))  # 2 sequences, ids of 1
    assert main([*base, "--routes", str(folder / "batch.npy"), "--input-ids", str(folder / "ids.npy")]) == 2
    assert "--routes holds a batch of 2 sequences" in capsys.readouterr().err


def test_routing_check_takes_a_saved_generate_trace_as_routing_drift_does(tmp_path, capsys):
    """User trial: ``--routes trace.safetensors`` (``trace.save`` of a recording around a sampling ``generate``, 6
    prompt + 5 new tokens) with the generate output as ``--input-ids`` exited 2 ("sequence lengths [10] vs [11]")
    where the engine array of the same trace and ``routing_drift`` in Python measured it. The command now measures
    as ``routing_drift`` does: the same figures from the trace file, the engine array and Python."""
    import json

    from modelpatch.cli import main

    model = tiny_model("qwen2_moe")
    model.save_pretrained(tmp_path / "model")
    engine = tiny_model("qwen2_moe")
    perturb_routers(engine, seed=9)  # an engine whose weights lag the trainer's: the drift is not 0
    torch.manual_seed(0)
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad(), record_routing(engine) as trace:
        out = engine.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=True, pad_token_id=0)
    assert tuple(out.shape) == (1, 11) and trace.sequence_lengths == [10]  # the last token is never routed
    trace.save(tmp_path / "trace.safetensors")
    np.save(tmp_path / "routes.npy", trace.to_routed_experts(0).numpy().astype(np.int32))
    np.save(tmp_path / "ids.npy", out.numpy())
    expected = routing_drift(model, RoutingTrace.load(tmp_path / "trace.safetensors"), out)
    assert expected.tokens == 10 and 0 < expected.router_disagreement_rate < 1
    reports = {}
    for routes in ("trace.safetensors", "routes.npy"):
        argv = ["routing-check", "--model", str(tmp_path / "model"), "--routes", str(tmp_path / routes)]
        capsys.readouterr()
        assert main([*argv, "--input-ids", str(tmp_path / "ids.npy"), "--json"]) == 0
        reports[routes] = json.loads(capsys.readouterr().out)
    for report in reports.values():
        assert report["router_disagreement_rate"] == expected.router_disagreement_rate
        assert report["token_flip_rate"] == expected.token_flip_rate
        assert report["mean_topk_overlap"] == expected.mean_topk_overlap
        assert [layer["tokens"] for layer in report["layers"]] == [10, 10]
    # both replay the same routes (the last token routed naturally): the same logits
    assert reports["trace.safetensors"] == reports["routes.npy"]
    assert reports["routes.npy"]["replayed_logits_max_abs_diff"] > 0


def test_replay_measures_drift_without_an_extra_forward():
    from modelpatch.routing import RoutingDriftMeter, replay_routing

    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad(), record_routing(model) as rollout:
        model(input_ids=ids, attention_mask=mask)
    perturb_routers(model, seed=11)
    with torch.no_grad(), record_routing(model) as natural:
        model(input_ids=ids, attention_mask=mask)
    meter = RoutingDriftMeter()
    calls, router_inputs = [], {}
    handles = [model.register_forward_pre_hook(lambda *a: calls.append(1))]
    for layer in (0, 1):  # an independent witness of each router's natural choice inside the replayed forward
        gate = model.model.layers[layer].mlp.gate
        handles.append(gate.register_forward_pre_hook(lambda m, a, layer=layer: router_inputs.update({layer: a[0]})))
    with replay_routing(model, rollout, drift=meter):
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    for handle in handles:
        handle.remove()
    assert len(calls) == 1  # measured inside the replay forward itself, no extra forward
    measured = meter.result()
    real = mask.flatten().bool()
    for layer in (0, 1):
        gate = model.model.layers[layer].mlp.gate
        x = router_inputs[layer].reshape(-1, gate.weight.shape[1]).detach()
        choice = torch.nn.functional.linear(x, gate.weight).topk(gate.top_k, dim=-1).indices[real]
        want = torch.cat(rollout.layer_routes(layer))
        common = (choice[:, :, None] == want[:, None, :]).any(-1).sum(-1)
        by_layer = {a.layer: a for a in measured.layers}[layer]
        assert by_layer.tokens == 16
        assert by_layer.disagreement_rate == (common < gate.top_k).double().mean().item()
        assert by_layer.mean_topk_overlap == (common.double() / gate.top_k).mean().item()
    # layer 0 sees the same hidden states as a plain forward: there it equals the comparison of two recordings
    assert measured.layers[0] == compare_routing(rollout, natural).layers[0]
    assert 0 < measured.router_disagreement_rate < 1
