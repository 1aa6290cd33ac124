"""``calibrate_all_experts``: every expert of every per-expert MoE layer sees every token; outputs unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import modelpatch
from helpers import tiny_mixtral_config, tiny_qwen3_moe_config
from modelpatch.errors import ModelpatchValueError
from modelpatch.recipes import LinearExperts, get_recipe

# 8 experts, top-1, 6 tokens: some experts get no token in a plain forward (asserted below, so the test shows that
# calibration reaches experts the router never picks)
CASES = {
    "qwen3_moe": lambda: tiny_qwen3_moe_config(num_experts=8, num_experts_per_tok=1),
    "mixtral": lambda: tiny_mixtral_config(num_local_experts=8, num_experts_per_tok=1),
}


def _build(model_type):
    torch.manual_seed(0)
    with get_recipe(f"{model_type}-linear-experts").apply():
        model = AutoModelForCausalLM.from_config(CASES[model_type]())
    return model.eval()


def _rows_seen(model):
    """``{linear name: [rows of each call]}`` for every Linear of every expert, and the hook handles."""
    seen: dict[str, list[int]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".experts." in name:
            seen[name] = []
            handles.append(module.register_forward_hook(lambda m, args, out, n=name: seen[n].append(args[0].shape[0])))
    return seen, handles


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_every_expert_sees_every_token_and_outputs_are_unchanged(model_type):
    model = _build(model_type)
    ids = torch.tensor([[3, 17, 42, 99, 5, 64]])
    tokens = ids.numel()
    seen, handles = _rows_seen(model)
    with torch.no_grad():
        plain = model(ids).logits
    dead = [name for name, calls in seen.items() if not calls]
    assert dead, "precondition: some expert gets no token in the plain forward"
    for calls in seen.values():
        calls.clear()
    with torch.no_grad(), modelpatch.calibrate_all_experts(model) as names:
        calibrated = model(ids).logits
    assert names == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert set(seen) and all(calls == [tokens] for calls in seen.values()), seen
    assert (calibrated - plain).abs().max().item() <= 1e-6
    for calls in seen.values():
        calls.clear()
    with torch.no_grad():
        again = model(ids).logits
    assert torch.equal(again, plain)
    assert {name for name, calls in seen.items() if not calls} == set(dead)
    for handle in handles:
        handle.remove()


def test_gradients_flow_and_forward_is_restored_on_error():
    model = _build("qwen3_moe")
    ids = torch.tensor([[3, 17, 42, 99]])
    experts = [m for m in model.modules() if isinstance(m, LinearExperts)]
    with pytest.raises(RuntimeError, match="boom"):
        with modelpatch.calibrate_all_experts(model):
            assert all("forward" in m.__dict__ for m in experts)
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in experts)
    plain = model(ids).logits
    plain.sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    model.zero_grad()
    with modelpatch.calibrate_all_experts(model):
        model(ids).logits.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # unrouted experts get zero gradients (their outputs are not used): the routed ones equal the plain gradients
    for name, grad in reference.items():
        assert (grads[name] - grad).abs().max().item() <= 1e-5 * max(1.0, grad.abs().max().item()), name
    assert all(grads[n].abs().max().item() == 0 for n in set(grads) - set(reference))


def test_model_without_per_expert_layers_is_refused_naming_its_fused_experts():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_moe_config())
    with pytest.raises(
        ModelpatchValueError, match=r"Qwen3MoeForCausalLM.*model\.layers\.0\.mlp\.experts.*linear-experts"
    ):
        with modelpatch.calibrate_all_experts(model):
            pass
