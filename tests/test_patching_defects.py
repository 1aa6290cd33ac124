"""Defects of class patching and output capture found by trying the product as a user would (recorders on head
models, modeling modules that run again, keys of another model family, hints); each test failed before its fix,
except the ``start()``/``stop()`` ones (a feature that had no test)."""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import re
import sys

import pytest
import torch
import torch.nn as nn
from transformers import (
    AutoConfig,
    AutoModel,
    LlamaForCausalLM,
    LlamaModel,
    PersimmonConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

from helpers import INPUT_IDS, save_tiny, tiny_llama_config, tiny_qwen2_moe_config
from modelpatch import (
    OutputRecorder,
    UnmatchedPatchKeyError,
    apply_patches,
    patch_report,
    register_output_recorder,
    register_patch_mapping,
    set_strict_patching,
    unregister_output_recorder,
)
from modelpatch.errors import ModelpatchRuntimeError, ModelpatchTypeError
from modelpatch.patching.scopes import active_scopes


class LlamaAttn(modeling_llama.LlamaAttention):
    pass


class Qwen2Attn(modeling_qwen2.Qwen2Attention):
    pass


class QuietMLP(modeling_llama.LlamaMLP):
    pass


class Inert(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()


def _modelpatch_records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "modelpatch" and r.levelno == level]


# -- a recorder registered on a head model ------------------------------------------------------------------------


def _tiny_qwen3_moe_config():
    return Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=128,
    )


@pytest.mark.parametrize(
    "head_cls, config_fn, router_cls",
    [
        (Qwen2MoeForCausalLM, tiny_qwen2_moe_config, modeling_qwen2_moe.Qwen2MoeTopKRouter),
        (Qwen3MoeForCausalLM, _tiny_qwen3_moe_config, modeling_qwen3_moe.Qwen3MoeTopKRouter),
    ],
    ids=["qwen2_moe", "qwen3_moe"],
)
def test_head_model_returns_a_recorder_registered_on_it(head_cls, config_fn, router_cls):
    torch.manual_seed(0)
    lm = head_cls(config_fn()).eval()
    register_output_recorder(lm, "selected_experts", OutputRecorder(router_cls, index=2))
    with torch.no_grad():
        out = lm(INPUT_IDS, output_selected_experts=True)
        base = lm.model(INPUT_IDS, output_selected_experts=True)
        as_tuple = lm(INPUT_IDS, output_selected_experts=True, return_dict=False)
        plain = lm(INPUT_IDS)
    assert len(base.selected_experts) == 2
    assert len(out.selected_experts) == 2  # one (tokens, top_k) tensor per layer, as the base model captures
    assert [t.shape for t in out.selected_experts] == [torch.Size([INPUT_IDS.shape[1], 2])] * 2
    assert all(torch.equal(a, b) for a, b in zip(out.selected_experts, base.selected_experts))
    assert torch.equal(out.logits, plain.logits)
    assert "selected_experts" not in plain  # not requested: no field
    # return_dict=False: the tuple comes last, as to_tuple() places a new field
    assert len(as_tuple) == len(plain.to_tuple()) + 1
    assert all(torch.equal(a, b) for a, b in zip(as_tuple[-1], base.selected_experts))


def test_head_recorder_survives_deepcopy_and_is_removed_by_unregister():
    torch.manual_seed(0)
    lm = Qwen2MoeForCausalLM(tiny_qwen2_moe_config()).eval()
    register_output_recorder(lm, "selected_experts", OutputRecorder(modeling_qwen2_moe.Qwen2MoeTopKRouter, index=2))
    clone = copy.deepcopy(lm)
    with torch.no_grad():
        expected = lm(INPUT_IDS, output_selected_experts=True).selected_experts
        got = clone(INPUT_IDS, output_selected_experts=True).selected_experts
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, expected))
    unregister_output_recorder(lm, "selected_experts")
    assert (len(lm._forward_pre_hooks), len(lm._forward_hooks)) == (0, 0)
    with torch.no_grad():
        assert "selected_experts" not in lm(INPUT_IDS, output_selected_experts=True)


def test_head_class_registration_is_refused_with_the_fix_named():
    with pytest.raises(ModelpatchTypeError, match=r"register on a model instance .* or on the class of the base model"):
        register_output_recorder(Qwen2MoeForCausalLM, "selected_experts", modeling_qwen2_moe.Qwen2MoeTopKRouter)
    with pytest.raises(TypeError, match="Qwen2MoePreTrainedModel does not capture outputs itself"):
        register_output_recorder(
            modeling_qwen2_moe.Qwen2MoePreTrainedModel, "selected_experts", modeling_qwen2_moe.Qwen2MoeTopKRouter
        )
