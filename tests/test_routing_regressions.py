"""Routing failures found by a fresh-user test; each stays as a test."""

import pytest
import torch
from routing_models import perturb_routers, tiny_model

from modelpatch.routing import RoutingTraceError, record_routing, replay_routing

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
