"""Errors and warnings: unmatched rules, shape mismatches, ambiguous splits; nothing half-loaded."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from conversion_models import (
    QKV_RULE,
    FusedQKVAttention,
    clean_conversions,  # noqa: F401 - autouse fixture
    patched,
    randomize_,
)
from helpers import tiny_llama_config
from modelpatch.conversion import (
    Chunk,
    Concatenate,
    ConversionError,
    ConversionShapeError,
    Transpose,
    WeightConverter,
    WeightRenaming,
    apply_conversion_rules,
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    randomize_(LlamaForCausalLM(tiny_llama_config())).save_pretrained(folder)
    return folder


UNUSED = WeightRenaming("does_not_exist", "still_does_not_exist")


def test_rule_matching_nothing_warns_with_its_name(llama, caplog):
    with caplog.at_level(logging.WARNING, logger="modelpatch.conversion"):
        with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [QKV_RULE, UNUSED]}):
            AutoModelForCausalLM.from_pretrained(llama)
    messages = [r.getMessage() for r in caplog.records if r.name == "modelpatch.conversion"]
    assert any("does_not_exist" in m and "'llama'" in m and "matched no checkpoint key" in m for m in messages)


def test_rule_matching_nothing_raises_when_strict(llama):
    with (
        patched({"LlamaAttention": FusedQKVAttention}),
        apply_conversion_rules({"llama": [QKV_RULE, UNUSED]}, strict=True),
    ):
        with pytest.raises(ConversionError, match="does_not_exist"):
            AutoModelForCausalLM.from_pretrained(llama)


def test_shape_mismatch_names_key_and_both_shapes(llama):
    transposed = WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(dim=0), Transpose(0, 1)])
    with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [transposed]}):
        with pytest.raises(ConversionShapeError) as info:
            AutoModelForCausalLM.from_pretrained(llama)
    error = info.value
    assert error.key == "model.layers.0.self_attn.qkv_proj.weight"
    assert error.converted_shape == (64, 128) and error.expected_shape == (128, 64)
    assert "model.layers.0.self_attn.qkv_proj.weight" in str(error) and "(64, 128)" in str(error)


def test_target_that_is_not_a_parameter_is_an_error(llama):
    typo = WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_projection", [Concatenate(dim=0)])
    with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [typo]}):
        with pytest.raises(ConversionError, match="qkv_projection"):
            AutoModelForCausalLM.from_pretrained(llama)


def test_chunk_unequal_sizes_round_trip_exactly():
    q, k, v = torch.randn(64, 8), torch.randn(32, 8), torch.randn(32, 8)
    fused = Concatenate(dim=0).convert({"q": [q], "k": [k], "v": [v]}, ["q", "k", "v"], ["qkv"])["qkv"]
    pieces = Chunk(dim=0, sizes=[64, 32, 32]).convert({"qkv": [fused]}, ["qkv"], ["q", "k", "v"])
    assert all(torch.equal(a, b) for a, b in zip(pieces.values(), (q, k, v)))
    by_reference = Concatenate(dim=0).reverse_op.convert(
        {"qkv": [fused]},
        ["qkv"],
        ["q_proj", "k_proj", "v_proj"],
        full_layer_name="l.0.q_proj.weight",
        reference_shapes={"l.0.q_proj.weight": (64, 8), "l.0.k_proj.weight": (32, 8), "l.0.v_proj.weight": (32, 8)},
    )
    assert [t.shape[0] for t in by_reference.values()] == [64, 32, 32]


def test_chunk_never_guesses_equal_sizes_for_named_targets():
    with pytest.raises(ConversionError, match="sizes="):
        Chunk(dim=0).convert(
            {"qkv": [torch.zeros(128, 8)]},
            ["qkv"],
            ["q_proj", "k_proj", "v_proj"],
            full_layer_name="l.0.q_proj.weight",
            reference_shapes={},
        )
    with pytest.raises(ConversionError, match="do not split"):
        Chunk(dim=0, sizes=[64, 32, 30]).convert({"qkv": [torch.zeros(128, 8)]}, ["qkv"], ["q", "k", "v"])


def test_incomplete_group_is_an_error(llama, tmp_path):
    from safetensors.torch import load_file

    from modelpatch.conversion import load_converted_state_dict

    state = load_file(llama / "model.safetensors")
    del state["model.layers.1.self_attn.v_proj.weight"]
    with patched({"LlamaAttention": FusedQKVAttention}):
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConversionError, match="v_proj"):
        load_converted_state_dict(model, state, rules=[QKV_RULE])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
