"""Defects of class patching and output capture found by trying the product as a user would (recorders on head
models, modeling modules that run again, keys of another model family, hints); each test failed before its fix,
except the ``start()``/``stop()`` ones (a feature that had no test)."""

from __future__ import annotations

import copy
import importlib
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
from test_remote_code import DoubledBlock, write_remote_repo


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
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=128,
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


# -- modeling modules that run again ------------------------------------------------------------------------------


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
        assert _modelpatch_records(caplog, logging.WARNING) == []
    finally:
        vars(modeling_persimmon).clear()
        vars(modeling_persimmon).update(saved)


def _remote_checkpoint(path):
    write_remote_repo(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    AutoModel.from_config(config, trust_remote_code=True).save_pretrained(path)


def test_remote_code_loaded_again_with_force_download_is_patched(tmp_path, caplog):
    """``force_download=True`` makes Transformers execute the remote module again as a new module object under the
    same name (``sys.modules`` keeps its size); its new classes must be targeted on every such load."""
    _remote_checkpoint(tmp_path)
    register_patch_mapping({"TinyRemoteBlock": DoubledBlock})
    first = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    models = [first]
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        for _ in range(2):
            models.append(AutoModel.from_pretrained(tmp_path, trust_remote_code=True, force_download=True))
    classes = [type(m) for m in models]
    assert len(set(classes)) == 3 and len({c.__module__ for c in classes}) == 1  # new classes, same module name
    for model in models:
        assert [type(b) for b in model.blocks] == [DoubledBlock, DoubledBlock]
        assert [r.path for r in patch_report(model).rows] == ["blocks.0", "blocks.1"]
    assert _modelpatch_records(caplog, logging.WARNING) == []


def test_remote_code_module_executed_again_in_place_is_patched(tmp_path, caplog):
    """A new download whose code changed: Transformers executes the cached module file again in the same module
    object (``get_class_in_module`` sees a new hash)."""
    from transformers.dynamic_module_utils import get_class_in_module
    from transformers.utils import HF_MODULES_CACHE

    _remote_checkpoint(tmp_path)
    register_patch_mapping({"TinyRemoteBlock": DoubledBlock})
    first = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert [type(b) for b in first.blocks] == [DoubledBlock, DoubledBlock]
    module = sys.modules[type(first).__module__]
    with open(module.__file__, "a") as handle:  # the "new download"
        handle.write("\n# revised upstream\n")
    relative = os.path.relpath(module.__file__, HF_MODULES_CACHE)
    model_cls = get_class_in_module("TinyRemoteModel", relative)
    assert sys.modules[type(first).__module__] is module and model_cls is not type(first)
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        again = model_cls.from_pretrained(tmp_path)
    assert [type(b) for b in again.blocks] == [DoubledBlock, DoubledBlock]
    assert _modelpatch_records(caplog, logging.WARNING) == []


# -- keys of another model family ---------------------------------------------------------------------------------


def _tiny_qwen2_config():
    return Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )


def test_registry_for_two_families_loads_each_quietly_and_under_strict(tmp_path, caplog):
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path / "llama")
    save_tiny(Qwen2ForCausalLM, _tiny_qwen2_config(), tmp_path / "qwen2")
    register_patch_mapping({"LlamaAttention": LlamaAttn, "Qwen2Attention": Qwen2Attn})
    set_strict_patching(True)
    with caplog.at_level(logging.INFO, logger="modelpatch"):
        llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
        qwen2 = Qwen2ForCausalLM.from_pretrained(tmp_path / "qwen2")
    assert [type(layer.self_attn) for layer in llama.model.layers] == [LlamaAttn, LlamaAttn]
    assert [type(layer.self_attn) for layer in qwen2.model.layers] == [Qwen2Attn, Qwen2Attn]
    assert _modelpatch_records(caplog, logging.WARNING) == []
    assert _modelpatch_records(caplog, logging.INFO) == [
        f"modelpatch: patch key(s) [{other!r}] not applicable to {label}.from_pretrained: they name classes that "
        "exist (another model family, or classes this model does not use) but none was built"
        for other, label in (("Qwen2Attention", "LlamaForCausalLM"), ("LlamaAttention", "Qwen2ForCausalLM"))
    ]
    for model, other in ((llama, "Qwen2Attention"), (qwen2, "LlamaAttention")):
        report = patch_report(model)
        assert (report.unmatched_keys, report.not_applicable_keys) == ([], [other])
        assert f"keys of classes this model does not build: {other}" in str(report)
        assert report.as_dict()["not_applicable_keys"] == [other]


