"""Replacement modules and helpers for the conversion tests (tiny models, no hub)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from transformers.activations import ACT2FN
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from modelpatch import clear_patch_mapping, register_patch_mapping
from modelpatch.conversion import Chunk, Concatenate, SplitModulelist, WeightConverter

QKV_RULE = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])

PER_EXPERT_RULES = [
    WeightConverter(
        "mlp.experts.gate_up_proj",
        ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
        [Chunk(dim=1), SplitModulelist(dim=0)],
    ),
    WeightConverter("mlp.experts.down_proj", "mlp.experts.*.down_proj.weight", [SplitModulelist(dim=0)]),
]


def _qkv_bias(config) -> bool:
    if config.model_type == "qwen2":
        return True
    if hasattr(config, "qkv_bias"):
        return bool(config.qkv_bias)
    return bool(getattr(config, "attention_bias", False))


class FusedQKVAttention(nn.Module):
    """Decoder self-attention with one ``qkv_proj`` of ``(heads + 2 * kv_heads) * head_dim`` rows (honours GQA)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_size = config.num_attention_heads * self.head_dim
        self.kv_size = config.num_key_value_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=_qkv_bias(config))
        o_bias = bool(getattr(config, "attention_bias", False)) if config.model_type == "llama" else False
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in (q, k, v))
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class FusedQKVBertSelfAttention(nn.Module):
    """BERT self-attention with one ``qkv`` projection (``query``/``key``/``value`` concatenated)."""

    def __init__(self, config, is_causal=False, layer_idx=None):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.scaling = self.attention_head_size**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.is_causal = is_causal
        self.layer_idx = layer_idx

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in self.qkv(hidden_states).chunk(3, dim=-1))
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return out.reshape(*input_shape, -1).contiguous(), weights


class MoeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ModuleListExperts(nn.ModuleList):
    """Per-expert experts: an ``nn.ModuleList`` of one ``MoeMLP`` per expert, in place of the fused experts."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        for _ in range(self.num_experts):
            self.append(MoeMLP(config))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            top_k_pos, token_idx = torch.where(mask[e])
            out = self[e](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


@contextmanager
def patched(mapping):
    """Register class patches for the block (modelpatch core registry), always cleared afterwards."""
    register_patch_mapping(mapping)
    try:
        yield
    finally:
        clear_patch_mapping()


def checkpoint(path) -> dict[str, torch.Tensor]:
    """All tensors of a saved checkpoint folder (single file or shards)."""
    from modelpatch.conversion.io import checkpoint_files

    tensors = {}
    for file in checkpoint_files(path):
        tensors.update(load_file(file))
    return tensors


def randomize_(model, seed: int = 0):
    """Distinct, non-init values in every parameter (so a parameter left at init is caught)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype) * 0.2)
    return model


def assert_same_tensors(actual: dict, expected: dict):
    assert set(actual) == set(expected), (sorted(set(actual) ^ set(expected)))[:10]
    for key, value in expected.items():
        assert actual[key].shape == value.shape, key
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


@pytest.fixture(autouse=True)
def clean_conversions():
    """Every conversion test starts and ends with no user conversion rule registered."""
    from modelpatch.conversion import clear_checkpoint_conversion_mappings

    clear_checkpoint_conversion_mappings()
    yield
    clear_checkpoint_conversion_mappings()


def expected_fused(model_state: dict, ck: dict, fused: str = "qkv_proj", parts=("q_proj", "k_proj", "v_proj")) -> dict:
    """What each parameter of a fused-QKV model must equal, computed from the checkpoint tensors."""
    expected = {}
    for name in model_state:
        if f".{fused}." in name:
            expected[name] = torch.cat([ck[name.replace(f".{fused}.", f".{p}.")] for p in parts])
        elif name in ck:
            expected[name] = ck[name]
        else:  # tied parameter (e.g. lm_head.weight): equals the checkpoint tensor it shares storage with
            ptr = model_state[name].data_ptr()
            twin = next((k for k, v in model_state.items() if k in ck and v.data_ptr() == ptr), None)
            if twin is not None:
                expected[name] = ck[twin]
    return expected


def assert_params_equal(model, expected: dict):
    state = model.state_dict()
    missing = [k for k in state if k not in expected]
    assert not missing, missing
    for key, value in expected.items():
        assert torch.equal(state[key], value.to(state[key].dtype)), key
