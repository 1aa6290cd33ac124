"""iter_original_state_dict: the weights in the original checkpoint layout, one conversion group at a time.

What an RL loop pushes to its inference engine after each step. Its union must be what ``save_pretrained`` writes
(the two share one path), and what plain Transformers wrote or would write for the same weights; groups are converted
only when their turn comes, and a yielded tensor is not kept by the iterator.
"""

from __future__ import annotations

import logging
import weakref

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers import core_model_loading as tcml
from transformers.modeling_utils import remove_tied_weights_from_state_dict

import modelpatch
from helpers import (
    tiny_llama_config,
    tiny_mixtral_config,
    tiny_qwen2_moe_config,
    tiny_qwen3_moe_config,
)
from modelpatch import ConversionError, ModelpatchError, iter_original_state_dict
from modelpatch.conversion import OriginalLayoutIterator
from modelpatch.conversion.state import get_state
from modelpatch.integrations.peft import add_adapter
from modelpatch.recipes import get_recipe

FAMILIES = {
    "llama": tiny_llama_config,
    "llama-tied": lambda: tiny_llama_config(tie_word_embeddings=True),
    "qwen2_moe": tiny_qwen2_moe_config,
    "qwen3_moe": tiny_qwen3_moe_config,
    "mixtral": tiny_mixtral_config,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One checkpoint per family written by plain Transformers (the original layout), seed 0."""
    paths = {}
    for family, config in FAMILIES.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(family)
        AutoModelForCausalLM.from_config(config()).save_pretrained(path)
        paths[family] = path
    return paths


def _built(family):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[family]())


def _transformers_alone(model) -> dict:
    """What Transformers itself writes for ``model``: its own reverse (``core_model_loading`` keeps the function
    modelpatch's hook replaces in ``modeling_utils``) of the state dict without tied duplicates."""
    state_dict = remove_tied_weights_from_state_dict(dict(model.state_dict()), model)
    return {k: v.contiguous() for k, v in tcml.revert_weight_conversion(model, state_dict).items()}


def _loaded(family, recipe=None):
    def build(checkpoints):
        if recipe is None:
            return AutoModelForCausalLM.from_pretrained(checkpoints[family])
        with get_recipe(recipe).apply():
            return AutoModelForCausalLM.from_pretrained(checkpoints[family])

    return build


def _patched(family, recipe):
    def build(checkpoints):
        model = _built(family)
        get_recipe(recipe).patch(model)
        return model

    return build


def _lora(family, recipe, targets):
    def build(checkpoints):
        model = _loaded(family, recipe)(checkpoints)
        torch.manual_seed(1)
        config = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
        return get_peft_model(model, config).get_base_model()

    return build


def _from_file(family):
    return lambda checkpoints: load_file(checkpoints[family] / "model.safetensors")


def _from_transformers(family):
    return lambda checkpoints: _transformers_alone(_built(family))


# case: (model builder, the reference written by Transformers alone for the same weights)
CASES = {
    "llama": (lambda c: _built("llama"), _from_transformers("llama")),
    "llama-tied": (lambda c: _built("llama-tied"), _from_transformers("llama-tied")),
    "qwen3_moe": (lambda c: _built("qwen3_moe"), _from_transformers("qwen3_moe")),  # experts fused by Transformers
    "mixtral-loaded": (_loaded("mixtral"), _from_file("mixtral")),  # Transformers' renamings and fusion
    "llama-fused-qkv": (_loaded("llama", "llama-fused-qkv"), _from_file("llama")),
    "llama-fused-qkv-tied": (_loaded("llama-tied", "llama-fused-qkv"), _from_file("llama-tied")),
    "qwen3_moe-linear-experts": (_loaded("qwen3_moe", "qwen3_moe-linear-experts"), _from_file("qwen3_moe")),
    "mixtral-linear-experts": (_loaded("mixtral", "mixtral-linear-experts"), _from_file("mixtral")),
    "qwen2_moe-full-example": (_loaded("qwen2_moe", "qwen2_moe-full-example"), _from_file("qwen2_moe")),
    "qwen2_moe-fused-qkv": (_loaded("qwen2_moe", "qwen2_moe-fused-qkv"), _from_file("qwen2_moe")),
    "patch_model-llama-fused-qkv": (_patched("llama", "llama-fused-qkv"), _from_transformers("llama")),
    "patch_model-qwen2_moe-full-example": (
        _patched("qwen2_moe", "qwen2_moe-full-example"),
        _from_transformers("qwen2_moe"),
    ),
    "peft-lora-qwen2_moe-full-example": (
        _lora("qwen2_moe", "qwen2_moe-full-example", ["gate_proj", "up_proj", "down_proj", "qkv_proj"]),
        _from_file("qwen2_moe"),
    ),
}


def _assert_same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert different == []


@pytest.mark.parametrize("case", CASES)
def test_union_is_what_save_pretrained_writes(checkpoints, case, tmp_path):
    build, reference = CASES[case]
    model = build(checkpoints)
    items = list(iter_original_state_dict(model))
    streamed = dict(items)
    assert len(streamed) == len(items)  # each name once
    model.save_pretrained(tmp_path)
    _assert_same(streamed, load_file(tmp_path / "model.safetensors"))
    _assert_same(streamed, reference(checkpoints))  # and what Transformers alone writes for these weights
    if "tied" in case:
        assert "lm_head.weight" not in streamed and "model.embed_tokens.weight" in streamed


def test_user_groups_are_converted_when_their_turn_comes(checkpoints):
    model = _loaded("llama", "llama-fused-qkv")(checkpoints)
    qkv = [layer.self_attn.qkv_proj.weight for layer in model.model.layers]
    before = [w.detach().clone() for w in qkv]
    stream = iter_original_state_dict(model)
    assert isinstance(stream, OriginalLayoutIterator)
    assert (stream.groups, stream.converted) == (2, 0)  # one fused QKV per layer; nothing converted yet
    first = next(stream)
    assert first[0] == "lm_head.weight" and stream.converted == 0
    taken = dict([first])
    while "model.layers.0.self_attn.q_proj.weight" not in taken:
        name, tensor = next(stream)
        taken[name] = tensor
    assert stream.converted == 1
    with torch.no_grad():  # an optimizer step between two pushes of one sync
        for weight in qkv:
            weight.add_(1.0)
    taken.update(stream)
    assert stream.converted == 2
    # layer 0 was converted before the change (its k/v come out unchanged, though yielded after it), layer 1 after
    assert torch.equal(taken["model.layers.0.self_attn.q_proj.weight"], before[0][:64])
    assert torch.equal(taken["model.layers.0.self_attn.v_proj.weight"], before[0][96:])
    assert torch.equal(taken["model.layers.1.self_attn.q_proj.weight"], before[1][:64] + 1.0)
    assert torch.equal(taken["model.layers.1.self_attn.v_proj.weight"], before[1][96:] + 1.0)


def test_builtin_groups_are_converted_when_their_turn_comes():
    model = _built("qwen3_moe")  # experts fused by Transformers: its reverse splits them, one tensor per group
    stream = iter_original_state_dict(model)
    assert (stream.groups, stream.converted) == (4, 0)  # gate_up_proj and down_proj of 2 layers
    counts = {}
    for name, _ in stream:
        if ".experts." in name:
            counts.setdefault(stream.converted, 0)
            counts[stream.converted] += 1
    # 4 experts' down_proj when the first group is converted, 4 x (gate, up) with the second, ...
    assert counts == {1: 4, 2: 8, 3: 4, 4: 8}


def test_yielded_tensors_are_not_kept_and_untouched_ones_are_the_parameters(checkpoints):
    model = _loaded("qwen2_moe", "qwen2_moe-fused-qkv")(checkpoints)  # both stages: built-in experts, user QKV
    parameters = dict(model.named_parameters())
    dead_checks, converted = 0, 0
    refs: list[weakref.ref] = []
    for name, tensor in iter_original_state_dict(model):
        assert all(ref() is None for ref in refs)  # everything yielded before is gone once the consumer drops it
        dead_checks += len(refs)
        if name in parameters and tensor.data_ptr() == parameters[name].data_ptr():
            assert tensor is not parameters[name] and not tensor.requires_grad  # detached, no copy
            assert tensor.shape == parameters[name].shape
        else:
            converted += 1
        refs.append(weakref.ref(tensor))
        del tensor
    assert converted == 2 * 6 + 2 * (4 * 3)  # q/k/v weights and biases of 2 layers; gate/up/down of 4 experts x 2
    assert dead_checks == sum(range(len(refs)))


def test_save_rows_are_those_of_save_pretrained(checkpoints, tmp_path):
    model = _loaded("qwen2_moe", "qwen2_moe-full-example")(checkpoints)
    model.save_pretrained(tmp_path)
    saved_rows = list(get_state(model).save_rows)
    get_state(model).save_rows = []
    for _ in iter_original_state_dict(model):
        pass
    assert get_state(model).save_rows == saved_rows
    assert [row.source_keys for row in saved_rows] == [
        (f"model.layers.{i}.self_attn.qkv_proj.{kind}",) for i in (0, 1) for kind in ("bias", "weight")
    ]
    assert saved_rows[1].target_keys == tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")


def test_state_dict_argument_is_converted_instead_of_the_models(checkpoints):
    model = _loaded("llama", "llama-fused-qkv")(checkpoints)
    state_dict = {k: v.clone() for k, v in model.state_dict().items()}
    state_dict["model.layers.1.self_attn.qkv_proj.weight"].fill_(0.5)
    streamed = dict(iter_original_state_dict(model, state_dict))
    assert torch.equal(streamed["model.layers.1.self_attn.k_proj.weight"], torch.full((32, 64), 0.5))
    own = dict(iter_original_state_dict(model))
    assert not torch.equal(own["model.layers.1.self_attn.k_proj.weight"], torch.full((32, 64), 0.5))


class _NeedsData(tcml.ConversionOps):
    """A conversion op that reads the data (no ``meta`` dry run possible); the identity otherwise."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        (tensors,) = input_dict.values()
        if not bool(torch.isfinite(tensors[0]).all()):
            raise ValueError("not finite")
        return {target_patterns[0]: tensors[0]}

    @property
    def reverse_op(self):
        return _NeedsData()


def test_builtin_op_that_needs_data_is_converted_before_the_user_stage(tmp_path):
    model = _built("llama")
    get_recipe("llama-fused-qkv").patch(model)
    model._weight_conversions = [
        tcml.WeightConverter("mlp.up_proj.weight", "mlp.up_proj.weight", operations=[_NeedsData()])
    ]
    stream = iter_original_state_dict(model)
    assert (stream.groups, stream.converted) == (4, 2)  # 2 up_proj converted up front, 2 fused QKV to go
    streamed = dict(stream)
    model.save_pretrained(tmp_path)
    _assert_same(streamed, load_file(tmp_path / "model.safetensors"))
    _assert_same(streamed, _transformers_alone(_built("llama")))


def test_refusals_name_what_is_wrong(checkpoints):
    with pytest.raises(modelpatch.errors.ModelpatchTypeError, match="PreTrainedModel, got Linear"):
        iter_original_state_dict(nn.Linear(2, 2))
    model = _loaded("llama", "llama-fused-qkv")(checkpoints)
    state_dict = dict(model.state_dict())
    state_dict["model.norm.weight"] = torch.empty(64, device="meta")
    with pytest.raises(ConversionError, match="'model.norm.weight' has no data"):
        iter_original_state_dict(model, state_dict)


def test_model_with_adapters_loaded_through_transformers_is_refused():
    plain = _built("llama")
    add_adapter(plain, LoraConfig(r=4, target_modules=["q_proj"]))  # model.add_adapter, or PEFT's API on 5.24+
    with pytest.raises(ModelpatchError, match="save_pretrained writes the adapter only"):
        iter_original_state_dict(plain)


_WHERE = "Qwen2MoeForCausalLM in the original layout (save_pretrained, iter_original_state_dict): "
_QKV = "model.layers.{}.self_attn.qkv_proj"
_MERGE_FIRST = (
    "Merge the adapters first (merge_adapter() or merge_and_unload()) to save merged weights, or save the adapter "
    "itself."
)
# merged layers -> (level, exact message or None)
_WRAPPER_MESSAGES = {
    (): (
        logging.WARNING,
        f"{_WHERE}2 wrapped module(s) (e.g. by PEFT) hold adapters that are not merged (e.g. '{_QKV.format(0)}'); "
        f"saving their base weights in the original layout without the 4 adapter tensor(s) (e.g. "
        f"'{_QKV.format(0)}.lora_A.default.weight'). {_MERGE_FIRST}",
    ),
    (0, 1): (
        logging.INFO,
        f"{_WHERE}the adapters of the 2 wrapped module(s) (e.g. by PEFT) are merged: the base weights saved in the "
        f"original layout include them (4 adapter tensor(s) left out, e.g. '{_QKV.format(0)}.lora_A.default.weight').",
    ),
    (0,): (
        logging.WARNING,
        f"{_WHERE}1 wrapped module(s) (e.g. by PEFT) hold adapters that are not merged (e.g. '{_QKV.format(1)}'); "
        f"saving their base weights in the original layout without the 2 adapter tensor(s) (e.g. "
        f"'{_QKV.format(1)}.lora_A.default.weight'). {_MERGE_FIRST} The adapters of the other 1 wrapped module(s) "
        "are merged: their saved base weights include them.",
    ),
}


@pytest.mark.parametrize("merged_layers", _WRAPPER_MESSAGES, ids=["unmerged", "merged", "mixed"])
def test_wrapped_modules_say_whether_their_adapters_are_merged(checkpoints, caplog, merged_layers):
    # trial: merge_adapter() then iter_original_state_dict warned "Merge the adapters first" about merged adapters
    model = _lora("qwen2_moe", "qwen2_moe-full-example", ["qkv_proj"])(checkpoints)
    original = load_file(checkpoints["qwen2_moe"] / "model.safetensors")
    expected = dict(original)
    for i in merged_layers:
        layer = model.get_submodule(_QKV.format(i))
        delta = layer.get_delta_weight("default")  # (192, 64): q, k, v rows of B @ A * scaling
        for j, proj in enumerate("qkv"):
            key = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            expected[key] = original[key] + delta[64 * j : 64 * (j + 1)]
        layer.merge()
    level, message = _WRAPPER_MESSAGES[merged_layers]
    with caplog.at_level(logging.INFO, logger="modelpatch.conversion"):
        streamed = {k: v.clone() for k, v in iter_original_state_dict(model)}
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "modelpatch.conversion"]
    assert records == [(level, message)]  # once per iteration
    _assert_same(streamed, expected)  # merged layers: base + B @ A; the others: the checkpoint's own
    assert sum(not torch.equal(streamed[k], original[k]) for k in original) == 3 * len(merged_layers)


def test_user_group_fed_by_a_builtin_converter_group(tmp_path):
    # a built-in converter on the fused parameter itself (Transformers' Transpose twice: the identity, with copies)
    # runs first on save, and modelpatch's split of qkv_proj takes its output
    model = _built("llama")
    get_recipe("llama-fused-qkv").patch(model)
    model._weight_conversions = [
        tcml.WeightConverter(
            "self_attn.qkv_proj.weight",
            "self_attn.qkv_proj.weight",
            operations=[tcml.Transpose(0, 1), tcml.Transpose(0, 1)],
        )
    ]
    stream = iter_original_state_dict(model)
    assert (stream.groups, stream.converted) == (4, 0)  # per layer: the built-in group, then the user group
    progress = {name: stream.converted for name, _ in stream if "self_attn" in name}
    assert progress["model.layers.0.self_attn.q_proj.weight"] == 2
    assert progress["model.layers.1.self_attn.v_proj.weight"] == 4
    streamed = dict(iter_original_state_dict(model))
    model.save_pretrained(tmp_path)
    _assert_same(streamed, load_file(tmp_path / "model.safetensors"))
    _assert_same(streamed, _transformers_alone(_built("llama")))
