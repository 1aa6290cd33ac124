"""Patch keys: which keys count as matched, outranked, not applicable (classes of another model family) or
unmatched (typos), and the hints and messages that name them."""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch.nn as nn
from transformers import LlamaForCausalLM, LlamaModel, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2_moe import modeling_qwen2_moe

from helpers import Inert, modelpatch_records, save_tiny, tiny_llama_config
from modelpatch import UnmatchedPatchKeyError, apply_patches, patch_report, register_patch_mapping, set_strict_patching


class Attention(modeling_llama.LlamaAttention):
    pass


def test_block_outranking_registry_key_is_not_a_typo(tmp_path, caplog):
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    register_patch_mapping({"LlamaAttention": Attention})
    set_strict_patching(True)

    class BlockAttention(modeling_llama.LlamaAttention):
        pass

    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        with apply_patches({"LlamaAttention": BlockAttention}, strict=True):
            model = LlamaForCausalLM.from_pretrained(tmp_path)  # strict registry: must not raise
    assert type(model.model.layers[0].self_attn) is BlockAttention
    assert "matched no class" not in caplog.text
    assert patch_report(model).unmatched_keys == []


def test_pattern_outranked_by_exact_key_is_not_unmatched():
    with apply_patches({"LlamaAttention": Attention, ".*Attention$": Attention}, strict=True) as scope:
        LlamaModel(tiny_llama_config())
    assert scope.unmatched_keys == () and scope.outranked_keys == (".*Attention$",)


def test_identifier_key_hint_for_substring(caplog):
    # not "Attention": FSMT and OpenAI GPT define a class of that name, so it is a key of another family (info)
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        with apply_patches({"RMSNorm": Attention}):
            model = LlamaModel(tiny_llama_config())
    assert type(model.norm) is modeling_llama.LlamaRMSNorm
    assert "'.*RMSNorm'" in caplog.text


@pytest.mark.slow  # a fresh interpreter, so the modeling module is really imported inside the block
def test_class_first_imported_inside_a_strict_block_is_reported():
    """Found by a fresh-user test: a layer built directly from a module first imported inside the block was
    silently not replaced, even in strict mode (the catalogue is refreshed when a model is built)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch.nn as nn
        from modelpatch import UnmatchedPatchKeyError, apply_patches

        class Block(nn.Module):
            def __init__(self, *args, **kwargs):
                super().__init__()

        try:
            with apply_patches({"MixtralSparseMoeBlock": Block}, strict=True):
                from transformers import MixtralConfig
                from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
                MixtralSparseMoeBlock(MixtralConfig(hidden_size=64, intermediate_size=128, num_local_experts=4))
        except UnmatchedPatchKeyError as error:
            print("raised:", "first imported inside" in str(error))
        with apply_patches({"MixtralSparseMoeBlock": Block}, strict=True):  # imported now: replaced
            block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=64, intermediate_size=128, num_local_experts=4))
        print("second block:", type(block).__name__)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.split("\n")[:2] == ["raised: True", "second block: Block"], result.stderr[-2000:]


def test_hint_never_suggests_the_key_itself(caplog):
    class Custom(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    with caplog.at_level("WARNING", logger="modelpatch"):
        with apply_patches({"Linear": Custom, "LlamaAttention": LlamaAttention}):
            LlamaModel(tiny_llama_config())
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "['Linear'] matched no class" in text  # the warning is there ...
    assert "did you mean 'Linear'" not in text  # ... without suggesting the key itself


# -- keys of another model family -------------------------------------------------------------------------------------


class LlamaAttn(modeling_llama.LlamaAttention):
    pass


class Qwen2Attn(modeling_qwen2.Qwen2Attention):
    pass


class QuietMLP(modeling_llama.LlamaMLP):
    pass


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
    assert modelpatch_records(caplog, logging.WARNING) == []
    assert modelpatch_records(caplog, logging.INFO) == [
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


# -- hints that can match ---------------------------------------------------------------------------------------------


def test_hint_never_suggests_a_pattern_that_matches_no_class_built(caplog):
    assert modeling_qwen2_moe.Qwen2MoeSparseMoeBlock  # catalogued, but not a class a Llama builds
    with caplog.at_level(logging.WARNING, logger="modelpatch"), apply_patches({"MoeBlock": Inert}):
        model = LlamaModel(tiny_llama_config())  # alive at the exit: the hint looks at what it holds
    assert not any("Moe" in type(m).__name__ for m in model.modules())
    (message,) = modelpatch_records(caplog, logging.WARNING)
    assert message == (
        "modelpatch: patch key(s) ['MoeBlock'] matched no class built during apply_patches, nor any module class of "
        "Transformers or of loaded remote code; check the class name (case-sensitive) or the pattern"
    )


def test_hint_names_the_classes_its_pattern_matches(caplog):
    mapping = {"RMSNorm": Inert, "Llamarmsnorm": Inert, "LlamaDecoderLayr": Inert}
    with caplog.at_level(logging.WARNING, logger="modelpatch"), apply_patches(mapping):
        model = LlamaModel(tiny_llama_config())
    assert type(model.norm) is modeling_llama.LlamaRMSNorm
    (message,) = modelpatch_records(caplog, logging.WARNING)
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
    (message,) = modelpatch_records(caplog, logging.INFO)
    assert message.endswith("(LlamaAttention), write '.*Attention'")


def test_block_none_of_whose_keys_applies_still_warns_and_strict_raises(caplog):
    """A block (not the registry) whose keys all name classes of another family built a vanilla model: that is
    a wrong recipe for this model, not a shared registry."""
    with caplog.at_level(logging.INFO, logger="modelpatch"), apply_patches({"Qwen2Attention": Qwen2Attn}) as scope:
        model = LlamaModel(tiny_llama_config())
    assert type(model.layers[0].self_attn) is modeling_llama.LlamaAttention
    assert (scope.unmatched_keys, scope.not_applicable_keys) == ((), ("Qwen2Attention",))
    (message,) = modelpatch_records(caplog, logging.WARNING)
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
    messages = modelpatch_records(caplog, logging.INFO) + modelpatch_records(caplog, logging.WARNING)
    assert len(messages) == 2
    for message in messages:
        numbers = re.findall(r"(?<![\w.])\d+(?![\w.])", message)
        assert len(numbers) == len(set(numbers)), message
