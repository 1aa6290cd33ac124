"""Tiny models for tests: hidden size 64, 2 layers, saved with save_pretrained into a temp folder."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    GPTNeoConfig,
    LlamaConfig,
    Qwen2MoeConfig,
)


def tiny_llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_qwen2_moe_config(**overrides) -> Qwen2MoeConfig:
    kwargs = dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=4,
        num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
    )
    kwargs.update(overrides)
    return Qwen2MoeConfig(**kwargs)


def tiny_bert_config(**overrides) -> BertConfig:
    kwargs = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=128, max_position_embeddings=64,
    )
    kwargs.update(overrides)
    return BertConfig(**kwargs)


def tiny_gpt_neo_config(**overrides) -> GPTNeoConfig:
    kwargs = dict(
        hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        vocab_size=128, max_position_embeddings=64, window_size=8,
    )
    kwargs.update(overrides)
    return GPTNeoConfig(**kwargs)


def save_tiny(model_cls, config, path, seed: int = 0):
    """Build ``model_cls(config)`` with a fixed seed, save it to ``path`` and return the model."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    return model


INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7]])
