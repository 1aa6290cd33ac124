"""Checkpoint layouts other than the model's own: Transformers' renamings (legacy VLM layouts, ``key_mapping=``),
checkpoints with more layers than the model, and saving models the rules do not fit. Found by a fresh-user test."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2MoeForCausalLM,
)

from conversion_models import (
    QKV_RULE,
    assert_same_tensors,
    checkpoint,
    clean_conversions,  # noqa: F401 - autouse fixture
    randomize_,
)
from helpers import INPUT_IDS, tiny_clip_vision_config, tiny_llama_config, tiny_qwen2_moe_config
from modelpatch.conversion import ConversionError, apply_conversion_rules, load_converted_state_dict
from modelpatch.recipes import get_recipe


def _llava_config():
    vision = tiny_clip_vision_config(num_hidden_layers=1)
    return LlavaConfig(vision_config=vision, text_config=tiny_llama_config(vocab_size=160), image_token_index=150)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A tiny Llava saved by plain Transformers: legacy keys (``language_model.model.layers...``)."""
    folder = tmp_path_factory.mktemp("llava")
    torch.manual_seed(0)
    model = randomize_(LlavaForConditionalGeneration(_llava_config()))
    model.save_pretrained(folder)
    assert any(k.startswith("language_model.model.layers.") for k in checkpoint(folder))
    return folder, LlavaForConditionalGeneration.from_pretrained(folder)


def _max_diff(a, b) -> float:
    with torch.no_grad():
        return (a(input_ids=INPUT_IDS).logits - b(input_ids=INPUT_IDS).logits).abs().max().item()


def test_legacy_llava_layout_loads_and_saves_back(llava, tmp_path):
    folder, vanilla = llava
    with get_recipe("llama-fused-qkv").apply(strict=True):
        model = LlavaForConditionalGeneration.from_pretrained(folder)
    qkv = model.model.language_model.layers[0].self_attn.qkv_proj.weight
    attention = vanilla.model.language_model.layers[0].self_attn
    assert torch.equal(qkv, torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]))
    assert _max_diff(model, vanilla) < 1e-5
    model.save_pretrained(tmp_path)
    assert_same_tensors(checkpoint(tmp_path), checkpoint(folder))


@pytest.mark.parametrize("source", ["legacy folder", "own state_dict"])
def test_load_converted_state_dict_into_a_vlm(llava, source):
    folder, vanilla = llava
    fresh = LlavaForConditionalGeneration(_llava_config())
    load_converted_state_dict(fresh, folder if source == "legacy folder" else vanilla.state_dict())
    for name, tensor in vanilla.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_key_mapping_is_applied_before_the_rules(tmp_path):
    torch.manual_seed(0)
    reference = randomize_(LlamaForCausalLM(tiny_llama_config()))
    reference.config.save_pretrained(tmp_path)
    renamed = {k.replace("model.layers", "backbone.blocks"): v for k, v in reference.state_dict().items()}
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with get_recipe("llama-fused-qkv").apply(strict=True):
        model = AutoModelForCausalLM.from_pretrained(tmp_path, key_mapping={r"^backbone\.blocks": "model.layers"})
    assert _max_diff(model, reference) < 1e-5


def test_checkpoint_with_more_layers_than_the_model(tmp_path):
    randomize_(LlamaForCausalLM(tiny_llama_config())).save_pretrained(tmp_path)
    vanilla = AutoModelForCausalLM.from_pretrained(tmp_path, num_hidden_layers=1)
    with get_recipe("llama-fused-qkv").apply():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, num_hidden_layers=1)
        one_layer = AutoModelForCausalLM.from_config(tiny_llama_config(num_hidden_layers=1))
    assert _max_diff(model, vanilla) < 1e-5
    load_converted_state_dict(one_layer, tmp_path, strict=False)  # layer 1 left over, as documented
    assert _max_diff(one_layer, vanilla) < 1e-5
    with pytest.raises(ConversionError, match="unexpected keys.*layers.1.self_attn"):
        load_converted_state_dict(one_layer, tmp_path)


def test_rule_that_fits_no_parameter_is_still_an_error(tmp_path):
    randomize_(LlamaForCausalLM(tiny_llama_config())).save_pretrained(tmp_path)
    with apply_conversion_rules({"llama": [QKV_RULE]}):  # no patch: the model has no qkv_proj anywhere
        with pytest.raises(ConversionError, match="qkv_proj.*not a parameter"):
            AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("how", ["registered", "block"])
def test_unpatched_model_saves_its_own_layout_while_an_experts_recipe_is_active(how, tmp_path):
    model = randomize_(Qwen2MoeForCausalLM(tiny_qwen2_moe_config()))
    model.save_pretrained(tmp_path / "plain")
    recipe = get_recipe("qwen2_moe-linear-experts")
    if how == "registered":
        recipe.register()
        try:
            model.save_pretrained(tmp_path / "with-recipe")
        finally:
            recipe.unregister()
    else:
        with recipe.apply():
            model.save_pretrained(tmp_path / "with-recipe")
    assert_same_tensors(checkpoint(tmp_path / "with-recipe"), checkpoint(tmp_path / "plain"))


def test_model_built_by_its_constructor_in_a_block_saves_the_original_layout_after_it(tmp_path):
    with get_recipe("qwen2_moe-full-example").apply():
        model = randomize_(Qwen2MoeForCausalLM(tiny_qwen2_moe_config()))
    assert type(model.model.layers[0].mlp.experts).__name__ != "Qwen2MoeExperts"
    model.save_pretrained(tmp_path / "patched")  # after the block: never loaded, nothing registered any more
    Qwen2MoeForCausalLM(tiny_qwen2_moe_config()).save_pretrained(tmp_path / "vanilla")
    assert set(checkpoint(tmp_path / "patched")) == set(checkpoint(tmp_path / "vanilla"))
    reloaded = Qwen2MoeForCausalLM.from_pretrained(tmp_path / "patched")
    assert _max_diff(model, reloaded) < 1e-5


def test_meta_tensors_are_refused_before_anything_is_written(tmp_path):
    source = randomize_(LlamaForCausalLM(tiny_llama_config()))
    target = LlamaForCausalLM(tiny_llama_config())
    before = {k: v.clone() for k, v in target.state_dict().items()}
    state = dict(source.state_dict())
    state["model.layers.1.self_attn.q_proj.weight"] = torch.empty(64, 64, device="meta")
    with pytest.raises(ConversionError, match="model.layers.1.self_attn.q_proj.weight.*meta"):
        load_converted_state_dict(target, state)
    assert_same_tensors(target.state_dict(), before)
