"""Router kinds and limits of single families: DeepSeek-V4's hash routing (replayed), and the families discovery
refuses with the reason (JetMoE's and Ernie-4.5-VL's two routers per layer, ZAYA's skip class, Doge)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from modelpatch.routing import (
    RouterContractError,
    RoutingDiscoveryError,
    find_router_sites,
    record_routing,
    replay_routing,
)
from modelpatch.routing.kinds import HASH_LOOKUP, TOPK
from routing_models import ExpertsObserver, fill_hash_table, tiny_config, tiny_model


def _tiny(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="eager").eval()


def test_deepseek_v4_hash_layers_record_the_table_and_replay_the_trace():
    model = _tiny("deepseek_v4")  # layer 0 "hash_moe", layer 1 "moe"
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        fill_hash_table(gate)
    sites, _, _ = find_router_sites(model)
    assert [(s.layer_idx, type(s.module).__name__, s.kind) for s in sites] == [
        (0, "DeepseekV4HashRouter", HASH_LOOKUP),
        (1, "DeepseekV4TopKRouter", TOPK),
    ]
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with ExpertsObserver(model) as recorded, record_routing(model) as trace:
            logits = model(ids).logits
        assert len(trace[0]) == 2  # one entry per sequence
        assert torch.equal(torch.cat(trace[0]), gate.tid2eid[ids.reshape(-1)])  # the lookup, recorded as it was
        assert torch.equal(recorded.indices(0), torch.cat(trace[0]))

        table = gate.tid2eid.clone()
        gate.tid2eid.copy_((table + 1) % gate.num_experts)  # another table: natural routing changes
        with ExpertsObserver(model) as natural:
            natural_logits = model(ids).logits
        assert not torch.equal(natural.indices(0), torch.cat(trace[0]))
        assert not torch.equal(natural_logits, logits)

        with ExpertsObserver(model) as replayed, replay_routing(model, trace):
            replayed_logits = model(ids).logits
    for layer in (0, 1):  # the recorded experts, weighted exactly as when they were chosen
        assert torch.equal(replayed.indices(layer), torch.cat(trace[layer]))
        assert torch.equal(replayed.calls[layer][0][1], recorded.calls[layer][0][1])
    assert torch.equal(replayed_logits, logits)
    assert torch.equal(gate.tid2eid, (table + 1) % gate.num_experts)  # the model keeps its own table


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        (
            "jetmoe",
            "two routers in decoder layer 0 ('model.layers.0.mlp.router' and "
            "'model.layers.0.self_attention.experts.router'): a routing trace holds the routes of one router per "
            "decoder layer (keyed by layer index)",
        ),
        ("zaya", "router 'model.layers.0.mlp.gate' (ZayaRouter) is not supported: top-1 over num_experts + 1 classes"),
        ("doge", "DogeForCausalLM is not supported: product-key expert retrieval inside DogeCDMoE"),
    ],
)
def test_discovery_refuses_families_it_cannot_replay_with_the_reason(model_type, message):
    model = _tiny(model_type)
    forwards = {name: m.forward for name, m in model.named_modules()}
    with pytest.raises(RoutingDiscoveryError) as raised:
        with record_routing(model):
            pass
    assert str(raised.value).startswith(message), str(raised.value)
    assert all(m.forward == forwards[name] for name, m in model.named_modules())  # nothing installed


def _change_returned_ids(model, change):
    """Make every Qwen2-MoE router of ``model`` return its top-k's ids changed by ``change(idx, scores)``."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    class Changed(Qwen2MoeTopKRouter):
        def forward(self, hidden_states):
            logits, scores, idx = super().forward(hidden_states)  # one torch.topk
            idx, scores = idx.clone(), scores.clone()
            change(idx, scores)
            return logits, scores, idx

    for module in model.modules():
        if type(module) is Qwen2MoeTopKRouter:
            module.__class__ = Changed


def _other_second_expert(idx, scores):
    idx[0, 1] = (idx[0, 1] + 1) % 8
    idx[0, 1] = (idx[0, 1] + (idx[0, 1] == idx[0, 0]).long()) % 8


def test_a_router_returning_other_experts_than_its_topk_is_refused_by_record_and_replay():
    # the block combines the experts the router returns: a trace of the topk's ids would not be what it used
    model = tiny_model("qwen2_moe").eval()
    ids = torch.arange(12).reshape(2, 6)
    with record_routing(model) as trace:
        model(input_ids=ids)
    _change_returned_ids(model, _other_second_expert)
    message = r"layer 0 \(Changed\): the router returns other expert ids than its torch.topk chose \(1 of 12 tokens"
    with pytest.raises(RouterContractError, match=message):
        with record_routing(model):
            model(input_ids=ids)
    with pytest.raises(RouterContractError, match=message):
        with replay_routing(model, trace):
            model(input_ids=ids)


def test_a_router_returning_its_topk_experts_in_another_order_is_recorded():
    model = tiny_model("qwen2_moe").eval()
    ids = torch.arange(12).reshape(2, 6)
    with record_routing(model) as expected:
        model(input_ids=ids)
    _change_returned_ids(
        model, lambda idx, scores: (idx[-1].copy_(idx[-1].flip(0)), scores[-1].copy_(scores[-1].flip(0)))
    )
    with record_routing(model) as trace:
        model(input_ids=ids)
    for layer in expected.layers:
        for want, got in zip(expected.layer_routes(layer), trace.layer_routes(layer)):
            assert torch.equal(want, got)
