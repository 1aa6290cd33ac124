"""Tiny models for tests: hidden size 64, 2 layers, saved with save_pretrained into a temp folder.

Every tiny config of the suite is defined here, once: each ``tiny_<family>_config(**overrides)`` returns a fresh
config (keyword arguments override or add fields). Decoders share :data:`TINY` (GQA: 4 query heads, 2 key/value
heads) and MoE decoders :data:`TINY_MOE` (experts of 32, top-2); only what a family needs is added.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import (
    BertConfig,
    CLIPVisionConfig,
    DeepseekV3Config,
    GPT2Config,
    GPTNeoConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
"""Sizes every tiny decoder config starts from."""

TINY_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
"""Added to :data:`TINY` by MoE decoders that have a separate expert size (4 experts each, set per family)."""


def _config(config_class, *layers: dict, overrides: dict):
    kwargs: dict = {}
    for layer in (*layers, overrides):
        kwargs.update(layer)
    return config_class(**kwargs)


def tiny_llama_config(**overrides) -> LlamaConfig:
    return _config(LlamaConfig, TINY, overrides=overrides)


def tiny_mistral_config(**overrides) -> MistralConfig:
    return _config(MistralConfig, TINY, overrides=overrides)


def tiny_qwen2_config(**overrides) -> Qwen2Config:
    return _config(Qwen2Config, TINY, overrides=overrides)


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    """Qwen3's own ``head_dim`` (128) is kept: its attention is wider than ``hidden_size``, as in the real models."""
    return _config(Qwen3Config, TINY, overrides=overrides)


def tiny_qwen2_moe_config(**overrides) -> Qwen2MoeConfig:
    """Multi-head attention (4 key/value heads) unless overridden: the seed example's fused QKV assumes MHA."""
    return _config(
        Qwen2MoeConfig,
        TINY,
        TINY_MOE,
        dict(shared_expert_intermediate_size=64, num_key_value_heads=4, num_experts=4),
        overrides=overrides,
    )


def tiny_qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    return _config(Qwen3MoeConfig, TINY, TINY_MOE, dict(num_experts=4), overrides=overrides)


def tiny_mixtral_config(**overrides) -> MixtralConfig:
    """Mixtral's experts are ``intermediate_size`` wide (it has no ``moe_intermediate_size``)."""
    return _config(MixtralConfig, TINY, dict(num_local_experts=4, num_experts_per_tok=2), overrides=overrides)


def tiny_olmoe_config(**overrides) -> OlmoeConfig:
    return _config(OlmoeConfig, TINY, dict(num_experts=4, num_experts_per_tok=2), overrides=overrides)


def tiny_deepseek_v3_config(**overrides) -> DeepseekV3Config:
    """Layer 0 dense, layer 1 MoE (4 routed experts, one group); multi-head latent attention without q LoRA."""
    return _config(
        DeepseekV3Config,
        TINY,
        TINY_MOE,
        dict(
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
        overrides=overrides,
    )


def tiny_bert_config(**overrides) -> BertConfig:
    return _config(
        BertConfig,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=128,
            max_position_embeddings=64,
        ),
        overrides=overrides,
    )


def tiny_gpt2_config(**overrides) -> GPT2Config:
    return _config(
        GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64), overrides=overrides
    )


def tiny_gpt_neo_config(**overrides) -> GPTNeoConfig:
    return _config(
        GPTNeoConfig,
        dict(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            vocab_size=128,
            max_position_embeddings=64,
            window_size=8,
        ),
        overrides=overrides,
    )


def tiny_gpt_neox_config(**overrides) -> GPTNeoXConfig:
    return _config(
        GPTNeoXConfig,
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128),
        overrides=overrides,
    )


def tiny_clip_vision_config(**overrides) -> CLIPVisionConfig:
    """A vision tower for tiny Llava models: hidden size 32, 2 layers, 32x32 images in 8x8 patches."""
    return _config(
        CLIPVisionConfig,
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        overrides=overrides,
    )


def save_tiny(model_cls, config, path, seed: int = 0):
    """Build ``model_cls(config)`` with a fixed seed, save it to ``path`` and return the model."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    return model


INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7]])


class Inert(nn.Module):
    """A replacement that takes any constructor arguments and holds nothing: where a test needs a class, not a layer."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def modelpatch_records(caplog, level: int) -> list[str]:
    """The messages modelpatch's own logger emitted at exactly ``level`` (``caplog`` is pytest's fixture)."""
    return [r.getMessage() for r in caplog.records if r.name == "modelpatch" and r.levelno == level]
