"""Class interception: which classes a patch replaces when a model is built (replacement classes patched in turn,
swaps, containers, ``Conv1D``, modeling modules executed again) and the error when a replacement's signature does
not fit."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch.nn as nn
from transformers import GPT2Model, LlamaModel, MistralModel, PersimmonConfig
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.pytorch_utils import Conv1D

from helpers import Inert, modelpatch_records, tiny_gpt2_config, tiny_llama_config, tiny_mistral_config
from modelpatch import apply_patches, patch_report, register_patch_mapping


class QuietMLP(modeling_llama.LlamaMLP):
    pass


class DecoderLayer(modeling_llama.LlamaDecoderLayer):
    pass


class Attention(modeling_llama.LlamaAttention):
    pass


def mistral_config():
    return tiny_mistral_config(mlp_bias=False)  # mlp_bias: LlamaMLP reads it when swapped in


def test_a_replacement_class_can_itself_be_patched():
    # a library maps MistralMLP -> LlamaMLP; the user's LlamaMLP patch must still apply to Llama
    with apply_patches({"MistralMLP": modeling_llama.LlamaMLP, "LlamaMLP": QuietMLP}) as scope:
        model = LlamaModel(tiny_llama_config())
    assert type(model.layers[0].mlp) is QuietMLP
    assert scope.fired == {"LlamaMLP": 2}


def test_swapping_two_classes():
    mapping = {"LlamaMLP": modeling_mistral.MistralMLP, "MistralMLP": modeling_llama.LlamaMLP}
    with apply_patches(mapping):
        llama = LlamaModel(tiny_llama_config())
        mistral = MistralModel(mistral_config())
    assert type(llama.layers[0].mlp) is modeling_mistral.MistralMLP
    assert type(mistral.layers[0].mlp) is modeling_llama.LlamaMLP


def test_no_false_conflict_when_container_replacement_builds_the_inner_class(caplog):
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        with apply_patches({"LlamaDecoderLayer": DecoderLayer, "LlamaAttention": Attention}) as scope:
            model = LlamaModel(tiny_llama_config())
    assert type(model.layers[0]) is DecoderLayer and type(model.layers[0].self_attn) is Attention
    assert scope.fired == {"LlamaDecoderLayer": 2, "LlamaAttention": 2}
    assert patch_report(model).conflicts == []
    assert "container" not in caplog.text


def test_gpt2_conv1d_is_patchable():
    class QuantConv1D(Conv1D):
        pass

    register_patch_mapping({"Conv1D": QuantConv1D})
    with apply_patches():
        model = GPT2Model(tiny_gpt2_config())
    assert type(model.h[0].attn.c_attn) is QuantConv1D


def test_replacement_with_wrong_signature_names_both_classes():
    class NoLayerIdx(nn.Module):
        def __init__(self, cfg):
            super().__init__()

    with pytest.raises(TypeError) as info:
        with apply_patches({"LlamaAttention": NoLayerIdx}):
            LlamaModel(tiny_llama_config())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "NoLayerIdx" in notes and "LlamaAttention" in notes


# -- modeling modules that run again ----------------------------------------------------------------------------------


def test_classes_of_a_reloaded_modeling_module_are_replaced(caplog):
    # persimmon: a family no other test uses; its namespace is restored afterwards
    from transformers.models.persimmon import modeling_persimmon

    config = PersimmonConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )
    with apply_patches({"PersimmonMLP": Inert}):  # the module is catalogued before the reload
        assert type(modeling_persimmon.PersimmonMLP(config)) is Inert
    saved = dict(vars(modeling_persimmon))
    try:
        importlib.reload(modeling_persimmon)
        assert modeling_persimmon.PersimmonMLP is not saved["PersimmonMLP"]
        with caplog.at_level(logging.WARNING, logger="modelpatch"):
            with apply_patches({"PersimmonMLP": Inert}) as direct:
                mlp = modeling_persimmon.PersimmonMLP(config)
            with apply_patches({"PersimmonMLP": Inert}) as built:
                model = modeling_persimmon.PersimmonModel(config)
        assert type(mlp) is Inert and direct.fired == {"PersimmonMLP": 1}
        assert [type(layer.mlp) for layer in model.layers] == [Inert, Inert] and built.fired == {"PersimmonMLP": 2}
        assert modelpatch_records(caplog, logging.WARNING) == []
    finally:
        vars(modeling_persimmon).clear()
        vars(modeling_persimmon).update(saved)
