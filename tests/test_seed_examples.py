"""The seed examples (the full example and the routing recipe as a user writes them against Transformers' own API:
``transformers.monkey_patching``, ``transformers.conversion_mapping``), ported to modelpatch imports: only the
import lines change."""

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen2MoeModel
from transformers.models.qwen2_moe import modeling_qwen2_moe

from helpers import INPUT_IDS, tiny_qwen2_moe_config
from modelpatch import apply_patches, get_patch_mapping, patch_report, register_patch_mapping, unregister_patch_mapping
from seed_example import FusedQKVAttention, ModuleListExperts, MoeMLP


class CustomExperts(nn.Module):
    """The document's ``apply_patches`` example: a non-subclass replacement for Qwen2MoeExperts."""

    def __init__(self, config):
        super().__init__()
        self.experts = nn.ModuleList(MoeMLP(config) for _ in range(config.num_experts))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for slot in range(top_k_index.shape[-1]):
            for e, expert in enumerate(self.experts):
                rows = top_k_index[:, slot] == e
                if rows.any():
                    out[rows] += expert(hidden_states[rows]) * top_k_weights[rows, slot, None]
        return out


def test_manual_construction_with_non_subclass_experts_survives_init_weights():
    register_patch_mapping({"Qwen2MoeExperts": CustomExperts})
    with apply_patches():
        model = Qwen2MoeModel(tiny_qwen2_moe_config())
    experts = [layer.mlp.experts for layer in model.layers]
    assert [type(e) for e in experts] == [CustomExperts, CustomExperts]
    # the model's _init_weights initialised the replacement's nn.Linear layers as any other Linear:
    # normal(0, initializer_range), not torch's default kaiming-uniform
    weight = experts[0].experts[0].gate_proj.weight
    assert abs(weight.std().item() - model.config.initializer_range) < 0.005
    with torch.no_grad():
        out = model(INPUT_IDS).last_hidden_state
    assert torch.isfinite(out).all()
    # outside the block: originals again
    assert type(Qwen2MoeModel(tiny_qwen2_moe_config()).layers[0].mlp.experts) is modeling_qwen2_moe.Qwen2MoeExperts


def test_full_example_from_config_builds_and_runs():
    register_patch_mapping({"Qwen2MoeExperts": ModuleListExperts, "Qwen2MoeAttention": FusedQKVAttention})
    model = AutoModelForCausalLM.from_config(tiny_qwen2_moe_config(num_key_value_heads=2))
    layer = model.model.layers[0]
    assert type(layer.mlp.experts) is ModuleListExperts
    assert type(layer.self_attn) is FusedQKVAttention
    assert layer.self_attn.qkv_proj.weight.shape == (4 * 16 + 2 * 2 * 16, 64)
    report = patch_report(model)
    assert {(r.path, r.original, r.replacement) for r in report.rows} == {
        (f"model.layers.{i}.{name}", original, replacement)
        for i in range(2)
        for name, original, replacement in [
            ("self_attn", modeling_qwen2_moe.Qwen2MoeAttention, FusedQKVAttention),
            ("mlp.experts", modeling_qwen2_moe.Qwen2MoeExperts, ModuleListExperts),
        ]
    }
    assert report.unmatched_keys == []
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
    assert logits.shape == (1, INPUT_IDS.shape[1], 128) and torch.isfinite(logits).all()


def test_registry_api_as_documented():
    class SequentialExperts(nn.Module):
        def __init__(self, config):
            super().__init__()

    class CustomAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()

    register_patch_mapping(mapping={"Qwen2MoeExperts": SequentialExperts})
    register_patch_mapping(
        mapping={"Qwen2MoeExperts": SequentialExperts, "Qwen2MoeAttention": CustomAttention}, overwrite=True
    )
    assert get_patch_mapping() == {"Qwen2MoeExperts": SequentialExperts, "Qwen2MoeAttention": CustomAttention}
    unregister_patch_mapping(keys=["Qwen2MoeExperts", "Qwen2MoeAttention"])
    assert get_patch_mapping() == {}


def test_regex_example_and_troubleshooting_checks():
    class CustomExpertsPattern(modeling_qwen2_moe.Qwen2MoeExperts):
        pass

    register_patch_mapping(mapping={".*MoeExperts$": CustomExpertsPattern})
    model = Qwen2MoeForCausalLM._from_config(tiny_qwen2_moe_config())
    # "How do I know my patch is working?": inspect the types
    found = {name: type(m) for name, m in model.named_modules() if "experts" in name and name.endswith("experts")}
    assert set(found.values()) == {CustomExpertsPattern}
    assert len(found) == 2
    # "Check the model source": the class name exists in the modeling module
    assert "Qwen2MoeExperts" in dir(modeling_qwen2_moe)


def test_manual_construction_outside_block_uses_originals():
    register_patch_mapping({"Qwen2MoeExperts": CustomExperts})
    model = Qwen2MoeModel(Qwen2MoeConfig(**tiny_qwen2_moe_config().to_diff_dict()))
    assert type(model.layers[0].mlp.experts) is modeling_qwen2_moe.Qwen2MoeExperts
