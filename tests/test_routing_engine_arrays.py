"""Inference-engine routed-experts arrays <-> RoutingTrace (vLLM ``CompletionOutput.routed_experts`` layout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelpatch.routing import RoutingTrace, RoutingTraceError, record_routing, replay_routing
from routing_models import ExpertsObserver, perturb_routers, tiny_model


@pytest.fixture(scope="module")
def deepseek():
    return tiny_model("deepseek_v3", num_hidden_layers=3)  # layer 0 dense, layers 1-2 MoE, 8 experts, top-2


def _engine_array(trace, seq, dense_value=0, dtype=np.int32):
    """What vLLM returns: (seq_len, num_hidden_layers, top_k), zeros on dense layers."""
    arr = trace.to_routed_experts(seq, dense_fill=dense_value).numpy().astype(dtype)
    return arr


def test_vllm_array_with_dense_zeros_and_one_row_short(deepseek):
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(deepseek) as trace:
        deepseek(ids)
    arr = _engine_array(trace, 0)[:-1]  # the engine never routes the last token
    assert arr.shape == (6, 3, 2) and (arr[:, 0] == 0).all()
    back = RoutingTrace.from_routed_experts(arr, deepseek, seq_lens=[7])
    assert back.layers == (1, 2)  # dense layer 0's zeros are not read as expert 0
    for layer in back.layers:
        assert torch.equal(back[layer][0][:-1], trace[layer][0][:-1])
        assert back[layer][0][-1].tolist() == [-1, -1]
    perturb_routers(deepseek, seed=3)
    with torch.no_grad(), ExpertsObserver(deepseek) as seen, replay_routing(deepseek, back):
        deepseek(ids)
    for layer in back.layers:
        assert torch.equal(seen.indices(layer)[:-1], trace[layer][0][:-1])
    assert torch.equal(back.to_routed_experts(0, layer_axis="moe")[:-1], torch.from_numpy(arr[:, 1:]))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int16, np.int32, np.int64, "torch.int32", "torch.uint8"])
def test_any_integer_dtype_and_moe_only_axis(deepseek, dtype):
    rng = np.random.default_rng(0)
    arr = np.stack([rng.permutation(8)[:2] for _ in range(10)])[:, None, :].repeat(2, axis=1)  # (10, 2 MoE, 2)
    if isinstance(dtype, str):
        src = torch.from_numpy(arr).to(getattr(torch, dtype.split(".")[1]))
    else:
        src = arr.astype(dtype)
    trace = RoutingTrace.from_routed_experts(src, deepseek)  # 2 == number of MoE layers: MoE-only axis
    assert trace.layers == (1, 2) and trace[1][0].tolist() == arr[:, 0].tolist()
    assert trace.to_routed_experts(0).shape == (10, 3, 2)


def test_ids_above_255_survive_uint16(tmp_path):
    model = tiny_model("qwen3_moe", num_experts=300, num_local_experts=300)
    rng = np.random.default_rng(1)
    arr = np.stack([rng.permutation(300)[:2] for _ in range(5)])[:, None, :].repeat(2, axis=1).astype(np.uint16)
    arr[0, :, 0] = 299
    trace = RoutingTrace.from_routed_experts(arr, model)
    trace.save(tmp_path / "t.safetensors")
    back = RoutingTrace.load(tmp_path / "t.safetensors")
    assert back[0][0][0, 0].item() == 299 and back == trace
    assert back.to_routed_experts(0, dtype=torch.int64).numpy().tolist() == arr.astype(np.int64).tolist()


def test_errors_name_layer_expected_and_received(deepseek):
    arr = np.zeros((4, 3, 2), dtype=np.int32)
    arr[:, 1:] = [0, 1]
    arr[2, 2] = [1, 8]
    with pytest.raises(
        RoutingTraceError, match=r"layer 2, sequence 0, row 2: expert ids must be in \[0, 8\) or -1, received \[1, 8\]"
    ):
        RoutingTrace.from_routed_experts(arr, deepseek)
    with pytest.raises(
        RoutingTraceError,
        match=r"layer axis: expected 3 \(all hidden layers\) or 2 \(MoE layers \[1, 2\]\), received 5",
    ):
        RoutingTrace.from_routed_experts(np.zeros((4, 5, 2), np.int32), deepseek)
    with pytest.raises(RoutingTraceError, match=r"layer 1, sequence 0: expected top_k 2, received 3"):
        RoutingTrace.from_routed_experts(np.zeros((4, 2, 3), np.int32), deepseek)
    with pytest.raises(RoutingTraceError, match=r"layer 1, sequence 0: expected 9 or 8 rows, received 4"):
        RoutingTrace.from_routed_experts(np.tile(np.array([0, 1], np.int32), (4, 2, 1)), deepseek, seq_lens=[9])
    with pytest.raises(RoutingTraceError, match="expected an integer array"):
        RoutingTrace.from_routed_experts(np.zeros((4, 2, 2), np.float32), deepseek)


def test_layer_axis_error_names_the_layer_count_once_when_every_layer_is_moe():
    model = tiny_model("qwen2_moe")  # 2 hidden layers, both MoE, top-2
    with pytest.raises(RoutingTraceError) as caught:
        RoutingTrace.from_routed_experts(np.zeros((4, 5, 2), np.int32), model)
    assert str(caught.value) == "layer axis: expected 2 (every hidden layer is an MoE layer), received 5"


def test_padded_batch_and_minus_one(deepseek):
    base = np.tile(np.array([3, 5], np.int64), (6, 2, 1))
    batch = np.stack([base, base])
    batch[0, :2] = 0  # left padding (garbage) on row 0
    batch[1, 4:] = 7  # right padding on row 1 (7,7 would be an invalid row if read)
    batch[0, 3] = -1  # no route
    mask = np.ones((2, 6), np.int64)
    mask[0, :2] = 0
    mask[1, 4:] = 0
    trace = RoutingTrace.from_routed_experts(batch, deepseek, attention_mask=mask)
    assert trace.sequence_lengths == [4, 4]
    assert trace[1][0].tolist() == [[3, 5], [-1, -1], [3, 5], [3, 5]]


def test_multi_turn_stitching(deepseek):
    g = torch.Generator().manual_seed(2)
    turn1_ids = torch.randint(3, 128, (1, 6), generator=g)
    turn2_ids = torch.cat([turn1_ids, torch.randint(3, 128, (1, 4), generator=g)], dim=1)
    with torch.no_grad(), record_routing(deepseek) as t1:
        deepseek(turn1_ids)
    with torch.no_grad(), record_routing(deepseek) as t2:
        deepseek(turn2_ids)
    # engine view: turn 1's last token unrouted; turn 2 routes the whole conversation
    a1 = RoutingTrace.from_routed_experts(t1.to_routed_experts(0)[:-1], deepseek, seq_lens=[6])
    a2 = RoutingTrace.from_routed_experts(t2.to_routed_experts(0), deepseek)
    stitched = a1.extend(a2)
    assert stitched.sequence_lengths == [10]
    for layer in stitched.layers:
        assert torch.equal(stitched[layer][0][:5], t1[layer][0][:5])
        assert torch.equal(stitched[layer][0][5:], t2[layer][0][5:])  # the free row filled by turn 2
    # turn 2 given as the new tokens only
    only_new = RoutingTrace({layer: [t2[layer][0][6:]] for layer in t2.layers}, num_experts=8, top_k=2)
    assert a1.extend(only_new, next_turn_offset=6).sequence_lengths == [10]
    with pytest.raises(RoutingTraceError, match="next turn starts at token 7, expected at most 6"):
        a1.extend(only_new, next_turn_offset=7)
