"""Quantized patched models saved and reloaded: the original layout where a row split is exact (torchao int8 per
row, bitsandbytes 8-bit ``SCB``), written before anything else so a refusal leaves no half-written folder; the
patched layout (``save_original_format=False``) otherwise, which the same recipe reloads; pre-quantized checkpoints
in the per-expert layout load directly inside the recipe; fused experts a recipe leaves in full precision warn."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from bitsandbytes.functional import QuantState, dequantize_4bit
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from modelpatch import iter_original_state_dict
from modelpatch.conversion import ConversionError, QuantizedSaveError
from modelpatch.errors import ModelpatchError
from modelpatch.recipes import get_recipe, list_recipes
from quantization_support import IDS, checkpoint, quantization_config, save_checkpoint

ROW_EXACT = ["torchao-int8", "bnb-8bit"]
# saved components of one weight, relative to its module, per quantizer (row components first)
COMPONENTS = {
    "torchao-int8": ("._weight_qdata", "._weight_scale", "._weight_zero_point"),
    "bnb-8bit": (".weight", ".SCB"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    recipes = ["llama-fused-qkv", "qwen2-fused-qkv", "qwen3_moe-linear-experts", "mixtral-linear-experts"]
    return {recipe: save_checkpoint(recipe, tmp_path_factory.mktemp(recipe)) for recipe in recipes}


def load(path, recipe: str | None, quantizer: str | None = None, *, strict: bool = False):
    kwargs = {} if quantizer is None else {"quantization_config": quantization_config(quantizer)}
    if recipe is None:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    with get_recipe(recipe).apply(strict=strict):
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def saved(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(f"{path}/model.safetensors", "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()


def folder_state(path) -> dict[str, bytes]:
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


@pytest.mark.parametrize("quantizer", ROW_EXACT)
@pytest.mark.parametrize("recipe", ["llama-fused-qkv", "qwen2-fused-qkv"])
def test_fused_qkv_saves_split_rows_and_reloads_bit_exact(checkpoints, tmp_path, recipe, quantizer):
    model = load(checkpoints[recipe], recipe, quantizer)
    expected = logits(model)
    fused_state = model.hf_quantizer.get_state_dict_and_metadata(model)[0] or model.state_dict()
    model.save_pretrained(tmp_path / "saved")
    tensors, metadata = saved(tmp_path / "saved")
    assert not [k for k in tensors if "qkv_proj" in k]
    original = checkpoint(checkpoints[recipe])
    assert {k.rsplit(".", 1)[0] for k in tensors if "self_attn" in k} >= {
        k.rsplit(".", 1)[0] for k in original if "self_attn" in k
    }
    for layer in (0, 1):
        fused = f"model.layers.{layer}.self_attn.qkv_proj"
        start = 0
        for part in ("q_proj", "k_proj", "v_proj"):
            rows = original[f"model.layers.{layer}.self_attn.{part}.weight"].shape[0]
            for component in COMPONENTS[quantizer]:  # each component: exactly the fused component's rows
                piece = tensors[f"model.layers.{layer}.self_attn.{part}{component}"]
                assert torch.equal(piece, fused_state[fused + component][start : start + rows])
            if quantizer == "bnb-8bit":
                assert torch.equal(
                    tensors[f"model.layers.{layer}.self_attn.{part}.weight_format"],
                    fused_state[fused + ".weight_format"],
                )
            else:
                entry = json.loads(metadata[f"model.layers.{layer}.self_attn.{part}.weight"])
                assert entry["_type"] == "Int8Tensor" and entry["_data"]["block_size"] == [1, 64]
            start += rows
    if quantizer == "torchao-int8":
        names = json.loads(metadata["tensor_names"])
        assert "model.layers.0.self_attn.k_proj.weight" in names and not [n for n in names if "qkv" in n]

    reloaded = load(tmp_path / "saved", recipe)  # pre-quantized, with the recipe: the same fused weight
    assert type(reloaded.model.layers[0].self_attn.qkv_proj.weight) is type(
        model.model.layers[0].self_attn.qkv_proj.weight
    )
    assert torch.equal(logits(reloaded), expected)
    plain = load(tmp_path / "saved", None)  # pre-quantized, plain Transformers: separate q/k/v, same rows
    assert (
        type(plain.model.layers[0].self_attn.k_proj.weight).__name__
        == type(model.model.layers[0].self_attn.qkv_proj.weight).__name__
    )
    assert (logits(plain) - expected).abs().max() <= 1e-6  # measured 0.0


def test_iter_original_state_dict_of_a_quantized_model_is_what_save_writes(checkpoints, tmp_path):
    model = load(checkpoints["llama-fused-qkv"], "llama-fused-qkv", "torchao-int8")
    streamed = dict(iter_original_state_dict(model))
    model.save_pretrained(tmp_path / "saved")
    tensors, _ = saved(tmp_path / "saved")
    assert sorted(streamed) == sorted(tensors)
    assert all(torch.equal(streamed[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("quantizer", ["torchao-int8", "bnb-8bit", "bnb-4bit"])
def test_per_expert_checkpoints_save_and_reload_pre_quantized(checkpoints, tmp_path, quantizer):
    """Per-expert checkpoint, per-expert modules: the saved layout is the module layout, no conversion."""
    recipe = "qwen3_moe-linear-experts"
    model = load(checkpoints[recipe], recipe, quantizer)
    before = logits(model)
    model.save_pretrained(tmp_path / "saved")
    expected = logits(model)  # the model as saved (bitsandbytes' 4-bit CPU kernels round a packed weight on save)
    assert (expected - before).abs().max() <= 0.05, quantizer  # measured: 0 (int8, 8-bit), <= 0.024 (4-bit)
    tensors, _ = saved(tmp_path / "saved")
    assert not [k for k in tensors if "gate_up_proj" in k]
    experts = {k.split(".experts.")[1].split(".")[0] for k in tensors if ".experts." in k}
    assert experts == {"0", "1", "2", "3"}
    # strict: the fused-layout rules, which the per-expert save does not need, are no error (they were for torchao,
    # whose saved pieces `_weight_qdata`/`_weight_scale` the per-expert layout was not recognised by)
    reloaded = load(tmp_path / "saved", recipe, strict=True)
    weight = reloaded.model.layers[1].mlp.experts[3].down_proj.weight
    assert type(weight) is type(model.model.layers[1].mlp.experts[3].down_proj.weight)
    assert torch.equal(logits(reloaded), expected)


def test_mixtral_experts_save_under_the_checkpoint_names_with_their_metadata(checkpoints, tmp_path):
    recipe = "mixtral-linear-experts"
    model = load(checkpoints[recipe], recipe, "torchao-int8")
    expected = logits(model)
    model.save_pretrained(tmp_path / "saved")
    tensors, metadata = saved(tmp_path / "saved")
    original = {k.rsplit(".", 1)[0] for k in checkpoint(checkpoints[recipe]) if ".experts." in k}
    assert {k.rsplit(".", 1)[0] for k in tensors if ".experts." in k} == original  # block_sparse_moe.experts.*
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in json.loads(metadata["tensor_names"])
    assert torch.equal(logits(load(tmp_path / "saved", recipe)), expected)


def test_bnb_4bit_fused_qkv_refuses_the_original_layout_before_writing(checkpoints, tmp_path):
    recipe = "llama-fused-qkv"
    model = load(checkpoints[recipe], recipe, "bnb-4bit")
    expected = logits(model)
    with pytest.raises(QuantizedSaveError) as error:
        model.save_pretrained(tmp_path / "absent")
    assert isinstance(error.value, ModelpatchError)
    assert error.value.parameter == "model.layers.0.self_attn.qkv_proj.weight"
    assert error.value.quantizer == "bitsandbytes 4-bit"
    assert "save_original_format=False" in str(error.value) and "Nothing was written" in str(error.value)
    assert not (tmp_path / "absent").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("kept")
    before = folder_state(existing)
    with pytest.raises(QuantizedSaveError):
        model.save_pretrained(existing)
    assert folder_state(existing) == before

    model.save_pretrained(tmp_path / "patched", save_original_format=False)  # the way out the error names
    tensors, _ = saved(tmp_path / "patched")
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors
    as_saved = logits(model)  # bitsandbytes' 4-bit CPU kernels (AVX-512-BF16) round a packed weight on save
    assert (as_saved - expected).abs().max() <= 0.05  # measured: 0 on AVX2 CPUs, 0.024 on AVX-512-BF16
    assert torch.equal(logits(load(tmp_path / "patched", recipe)), as_saved)
    # the saved weight is bitsandbytes' own encoding of the model's: its dequantization, exactly
    module = model.model.layers[0].self_attn.qkv_proj
    prefix = "model.layers.0.self_attn.qkv_proj.weight"
    state = QuantState.from_dict(
        {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}, torch.device("cpu")
    )
    stored = module.state_dict()  # unpacked (bitsandbytes' save format) on every CPU
    live = QuantState.from_dict(
        {k[len("weight.") :]: v for k, v in stored.items() if k.startswith("weight.")}, torch.device("cpu")
    )
    assert torch.equal(dequantize_4bit(tensors[prefix], state), dequantize_4bit(stored["weight"], live))


def test_experts_loaded_from_a_fused_checkpoint_refuse_to_stack_quantized_weights(checkpoints, tmp_path):
    """The original layout of a fused-experts checkpoint stacks the experts back into 3-D tensors: not exact for
    quantized weights, so refused; the patched (per-expert) layout saves and the recipe reloads it."""
    fused = tmp_path / "fused"
    load(checkpoints["qwen3_moe-linear-experts"], None).save_pretrained(fused, save_original_format=False)
    recipe = next(
        r for r in ("qwen3_moe-linear-experts-from-fused", "qwen3_moe-linear-experts") if r in list_recipes()
    )  # whichever recipe loads a fused checkpoint
    model = load(fused, recipe, "torchao-int8")
    expected = logits(model)
    with pytest.raises(QuantizedSaveError) as error:
        model.save_pretrained(tmp_path / "absent")
    assert error.value.parameter.startswith("model.layers.0.mlp.experts.0.")
    assert error.value.quantizer == "torchao Int8Tensor"
    assert "does more than split its rows" in str(error.value)
    assert not (tmp_path / "absent").exists()
    model.save_pretrained(tmp_path / "patched", save_original_format=False)
    assert torch.equal(logits(load(tmp_path / "patched", recipe)), expected)


def test_quanto_models_are_not_serializable_and_nothing_is_written(checkpoints, tmp_path):
    model = load(checkpoints["llama-fused-qkv"], "llama-fused-qkv", "quanto-int8")
    with pytest.raises(ValueError, match="not serializable"):  # Transformers' own refusal, before writing
        model.save_pretrained(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


def test_fused_experts_left_in_full_precision_warn_once(checkpoints, caplog):
    path = checkpoints["qwen3_moe-linear-experts"]
    with caplog.at_level(logging.WARNING, logger="modelpatch.conversion"):
        model = load(path, "llama-fused-qkv", "torchao-int8")  # a recipe that does not touch qwen3_moe's experts
    messages = [r.getMessage() for r in caplog.records if "fused experts" in r.getMessage()]
    assert len(messages) == 1
    assert "4 fused experts parameter(s) stay in full precision" in messages[0]
    assert "model.layers.*.mlp.experts.gate_up_proj, model.layers.*.mlp.experts.down_proj" in messages[0]
    assert "'qwen3_moe-linear-experts'" in messages[0]
    assert type(model.model.layers[0].mlp.experts.gate_up_proj) is torch.nn.Parameter
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="modelpatch.conversion"):
        load(path, "qwen3_moe-linear-experts", "torchao-int8")
    assert not [r for r in caplog.records if "fused experts" in r.getMessage()]


@pytest.mark.parametrize("quantizer", ROW_EXACT)
def test_pre_quantized_plain_checkpoint_loads_into_the_fused_qkv_recipe(checkpoints, tmp_path, quantizer):
    """A checkpoint quantized by plain Transformers (separate q/k/v components) loads inside the fused-QKV recipe:
    each component is concatenated by rows, exactly."""
    plain = load(checkpoints["llama-fused-qkv"], None, quantizer)
    plain.save_pretrained(tmp_path / "plain")
    tensors, _ = saved(tmp_path / "plain")
    model = load(tmp_path / "plain", "llama-fused-qkv")
    state = model.hf_quantizer.get_state_dict_and_metadata(model)[0] or model.state_dict()
    for component in COMPONENTS[quantizer]:
        parts = [tensors[f"model.layers.1.self_attn.{p}_proj{component}"] for p in "qkv"]
        assert torch.equal(state[f"model.layers.1.self_attn.qkv_proj{component}"], torch.cat(parts))
    assert (logits(model) - logits(plain)).abs().max() <= 1e-6  # measured 0.0


def test_pre_quantized_bnb_4bit_components_refuse_conversion(checkpoints, tmp_path):
    load(checkpoints["llama-fused-qkv"], None, "bnb-4bit").save_pretrained(tmp_path / "plain")
    with pytest.raises(ModelpatchError, match=r"bitsandbytes 4-bit component .* Nothing was loaded"):
        load(tmp_path / "plain", "llama-fused-qkv")


@pytest.mark.parametrize("quantizer", ROW_EXACT)
def test_plain_pre_quantized_moe_checkpoint_in_a_recipe_is_not_silent(checkpoints, tmp_path, quantizer, caplog):
    """A checkpoint plain Transformers quantized keeps the fused experts in full precision. Loaded with the
    linear-experts recipe, bitsandbytes built 8-bit expert layers over float weights that failed at the first
    forward ("'Parameter' object has no attribute 'CB'"), and torchao left 24 of 24 experts unquantized without a
    word (found by a fresh-user trial)."""
    recipe = "qwen3_moe-linear-experts"
    plain = load(checkpoints[recipe], None, quantizer)
    plain.save_pretrained(tmp_path / "plain")
    if quantizer == "bnb-8bit":
        with pytest.raises(ConversionError, match=r"bitsandbytes layer\(s\) got unquantized weights.*experts"):
            load(tmp_path / "plain", recipe)
        return
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        model = load(tmp_path / "plain", recipe)
    assert "24 expert Linear layer(s) stay in full precision" in caplog.text
    assert "model.layers.*.mlp.experts.*.gate_proj" in caplog.text
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, plain(IDS).logits)
