"""Tiny MoE models for the routing tests, built from configs only (no hub access)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

# Families issue 4 requires, with the per-family config keys that make a tiny model exercise routing.
REQUIRED_FAMILIES = [
    "qwen2_moe", "qwen3_moe", "qwen3_next", "mixtral", "olmoe", "deepseek_v3",
    "glm4_moe", "gpt_oss", "granitemoe", "jamba", "minimax", "phimoe",
]

_TINY = dict(
    hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
    max_position_embeddings=256, num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, moe_topk=2, top_k=2, moe_k=2, n_shared_experts=1, n_group=2, topk_group=1,
    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=16, qk_head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=2, sliding_window=None, tie_word_embeddings=False, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, decoder_start_token_id=None, use_cache=True,
)
_PER_FAMILY = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                  mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "minimax": dict(layer_types=["linear_attention", "full_attention"], block_size=16),
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "qwen2_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
}


def tiny_config(model_type: str, **overrides):
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kwargs = {k: v for k, v in {**_TINY, **_PER_FAMILY.get(model_type, {})}.items() if k in default.to_dict()}
    if "qk_rope_head_dim" in kwargs:  # MLA attention: rotary dims are the rope part of the head
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kwargs.update(overrides)
    cfg = cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # routers start near uniform: spread their logits so routing is clear-cut
        for name, module in model.named_modules():
            if type(module).__name__.endswith("Router") and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.weight.normal_(0, 0.5)
    return model.eval()
