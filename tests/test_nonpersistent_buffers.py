"""A replacement's non-persistent buffers (``register_buffer(..., persistent=False)``) hold what its ``__init__``
computes after ``from_pretrained``: Transformers builds on ``meta`` and re-creates every non-persistent buffer with
``torch.empty_like``, filling only its own (``_init_weights``); a replacement's held uninitialised memory."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaRotaryEmbedding

from helpers import save_tiny, tiny_llama_config
from modelpatch import ModelpatchError, apply_patches, patch_model


class Scaled(LlamaAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.register_buffer("scale", torch.arange(4.0) + 1 + layer_idx, persistent=False)


class WithRope(LlamaAttention):
    """A Transformers rotary embedding inside a replacement: its ``inv_freq`` is Transformers' own buffer."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.rope = LlamaRotaryEmbedding(config)


class Rope(LlamaRotaryEmbedding):
    """Subclass of a rotary embedding: ``inv_freq`` is inherited (Transformers' value), ``shift`` is its own."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("shift", torch.full((3,), 0.5), persistent=False)


class Layer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.register_buffer("mask", torch.tensor([True, False, True]), persistent=False)


class FromWeight(LlamaAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.register_buffer("first", self.q_proj.weight.detach()[0].clone(), persistent=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny(LlamaForCausalLM, tiny_llama_config(), path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replacement_buffer_holds_its_init_value_after_from_pretrained(checkpoint, dtype):
    with apply_patches({"LlamaAttention": Scaled}):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    for idx, layer in enumerate(model.model.layers):
        scale = layer.self_attn.scale
        assert scale.dtype == dtype  # as Transformers allocated it (built under the load's default dtype)
        assert scale.tolist() == [1.0 + idx, 2.0 + idx, 3.0 + idx, 4.0 + idx]
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("rope", [False, True])
def test_nested_replacements_and_transformers_submodules_get_their_buffers(checkpoint, rope):
    mapping: dict = {"LlamaDecoderLayer": Layer, "LlamaAttention": WithRope}
    if rope:  # Rope then replaces the rotary embedding inside WithRope too (a nested replacement)
        mapping["LlamaRotaryEmbedding"] = Rope
    with apply_patches(mapping):
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
    plain = AutoModelForCausalLM.from_pretrained(checkpoint)
    expected = LlamaRotaryEmbedding(tiny_llama_config())
    rotaries = [model.model.rotary_emb] + [layer.self_attn.rope for layer in model.model.layers]
    for layer in model.model.layers:
        assert type(layer) is Layer and type(layer.self_attn) is WithRope
        assert layer.mask.tolist() == [True, False, True]
    for rotary in rotaries:
        assert type(rotary) is (Rope if rope else LlamaRotaryEmbedding)
        if rope:  # inv_freq is inherited (Transformers' value), shift is its own
            assert rotary.shift.tolist() == [0.5] * 3
        torch.testing.assert_close(rotary.inv_freq, expected.inv_freq, rtol=0, atol=0)
        torch.testing.assert_close(rotary.original_inv_freq, expected.original_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_a_buffer_that_cannot_be_recomputed_raises_naming_module_class_and_buffer(checkpoint):
    with apply_patches({"LlamaAttention": FromWeight}), pytest.raises(ModelpatchError) as caught:
        AutoModelForCausalLM.from_pretrained(checkpoint)
    message = str(caught.value)
    assert "'model.layers.0.self_attn'" in message and "FromWeight" in message and "'first'" in message


def test_from_config_and_patch_model_give_init_values(checkpoint):
    with apply_patches({"LlamaAttention": Scaled}):
        built = AutoModelForCausalLM.from_config(tiny_llama_config())
    assert built.model.layers[1].self_attn.scale.tolist() == [2.0, 3.0, 4.0, 5.0]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    with patch_model(model, {"LlamaAttention": Scaled}):
        assert model.model.layers[1].self_attn.scale.tolist() == [2.0, 3.0, 4.0, 5.0]


def test_a_quantized_load_gives_init_values(checkpoint):
    from quantization_support import quantization_config

    with apply_patches({"LlamaAttention": Scaled}):
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, quantization_config=quantization_config("torchao-int8")
        )
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    assert model.model.layers[1].self_attn.scale.tolist() == [2.0, 3.0, 4.0, 5.0]
