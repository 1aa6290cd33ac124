"""Quantized loads inside recipes: every quantizer that runs on this CPU (torchao int8, quanto int8, bitsandbytes
8-bit and 4-bit) quantizes every expert Linear of the linear-experts recipes and the fused ``qkv_proj`` of the
fused-QKV recipes (converted tensors go through the quantizer like unconverted ones); each dequantized weight is
within the quantizer's error of its own checkpoint slice and much farther from every other expert's; logits stay
within the quantizer's usual error of the full-precision patched model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from modelpatch import InstancePatchError, ModelpatchError, patch_report
from modelpatch.recipes import get_recipe
from quantization_support import (
    CASES,
    IDS,
    WEIGHT_CLASS,
    WEIGHT_RTOL,
    checkpoint,
    dequantized_weight,
    is_quantized,
    quantization_config,
    save_checkpoint,
)

# max abs logit difference to the full-precision patched model (|logits| <= 0.61 here; measured: int8 quantizers
# 0.0038-0.021, bitsandbytes 4-bit 0.082-0.095)
LOGITS_ATOL = {"torchao-int8": 0.03, "quanto-int8": 0.03, "bnb-8bit": 0.03, "bnb-4bit": 0.15}

# expert Linear layers per model: 2 layers x 4 experts x (gate, up, down)
EXPERT_LINEARS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {recipe: save_checkpoint(recipe, tmp_path_factory.mktemp(recipe)) for recipe in CASES}


@pytest.fixture(scope="module")
def full_precision(checkpoints):
    """``{recipe: (patched full-precision logits, checkpoint tensors)}``."""
    result = {}
    for recipe, path in checkpoints.items():
        with get_recipe(recipe).apply():
            model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            result[recipe] = (model(IDS).logits, checkpoint(path))
    return result


def checkpoint_slice(recipe: str, tensors: dict, module_name: str) -> torch.Tensor:
    key = f"{module_name}.weight"
    if recipe.startswith("mixtral"):
        key = key.replace(".mlp.", ".block_sparse_moe.")  # Mixtral's checkpoints keep the legacy name
    return tensors[key].float()


def quantized_load(path: str, recipe: str, quantizer: str):
    with get_recipe(recipe).apply():
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization_config(quantizer))


@pytest.mark.parametrize("quantizer", list(WEIGHT_CLASS))
@pytest.mark.parametrize("recipe", [r for r in CASES if r.endswith("linear-experts")])
def test_every_expert_is_quantized_from_its_own_slice(checkpoints, full_precision, recipe, quantizer):
    model = quantized_load(checkpoints[recipe], recipe, quantizer)
    reference, tensors = full_precision[recipe]
    experts = {name: m for name, m in model.named_modules() if ".experts." in name and hasattr(m, "weight")}
    assert len(experts) == EXPERT_LINEARS
    assert {type(m.weight).__name__ for m in experts.values()} == {WEIGHT_CLASS[quantizer]}
    assert all(is_quantized(m) for m in experts.values())
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]  # no fused experts left
    rtol = WEIGHT_RTOL[quantizer]
    for name, module in experts.items():
        weight = dequantized_weight(module)
        own = checkpoint_slice(recipe, tensors, name)
        error = (weight - own).abs().max()
        assert error <= rtol * own.abs().max(), name
        expert = int(name.split(".experts.")[1].split(".")[0])
        for other in {0, 1, 2, 3} - {expert}:
            slice_ = checkpoint_slice(recipe, tensors, name.replace(f".experts.{expert}.", f".experts.{other}."))
            assert (weight - slice_).abs().max() > 5 * error, (name, other)  # measured: > 6x (4-bit), > 250x (int8)
    with torch.no_grad():
        logits = model(IDS).logits
    assert (logits - reference).abs().max() <= LOGITS_ATOL[quantizer]


@pytest.mark.parametrize("quantizer", list(WEIGHT_CLASS))
@pytest.mark.parametrize("recipe", ["llama-fused-qkv", "qwen2-fused-qkv"])
def test_fused_qkv_is_quantized_from_the_concatenated_rows(checkpoints, full_precision, recipe, quantizer):
    model = quantized_load(checkpoints[recipe], recipe, quantizer)
    reference, tensors = full_precision[recipe]
    fused = {name: m for name, m in model.named_modules() if name.endswith("qkv_proj")}
    assert sorted(fused) == [f"model.layers.{i}.self_attn.qkv_proj" for i in (0, 1)]
    assert {type(m.weight).__name__ for m in fused.values()} == {WEIGHT_CLASS[quantizer]}
    linears = [m for name, m in model.named_modules() if hasattr(m, "weight") and "proj" in name]
    assert len(linears) == 2 * 5 and all(is_quantized(m) for m in linears)  # qkv, o, gate, up, down per layer
    for name, module in fused.items():
        weight = dequantized_weight(module)
        parts = [checkpoint_slice(recipe, tensors, name.replace("qkv_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        start = 0
        for part in parts:
            rows = weight[start : start + part.shape[0]]
            assert (rows - part).abs().max() <= WEIGHT_RTOL[quantizer] * part.abs().max(), name
            start += part.shape[0]
        assert start == weight.shape[0]
        if recipe.startswith("qwen2"):  # biases are not quantized: the concatenation, exactly
            biases = [tensors[f"{name.replace('qkv_proj', p)}.bias"] for p in ("q_proj", "k_proj", "v_proj")]
            assert torch.equal(module.bias.detach(), torch.cat(biases))
    with torch.no_grad():
        logits = model(IDS).logits
    assert (logits - reference).abs().max() <= LOGITS_ATOL[quantizer]


def _bits(value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Every plain tensor ``value`` is made of (a tensor subclass such as torchao's ``Int8Tensor``: its flattened
    components), for a bit-for-bit comparison."""
    flatten = getattr(type(value), "__tensor_flatten__", None)
    if flatten is None:
        return [(type(value).__name__, value.detach().clone())]
    names, _ = value.__tensor_flatten__()
    return [(f"{type(value).__name__}.{name}", part) for name in names for _, part in _bits(getattr(value, name))]


