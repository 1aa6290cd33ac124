"""Other load paths (load_converted_state_dict) and offline conversion (convert_checkpoint)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from conversion_models import (
    QKV_RULE,
    FusedQKVAttention,
    assert_params_equal,
    assert_same_tensors,
    checkpoint,
    clean_conversions,  # noqa: F401 - autouse fixture
    expected_fused,
    patched,
    randomize_,
)
from helpers import save_tiny, tiny_llama_config, tiny_qwen2_moe_config
from modelpatch.conversion import (
    ConversionError,
    apply_conversion_rules,
    conversion_report,
    convert_checkpoint,
    load_converted_state_dict,
    register_checkpoint_conversion_mapping,
)


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-sharded")
    randomize_(LlamaForCausalLM(tiny_llama_config())).save_pretrained(folder, max_shard_size="40KB")
    return folder, checkpoint(folder)


def _fused_model():
    with patched({"LlamaAttention": FusedQKVAttention}):
        return AutoModelForCausalLM.from_config(tiny_llama_config())


@pytest.mark.parametrize("source", ["path", "state_dict"])
def test_load_converted_state_dict(source, sharded_llama, tmp_path):
    folder, ck = sharded_llama
    model = _fused_model()
    rows = load_converted_state_dict(model, folder if source == "path" else dict(ck), rules=[QKV_RULE])
    assert len(rows) == 2 and rows == conversion_report(model)
    assert_params_equal(model, expected_fused(model.state_dict(), ck))
    model.save_pretrained(tmp_path)  # remembers the rules: original layout again
    assert_same_tensors(checkpoint(tmp_path), ck)


def test_load_converted_state_dict_uses_registered_rules_and_refuses_leftovers(sharded_llama):
    folder, ck = sharded_llama
    model = _fused_model()
    with pytest.raises(ConversionError, match="unexpected keys"):
        load_converted_state_dict(model, folder)  # no rule: q/k/v left over, qkv missing
    register_checkpoint_conversion_mapping("llama", [QKV_RULE])
    load_converted_state_dict(model, folder)
    assert_params_equal(model, expected_fused(model.state_dict(), ck))


def test_offline_convert_and_reverse_sharded(sharded_llama, tmp_path):
    folder, ck = sharded_llama
    n_shards = len(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))
    rows = convert_checkpoint(folder, tmp_path / "fused", rules=[QKV_RULE])
    assert len(rows) == 2 and rows[0].direction == "offline"
    fused = checkpoint(tmp_path / "fused")
    assert "model.layers.1.self_attn.qkv_proj.weight" in fused and "model.layers.1.self_attn.q_proj.weight" not in fused
    index = json.loads((tmp_path / "fused" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) <= n_shards
    written = sorted(p.name for p in (tmp_path / "fused").glob("*.safetensors"))
    assert written == sorted(set(index["weight_map"].values()))  # no shard file the index does not list
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in fused.values())
    with patched({"LlamaAttention": FusedQKVAttention}):  # converted layout loads with no rule at all
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "fused")
    assert_params_equal(model, expected_fused(model.state_dict(), ck))

    register_checkpoint_conversion_mapping("llama", [QKV_RULE])
    convert_checkpoint(tmp_path / "fused", tmp_path / "back", "llama", reverse=True)  # GQA sizes from config.json
    assert_same_tensors(checkpoint(tmp_path / "back"), ck)
    assert (tmp_path / "back" / "config.json").exists()


def test_offline_convert_needs_rules(sharded_llama, tmp_path):
    with pytest.raises(ConversionError, match="No conversion rules"):
        convert_checkpoint(sharded_llama[0], tmp_path / "out", "llama")
    assert not (tmp_path / "out").exists()


def test_offline_renaming_round_trip(sharded_llama, tmp_path):
    from modelpatch.conversion import WeightRenaming

    folder, ck = sharded_llama
    rule = WeightRenaming(r"self_attn\.o_proj", "self_attn.out_proj")
    rows = convert_checkpoint(folder, tmp_path / "renamed", rules=[rule], progress=False)
    renamed = checkpoint(tmp_path / "renamed")
    assert torch.equal(
        renamed["model.layers.1.self_attn.out_proj.weight"], ck["model.layers.1.self_attn.o_proj.weight"]
    )
    assert not any(".o_proj." in k for k in renamed)
    assert len(rows) == 2
    convert_checkpoint(tmp_path / "renamed", tmp_path / "back", rules=[rule], reverse=True)
    assert_same_tensors(checkpoint(tmp_path / "back"), ck)


def test_offline_convert_refuses_rules_matching_nothing(sharded_llama, tmp_path):
    folder, _ = sharded_llama
    with pytest.raises(ConversionError, match="No conversion rule matched any key"):
        convert_checkpoint(folder, tmp_path / "out", rules=[QKV_RULE], reverse=True)  # not a fused checkpoint
    assert not (tmp_path / "out").exists()


def test_already_converted_checkpoint_saves_the_original_layout(sharded_llama, tmp_path, caplog):
    """A checkpoint written by convert_checkpoint loads with the rules (none fires, and that is no warning, nor an
    error when strict: the checkpoint is already in the rule's target layout) and still saves back."""
    folder, ck = sharded_llama
    convert_checkpoint(folder, tmp_path / "fused", rules=[QKV_RULE])
    with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [QKV_RULE]}, strict=True):
        with caplog.at_level(logging.WARNING):
            model = AutoModelForCausalLM.from_pretrained(tmp_path / "fused")
    assert "matched no checkpoint key" not in caplog.text
    model.save_pretrained(tmp_path / "saved")
    assert_same_tensors(checkpoint(tmp_path / "saved"), ck)


def test_offline_convert_refuses_a_non_empty_destination(sharded_llama, tmp_path):
    folder, _ = sharded_llama
    convert_checkpoint(folder, tmp_path / "out", rules=[QKV_RULE])
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    with pytest.raises(ConversionError, match="exists and is not empty"):
        convert_checkpoint(folder, tmp_path / "out", rules=[QKV_RULE])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before


def test_load_converted_state_dict_applies_transformers_builtin_rules(tmp_path):
    # Trainer resume of a plain qwen2_moe: the checkpoint stores one tensor per expert, the model a fused one
    from transformers import Qwen2MoeForCausalLM

    from modelpatch import load_converted_state_dict

    vanilla = save_tiny(Qwen2MoeForCausalLM, tiny_qwen2_moe_config(), tmp_path)
    fresh = Qwen2MoeForCausalLM(tiny_qwen2_moe_config())
    load_converted_state_dict(fresh, tmp_path)
    for name, tensor in vanilla.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