def test_keys_matching_no_class_anywhere_stay_errors_beside_other_family_keys():
    family = "transformers.models.cohere.modeling_cohere"  # no test imports it
    imported_before = family in sys.modules
    mapping = {
        "LlamaAttention": LlamaAttn,
        "CohereAttention": Inert,  # another family, module not imported: read from the source files
        "^Cohere.*MLP$": Inert,  # a pattern matching classes of another family
        "LlamaAtention": Inert,  # typo
        ".*Atention$": Inert,  # pattern matching no class at all
    }
    with pytest.raises(UnmatchedPatchKeyError) as error, apply_patches(mapping, strict=True) as scope:
        LlamaModel(tiny_llama_config())
    assert scope.unmatched_keys == ("LlamaAtention", ".*Atention$")
    assert scope.not_applicable_keys == ("CohereAttention", "^Cohere.*MLP$")
    assert str(error.value).startswith("modelpatch: patch key(s) ['LlamaAtention', '.*Atention$'] matched no class")
    assert "Cohere" not in str(error.value)
    if not imported_before:
        assert family not in sys.modules  # classified without importing the family


def test_source_class_names_lists_module_classes_only():
    from modelpatch.patching.catalog import source_class_names

    names = source_class_names()
    cohere = names["transformers.models.cohere.modeling_cohere"]
    assert {"CohereAttention", "CohereModel", "CohereForCausalLM"} <= cohere
    assert "LlavaCausalLMOutputWithPast" not in names["transformers.models.llava.modeling_llava"]  # a ModelOutput
    assert "Conv1D" in names["transformers.pytorch_utils"]
    assert len(names) > 400


# -- clearer messages: hints that can match -----------------------------------------------------------------------


def test_hint_never_suggests_a_pattern_that_matches_no_class_built(caplog):
    assert modeling_qwen2_moe.Qwen2MoeSparseMoeBlock  # catalogued, but not a class a Llama builds
    with caplog.at_level(logging.WARNING, logger="modelpatch"), apply_patches({"MoeBlock": Inert}):
        model = LlamaModel(tiny_llama_config())  # alive at the exit: the hint looks at what it holds
    assert not any("Moe" in type(m).__name__ for m in model.modules())
    (message,) = _modelpatch_records(caplog, logging.WARNING)
    assert message == (
        "modelpatch: patch key(s) ['MoeBlock'] matched no class built during apply_patches, nor any module class of "
        "Transformers or of loaded remote code; check the class name (case-sensitive) or the pattern"
    )


def test_hint_names_the_classes_its_pattern_matches(caplog):
    mapping = {"RMSNorm": Inert, "Llamarmsnorm": Inert, "LlamaDecoderLayr": Inert}
    with caplog.at_level(logging.WARNING, logger="modelpatch"), apply_patches(mapping):
        model = LlamaModel(tiny_llama_config())
    assert type(model.norm) is modeling_llama.LlamaRMSNorm
    (message,) = _modelpatch_records(caplog, logging.WARNING)
    assert message.endswith(
        "; 'RMSNorm' is an exact class name: to match the classes built here whose names contain it (LlamaRMSNorm), "
        "write '.*RMSNorm'"
        "; 'Llamarmsnorm': did you mean 'LlamaRMSNorm'? (class names are case-sensitive)"
        "; 'LlamaDecoderLayr': did you mean 'LlamaDecoderLayer'?"
    )
    assert re.search(".*RMSNorm", "LlamaRMSNorm")


