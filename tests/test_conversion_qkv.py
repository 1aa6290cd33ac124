"""Fused QKV attention loaded from ordinary checkpoints and saved back bit-exact (llama, qwen2, qwen2_moe)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
)

from conversion_models import (
    QKV_RULE,
    FusedQKVAttention,
    ModuleListExperts,
    assert_params_equal,
    assert_same_tensors,
    checkpoint,
    clean_conversions,  # noqa: F401 - autouse fixture
    expected_fused,
    patched,
    randomize_,
)
from helpers import tiny_llama_config, tiny_qwen2_config, tiny_qwen2_moe_config
from modelpatch.conversion import (
    apply_conversion_rules,
    conversion_report,
    register_checkpoint_conversion_mapping,
    unregister_checkpoint_conversion_mapping,
)

IDS = torch.tensor([[3, 17, 99, 4, 55, 23, 8], [1, 2, 3, 4, 5, 6, 7]])

CASES = {
    "llama-mha": (LlamaForCausalLM, lambda: tiny_llama_config(num_key_value_heads=4)),
    "llama-gqa": (LlamaForCausalLM, tiny_llama_config),
    "qwen2-gqa-bias": (Qwen2ForCausalLM, tiny_qwen2_config),  # qwen2 has q/k/v biases
}


_SAVED: dict = {}


def saved(tmp_path_factory, name, cls, config, **save_kwargs):
    """Vanilla model with random values saved once per module: (model, folder, checkpoint tensors)."""
    key = (name, tuple(sorted(save_kwargs.items())))
    if key not in _SAVED:
        model = randomize_(cls(config)).eval()
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, **save_kwargs)
        _SAVED[key] = (model, folder, checkpoint(folder))
    return _SAVED[key]


def _load_fused(folder, attention_class_name, model_type, **kwargs):
    with patched({attention_class_name: FusedQKVAttention}), apply_conversion_rules({model_type: [QKV_RULE]}):
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_qkv_load_and_save(case, tmp_path_factory, tmp_path):
    cls, make_config = CASES[case]
    config = make_config()
    vanilla, folder, ck = saved(tmp_path_factory, case, cls, config)
    model = _load_fused(folder, cls.__name__.replace("ForCausalLM", "Attention"), config.model_type)

    assert isinstance(model.model.layers[0].self_attn, FusedQKVAttention)
    assert_params_equal(model, expected_fused(model.state_dict(), ck))
    torch.testing.assert_close(model(IDS).logits, vanilla(IDS).logits, atol=1e-5, rtol=0)

    model.save_pretrained(tmp_path)
    assert_same_tensors(checkpoint(tmp_path), ck)
    reloaded = cls.from_pretrained(tmp_path)  # plain Transformers, no patch, no rule
    assert_same_tensors(reloaded.state_dict(), vanilla.state_dict())


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_seed_qwen2_moe_full_example(kv_heads, tmp_path_factory, tmp_path):
    """The seed's full example: per-expert ModuleListExperts + FusedQKVAttention + a Concatenate rule registered
    with overwrite=True over the built-in qwen2_moe rules."""
    vanilla, folder, ck = saved(
        tmp_path_factory,
        f"qwen2moe-{kv_heads}",
        Qwen2MoeForCausalLM,
        tiny_qwen2_moe_config(num_key_value_heads=kv_heads),
    )
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in ck  # Transformers saves the hub (per-expert) layout
    with patched({"Qwen2MoeExperts": ModuleListExperts, "Qwen2MoeAttention": FusedQKVAttention}):
        register_checkpoint_conversion_mapping("qwen2_moe", [QKV_RULE], overwrite=True)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder)
        finally:
            unregister_checkpoint_conversion_mapping("qwen2_moe")

    assert isinstance(model.model.layers[1].mlp.experts, ModuleListExperts)
    assert_params_equal(model, expected_fused(model.state_dict(), ck))
    torch.testing.assert_close(model(IDS).logits, vanilla(IDS).logits, atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path)
    assert_same_tensors(checkpoint(tmp_path), ck)
    assert_same_tensors(Qwen2MoeForCausalLM.from_pretrained(tmp_path).state_dict(), vanilla.state_dict())


def test_device_map_cpu(tmp_path_factory):
    _, folder, ck = saved(tmp_path_factory, "llama-gqa", *CASES["llama-gqa"][:1], CASES["llama-gqa"][1]())
    model = _load_fused(folder, "LlamaAttention", "llama", device_map="cpu")
    assert_params_equal(model, expected_fused(model.state_dict(), ck))


def test_sharded_dtype_and_tied_embeddings(tmp_path_factory, tmp_path):
    config = tiny_llama_config(tie_word_embeddings=True)
    vanilla, folder, ck = saved(tmp_path_factory, "llama-tied-sharded", LlamaForCausalLM, config, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").exists()
    model = _load_fused(folder, "LlamaAttention", "llama", dtype=torch.bfloat16)

    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert_params_equal(model, expected_fused(model.state_dict(), ck))

    model.save_pretrained(tmp_path, max_shard_size="40KB")
    expected = {k: v.to(torch.bfloat16) for k, v in ck.items()}
    assert_same_tensors(checkpoint(tmp_path), expected)


def test_from_config_model_saves_original_layout_twice_identically(tmp_path):
    config = CASES["llama-gqa"][1]()
    with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [QKV_RULE]}):
        model = randomize_(AutoModelForCausalLM.from_config(config))
        model.save_pretrained(tmp_path / "a")
        model.save_pretrained(tmp_path / "b")
    first, second = checkpoint(tmp_path / "a"), checkpoint(tmp_path / "b")
    assert_same_tensors(first, second)
    assert first["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # GQA rows split back 64/32/32
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "a")
    assert_params_equal(model, expected_fused(model.state_dict(), reloaded.state_dict()))


def test_keep_converted_layout_on_request(tmp_path_factory, tmp_path):
    _, folder, ck = saved(tmp_path_factory, "llama-gqa", *CASES["llama-gqa"][:1], CASES["llama-gqa"][1]())
    model = _load_fused(folder, "LlamaAttention", "llama")
    model.save_pretrained(tmp_path, save_original_format=False)
    converted = checkpoint(tmp_path)
    assert "model.layers.0.self_attn.qkv_proj.weight" in converted
    assert "model.layers.0.self_attn.q_proj.weight" not in converted
    assert_same_tensors(converted, model.state_dict() | {})


def test_report_lists_fired_rules(tmp_path_factory):
    _, folder, _ = saved(tmp_path_factory, "llama-gqa", *CASES["llama-gqa"][:1], CASES["llama-gqa"][1]())
    model = _load_fused(folder, "LlamaAttention", "llama")
    rows = conversion_report(model)
    assert [r.target_keys for r in rows] == [
        ("model.layers.0.self_attn.qkv_proj.weight",),
        ("model.layers.1.self_attn.qkv_proj.weight",),
    ]
    assert rows[0].registered_as == "llama" and rows[0].direction == "load"
    assert rows[0].source_keys == tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")


def test_from_config_model_bound_in_scope_saves_original_layout_after_it(tmp_path):
    from modelpatch.conversion import bind_conversion_rules

    with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [QKV_RULE]}):
        model = randomize_(AutoModelForCausalLM.from_config(CASES["llama-gqa"][1]()))
        assert bind_conversion_rules(model)
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert_params_equal(model, expected_fused(model.state_dict(), reloaded.state_dict()))


def test_fused_checkpoint_into_vanilla_model_infers_unequal_chunk_sizes(tmp_path_factory, tmp_path):
    """The other direction: a fused GQA checkpoint split 64/32/32 with sizes taken from the model at load time."""
    from modelpatch.conversion import Chunk, WeightConverter

    vanilla, folder, ck = saved(tmp_path_factory, "llama-gqa", *CASES["llama-gqa"][:1], CASES["llama-gqa"][1]())
    _load_fused(folder, "LlamaAttention", "llama").save_pretrained(tmp_path / "fused", save_original_format=False)
    split = WeightConverter("qkv_proj", ["q_proj", "k_proj", "v_proj"], [Chunk(dim=0)])
    with apply_conversion_rules({"llama": [split]}):
        model = LlamaForCausalLM.from_pretrained(tmp_path / "fused")
    assert_same_tensors(model.state_dict(), vanilla.state_dict())
    model.save_pretrained(tmp_path / "again")  # reverse: Concatenate, back to the fused layout
    assert_same_tensors(checkpoint(tmp_path / "again"), checkpoint(tmp_path / "fused"))


def test_report_rows_serialise_and_reach_patch_report(tmp_path_factory):
    import json

    from modelpatch import patch_report

    _, folder, _ = saved(tmp_path_factory, "llama-gqa", *CASES["llama-gqa"][:1], CASES["llama-gqa"][1]())
    model = _load_fused(folder, "LlamaAttention", "llama")
    rows = [row.as_dict() for row in conversion_report(model)]
    assert json.loads(json.dumps(rows))[1]["target_keys"] == ["model.layers.1.self_attn.qkv_proj.weight"]
    assert len(patch_report(model).conversion) == 2
