"""Per-expert linear experts loaded from the fused experts layout (qwen2_moe, qwen3_moe, mixtral) and saved back."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)

from conversion_models import (
    PER_EXPERT_RULES,
    ModuleListExperts,
    assert_same_tensors,
    checkpoint,
    clean_conversions,  # noqa: F401 - autouse fixture
    patched,
    randomize_,
)
from helpers import tiny_mixtral_config, tiny_qwen2_moe_config, tiny_qwen3_moe_config
from modelpatch.conversion import apply_conversion_rules

CASES = {  # 4 experts each (the test shifts expert e by 10 * e), GQA
    "qwen2_moe": (Qwen2MoeForCausalLM, "Qwen2MoeExperts", lambda: tiny_qwen2_moe_config(num_key_value_heads=2)),
    "qwen3_moe": (Qwen3MoeForCausalLM, "Qwen3MoeExperts", tiny_qwen3_moe_config),
    "mixtral": (MixtralForCausalLM, "MixtralExperts", tiny_mixtral_config),
}
IDS = torch.tensor([[3, 17, 99, 4, 55, 23, 8, 1, 2, 9]])


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_per_expert_from_fused_layout(model_type, tmp_path):
    cls, experts_class, make_config = CASES[model_type]
    vanilla = randomize_(cls(make_config())).eval()
    with torch.no_grad():  # make every expert unmistakable: expert e is shifted by 10 * e
        for layer in vanilla.model.layers:
            for e in range(4):
                layer.mlp.experts.gate_up_proj[e] += 10 * e
                layer.mlp.experts.down_proj[e] -= 10 * e
    vanilla.save_pretrained(tmp_path / "fused", save_original_format=False)
    ck = checkpoint(tmp_path / "fused")
    assert "model.layers.0.mlp.experts.gate_up_proj" in ck

    with patched({experts_class: ModuleListExperts}), apply_conversion_rules({model_type: PER_EXPERT_RULES}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "fused")

    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, ModuleListExperts)
        gate_up, down = ck[f"model.layers.{i}.mlp.experts.gate_up_proj"], ck[f"model.layers.{i}.mlp.experts.down_proj"]
        half = gate_up.shape[1] // 2
        for e in range(4):
            assert torch.equal(experts[e].gate_proj.weight, gate_up[e, :half])
            assert torch.equal(experts[e].up_proj.weight, gate_up[e, half:])
            assert torch.equal(experts[e].down_proj.weight, down[e])
    for name, value in model.state_dict().items():
        if ".mlp.experts." not in name:
            assert torch.equal(value, ck[name]), name
    torch.testing.assert_close(model(IDS).logits, vanilla(IDS).logits, atol=1e-5, rtol=0)

    model.save_pretrained(tmp_path / "back")
    assert_same_tensors(checkpoint(tmp_path / "back"), ck)
    assert_same_tensors(cls.from_pretrained(tmp_path / "back").state_dict(), vanilla.state_dict())