def test_key_naming_a_class_of_another_family_gets_the_hint_at_info(caplog):
    # ``Attention`` is a class of FSMT and OpenAI GPT: not a typo, but a Llama user probably meant a pattern
    mapping = {"LlamaMLP": QuietMLP, "Attention": Inert}
    with caplog.at_level(logging.INFO, logger="modelpatch"), apply_patches(mapping, strict=True) as scope:
        model = LlamaModel(tiny_llama_config())
    assert type(model.layers[0].self_attn) is modeling_llama.LlamaAttention
    assert scope.not_applicable_keys == ("Attention",) and scope.unmatched_keys == ()
    (message,) = _modelpatch_records(caplog, logging.INFO)
    assert message.endswith("(LlamaAttention), write '.*Attention'")


def test_block_none_of_whose_keys_applies_still_warns_and_strict_raises(caplog):
    """A block (not the registry) whose keys all name classes of another family built a vanilla model: that is
    a wrong recipe for this model, not a shared registry."""
    with caplog.at_level(logging.INFO, logger="modelpatch"), apply_patches({"Qwen2Attention": Qwen2Attn}) as scope:
        model = LlamaModel(tiny_llama_config())
    assert type(model.layers[0].self_attn) is modeling_llama.LlamaAttention
    assert (scope.unmatched_keys, scope.not_applicable_keys) == ((), ("Qwen2Attention",))
    (message,) = _modelpatch_records(caplog, logging.WARNING)
    assert message == (
        "modelpatch: no patch key of apply_patches applies to what it built: key(s) ['Qwen2Attention'] name classes "
        "that exist (another model family, or classes this model does not use) but none was built"
    )
    strict = apply_patches({"Qwen2Attention": Qwen2Attn}, strict=True)
    with pytest.raises(UnmatchedPatchKeyError, match="no patch key of apply_patches applies"), strict:
        LlamaModel(tiny_llama_config())


def test_messages_print_no_number_twice(caplog):
    mapping = {"MLP": Inert, "LlamaAtention": Inert, "Qwen2Attention": Inert, "^LlamaRotary": Inert}
    with caplog.at_level(logging.INFO, logger="modelpatch"), apply_patches(mapping):
        model = LlamaModel(tiny_llama_config())
    assert type(model.layers[0].mlp) is modeling_llama.LlamaMLP
    messages = _modelpatch_records(caplog, logging.INFO) + _modelpatch_records(caplog, logging.WARNING)
    assert len(messages) == 2
    for message in messages:
        numbers = re.findall(r"(?<![\w.])\d+(?![\w.])", message)
        assert len(numbers) == len(set(numbers)), message


# -- PatchScope.start() / stop() ----------------------------------------------------------------------------------


def test_start_and_stop_behave_like_a_with_block():
    scope = apply_patches({"LlamaAttention": LlamaAttn})
    assert scope.start() is scope
    assert active_scopes() == (scope,)
    inside = LlamaModel(tiny_llama_config())
    scope.stop()
    assert active_scopes() == () and scope.closed
    assert [type(layer.self_attn) for layer in inside.layers] == [LlamaAttn, LlamaAttn]
    assert scope.fired == {"LlamaAttention": 2}
    assert type(LlamaModel(tiny_llama_config()).layers[0].self_attn) is modeling_llama.LlamaAttention
    with pytest.raises(ModelpatchRuntimeError, match="not started .or already stopped"):
        scope.stop()
    with pytest.raises(RuntimeError, match="entered only once"):
        scope.start()


def test_stop_runs_the_strict_check_and_stop_before_start_raises():
    never_started = apply_patches({"LlamaAttention": LlamaAttn})
    with pytest.raises(ModelpatchRuntimeError):
        never_started.stop()
    scope = apply_patches({"LlamaAttention": LlamaAttn, "NoSuchClass": Inert}, strict=True).start()
    LlamaModel(tiny_llama_config())
    with pytest.raises(UnmatchedPatchKeyError, match=r"\['NoSuchClass'\]"):
        scope.stop()
    assert active_scopes() == ()
    with pytest.raises(ModelpatchRuntimeError):
        scope.stop()