def _snapshot(model) -> tuple[list, dict]:
    modules = [(name, type(m), id(m)) for name, m in model.named_modules()]
    state = {key: _bits(value) for key, value in model.state_dict().items()}
    return modules, state


def _assert_unchanged(model, before) -> None:
    modules, state = _snapshot(model)
    assert modules == before[0]
    assert state.keys() == before[1].keys()
    for key, parts in state.items():
        old = before[1][key]
        assert [n for n, _ in parts] == [n for n, _ in old], key
        for (_, new), (_, was) in zip(parts, old, strict=True):
            assert new.dtype == was.dtype and torch.equal(new, was), key


# what names the quantized modules the fused-QKV recipes would replace (the experts of the linear-experts recipes
# stay fused, in full precision, under every quantizer: only the quantizer is named)
QUANTIZED_PART = {
    "bnb-8bit": "'model.layers.0.self_attn.q_proj' (Linear8bitLt)",
    "bnb-4bit": "'model.layers.0.self_attn.q_proj' (Linear4bit)",
    "quanto-int8": "'model.layers.0.self_attn.q_proj' (QLinear)",
    "torchao-int8": "'model.layers.0.self_attn.q_proj.weight' (Int8Tensor, torch.float32)",
}
LABEL = {
    "bnb-8bit": "bitsandbytes 8-bit",
    "bnb-4bit": "bitsandbytes 4-bit",
    "quanto-int8": "quanto int8",
    "torchao-int8": "torchao Int8WeightOnlyConfig",
}


@pytest.mark.parametrize("quantizer", list(WEIGHT_CLASS))
@pytest.mark.parametrize("recipe", ["qwen2_moe-linear-experts", "llama-fused-qkv"])
def test_patching_a_model_quantized_by_transformers_is_refused_up_front(checkpoints, recipe, quantizer):
    model = AutoModelForCausalLM.from_pretrained(
        checkpoints[recipe], quantization_config=quantization_config(quantizer)
    )
    before = _snapshot(model)
    with pytest.raises(InstancePatchError) as raised:
        get_recipe(recipe).patch(model)
    message = str(raised.value)
    assert message.startswith(f"cannot patch {type(model).__name__}: it was loaded quantized ({LABEL[quantizer]})")
    assert (QUANTIZED_PART[quantizer] in message) == recipe.endswith("fused-qkv")
    assert "with recipe.apply(): AutoModelForCausalLM.from_pretrained(path, quantization_config=...)" in message
    assert message.endswith("The model was not modified.")
    assert isinstance(raised.value, ModelpatchError)
    _assert_unchanged(model, before)
    assert patch_report(model).rows == []


def test_patching_modules_quantized_in_place_is_refused():
    """No ``hf_quantizer``: torchao's ``quantize_`` on a built model; the quantized weights of the modules to replace
    are found structurally."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CASES["llama-fused-qkv"]())
    quantize_(model, Int8WeightOnlyConfig())
    assert getattr(model, "hf_quantizer", None) is None
    before = _snapshot(model)
    with pytest.raises(InstancePatchError) as raised:
        get_recipe("llama-fused-qkv").patch(model)
    message = str(raised.value)
    assert message.startswith(
        "cannot patch LlamaForCausalLM: it holds quantized weights; the modules to replace hold "
        f"{QUANTIZED_PART['torchao-int8']}, 'model.layers.0.self_attn.k_proj.weight' (Int8Tensor, torch.float32), "
        "'model.layers.0.self_attn.v_proj.weight' (Int8Tensor, torch.float32) and 5 more. "
    )
    _assert_unchanged(model, before)
