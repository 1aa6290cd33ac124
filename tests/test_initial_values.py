"""A replacement's own parameters that the checkpoint does not provide keep the values its ``__init__`` gives them
(``from_pretrained`` allocates without running ``__init__`` on real memory: they held values like 1e34)."""

import logging

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from helpers import save_tiny, tiny_llama_config
from modelpatch import ConversionError, allow_init_values, apply_patches


class Gated(LlamaAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.gate = nn.Parameter(torch.full((1,), 3.0))
        self.register_buffer("mult", torch.full((1,), 5.0))


class Wrapped(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.inner = LlamaAttention(config, layer_idx)
        self.scale = nn.Parameter(torch.full((4,), 7.0))

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_own_parameters_missing_from_the_checkpoint_get_their_init_values(tmp_path):
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    with apply_patches({"LlamaAttention": Gated}):
        gated = AutoModelForCausalLM.from_pretrained(tmp_path)
    for layer in gated.model.layers:
        assert layer.self_attn.gate.tolist() == [3.0] and layer.self_attn.mult.tolist() == [5.0]


def test_checkpoint_tensors_no_rule_read_are_an_error_unless_allowed(tmp_path):
    """``Wrapped`` moves q/k/v/o under ``inner``: the checkpoint's ``self_attn.q_proj.weight`` ... are left unread
    and the replacement's ``inner.*`` would compute with init values: an error naming both, nothing returned."""
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    with pytest.raises(ConversionError) as info, apply_patches({"LlamaAttention": Wrapped}):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(info.value)
    assert "model.layers.0.self_attn (Wrapped replacing LlamaAttention): inner.k_proj.weight" in message
    assert "model.layers.0.self_attn: model.layers.0.self_attn.k_proj.weight" in message
    assert "allow_init_values()" in message
    with allow_init_values(), apply_patches({"LlamaAttention": Wrapped}):
        wrapped = AutoModelForCausalLM.from_pretrained(tmp_path)
    for layer in wrapped.model.layers:
        assert layer.self_attn.scale.tolist() == [7.0] * 4
        assert torch.isfinite(layer.self_attn.inner.q_proj.weight).all()
        assert layer.self_attn.inner.q_proj.weight.abs().max() < 1.0  # the model's init (std 0.02), not garbage


def test_replacement_parameters_missing_from_checkpoint_are_named(tmp_path, caplog):
    # a fused replacement loaded without conversion rules: Transformers initialises qkv_proj at random
    from modelpatch import ConversionError, allow_init_values
    from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention

    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    # the checkpoint's q/k/v tensors are there, unread: an error by default (it was a warning, and a model whose
    # qkv_proj computed with random values)
    with pytest.raises(ConversionError) as info, apply_patches({"LlamaAttention": FusedQKVLlamaAttention}):
        LlamaForCausalLM.from_pretrained(tmp_path)
    assert "model.layers.0.self_attn (FusedQKVLlamaAttention replacing LlamaAttention): qkv_proj.weight" in str(
        info.value
    )
    with allow_init_values(), caplog.at_level(logging.WARNING, logger="modelpatch"):
        with apply_patches({"LlamaAttention": FusedQKVLlamaAttention}):
            LlamaForCausalLM.from_pretrained(tmp_path)
    assert "model.layers.0.self_attn (FusedQKVLlamaAttention replacing LlamaAttention): qkv_proj.weight" in caplog.text
    with pytest.raises(ConversionError, match="model.layers.1.self_attn"):
        with apply_patches({"LlamaAttention": FusedQKVLlamaAttention}, strict=True):
            LlamaForCausalLM.from_pretrained(tmp_path)
