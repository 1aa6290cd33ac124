"""Failing inputs found by trying the product as a user would; each stays as a test."""

import copy
import logging
import pickle

import pytest
import torch
import torch.nn as nn
from transformers import GPT2Model, LlamaForCausalLM, LlamaModel, MistralModel
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.pytorch_utils import Conv1D

from helpers import (
    INPUT_IDS,
    save_tiny,
    tiny_gpt2_config,
    tiny_llama_config,
    tiny_mistral_config,
    tiny_qwen2_moe_config,
)
from modelpatch import (
    OutputRecorder,
    apply_patches,
    patch_report,
    register_output_recorder,
    register_patch_mapping,
    set_strict_patching,
    unregister_output_recorder,
)


class QuietMLP(modeling_llama.LlamaMLP):
    pass


class DecoderLayer(modeling_llama.LlamaDecoderLayer):
    pass


class Attention(modeling_llama.LlamaAttention):
    pass


def mistral_config():
    return tiny_mistral_config(mlp_bias=False)  # mlp_bias: LlamaMLP reads it when swapped in


def test_a_replacement_class_can_itself_be_patched():
    # a library maps MistralMLP -> LlamaMLP; the user's LlamaMLP patch must still apply to Llama
    with apply_patches({"MistralMLP": modeling_llama.LlamaMLP, "LlamaMLP": QuietMLP}) as scope:
        model = LlamaModel(tiny_llama_config())
    assert type(model.layers[0].mlp) is QuietMLP
    assert scope.fired == {"LlamaMLP": 2}


def test_swapping_two_classes():
    mapping = {"LlamaMLP": modeling_mistral.MistralMLP, "MistralMLP": modeling_llama.LlamaMLP}
    with apply_patches(mapping):
        llama = LlamaModel(tiny_llama_config())
        mistral = MistralModel(mistral_config())
    assert type(llama.layers[0].mlp) is modeling_mistral.MistralMLP
    assert type(mistral.layers[0].mlp) is modeling_llama.LlamaMLP


def test_no_false_conflict_when_container_replacement_builds_the_inner_class(caplog):
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        with apply_patches({"LlamaDecoderLayer": DecoderLayer, "LlamaAttention": Attention}) as scope:
            model = LlamaModel(tiny_llama_config())
    assert type(model.layers[0]) is DecoderLayer and type(model.layers[0].self_attn) is Attention
    assert scope.fired == {"LlamaDecoderLayer": 2, "LlamaAttention": 2}
    assert patch_report(model).conflicts == []
    assert "container" not in caplog.text


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


def test_apply_patches_as_decorator():
    @apply_patches({"LlamaAttention": Attention})
    def build():
        return LlamaModel(tiny_llama_config())

    assert type(build().layers[0].self_attn) is Attention
    assert type(build().layers[1].self_attn) is Attention  # a fresh scope per call
    assert type(LlamaModel(tiny_llama_config()).layers[0].self_attn) is modeling_llama.LlamaAttention


def test_apply_patches_decorates_async_functions_and_refuses_generators():
    import asyncio

    @apply_patches({"LlamaAttention": Attention})
    async def build():
        await asyncio.sleep(0)
        return LlamaModel(tiny_llama_config())

    assert type(asyncio.run(build()).layers[0].self_attn) is Attention  # the block spans the coroutine's body
    assert type(LlamaModel(tiny_llama_config()).layers[0].self_attn) is modeling_llama.LlamaAttention
    with pytest.raises(TypeError, match="generator function"):

        @apply_patches({"LlamaAttention": Attention})
        def layers():
            yield LlamaModel(tiny_llama_config())


def test_strict_block_raises_for_a_conversion_rule_matching_nothing(tmp_path):
    from modelpatch.conversion import Concatenate, ConversionError, WeightConverter
    from modelpatch.recipes.attention import FusedQKVLlamaAttention

    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    qkv = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    never = WeightConverter(["gate_a", "gate_b"], ["mlp.gate_ab"], [Concatenate(dim=0)])
    with pytest.raises(ConversionError, match="gate_a.*matched no checkpoint key"):
        with apply_patches(
            {"LlamaAttention": FusedQKVLlamaAttention}, strict=True, conversion_rules={"llama": [qkv, never]}
        ):
            LlamaForCausalLM.from_pretrained(tmp_path)


def test_gpt2_conv1d_is_patchable():
    class QuantConv1D(Conv1D):
        pass

    register_patch_mapping({"Conv1D": QuantConv1D})
    with apply_patches():
        model = GPT2Model(tiny_gpt2_config())
    assert type(model.h[0].attn.c_attn) is QuantConv1D


def test_replacement_with_wrong_signature_names_both_classes():
    class NoLayerIdx(nn.Module):
        def __init__(self, cfg):
            super().__init__()

    with pytest.raises(TypeError) as info:
        with apply_patches({"LlamaAttention": NoLayerIdx}):
            LlamaModel(tiny_llama_config())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "NoLayerIdx" in notes and "LlamaAttention" in notes


# -- recorders -------------------------------------------------------------------------------------


def eager_llama():
    config = tiny_llama_config()
    config._attn_implementation = "eager"
    return LlamaModel(config)


def modelpatch_hooks(model) -> int:
    """How many forward hooks defined by modelpatch (user output recorders' hooks) ``model`` holds."""
    return sum(
        type(hook).__module__.startswith("modelpatch") for m in model.modules() for hook in m._forward_hooks.values()
    )


def test_builtin_recorder_name_is_rejected():
    model = eager_llama()
    for name in ("hidden_states", "attentions"):
        with pytest.raises(ValueError, match=name):
            register_output_recorder(model, name, modeling_llama.LlamaMLP)
    assert len(model(INPUT_IDS, output_hidden_states=True).hidden_states) == 3


def test_reregistering_needs_overwrite_and_replaces_hooks():
    model = eager_llama()
    register_output_recorder(model, "x", OutputRecorder(modeling_llama.LlamaMLP, index=0))
    assert [t.shape for t in model(INPUT_IDS, output_x=True).x] == [(1, 8, 64)] * 2
    with pytest.raises(ValueError, match="overwrite"):
        register_output_recorder(model, "x", OutputRecorder(modeling_llama.LlamaAttention, index=1))
    register_output_recorder(model, "x", OutputRecorder(modeling_llama.LlamaAttention, index=1), overwrite=True)
    assert [t.shape for t in model(INPUT_IDS, output_x=True).x] == [(1, 4, 8, 8)] * 2
    assert modelpatch_hooks(model) == 2  # one per attention layer; the MLP hooks were removed
    unregister_output_recorder(model, "x")
    assert "x" not in model(INPUT_IDS, output_x=True)  # asked for, but no longer registered: nothing captured
    assert modelpatch_hooks(model) == 0  # unregistering removed the hooks it installed, exactly
    with pytest.raises(KeyError):
        unregister_output_recorder(model, "x")


def test_class_level_recorder_reaches_instances_already_used():
    used = eager_llama()
    used(INPUT_IDS, output_hidden_states=True)  # Transformers installs its hooks now

    class MyLlama(LlamaModel):
        pass

    register_output_recorder(LlamaModel, "mlp_out", OutputRecorder(modeling_llama.LlamaMLP, index=0))
    try:
        assert len(used(INPUT_IDS, output_mlp_out=True).mlp_out) == 2
        assert len(eager_llama()(INPUT_IDS, output_mlp_out=True).mlp_out) == 2
    finally:
        unregister_output_recorder(LlamaModel, "mlp_out")
    assert "mlp_out" not in used(INPUT_IDS, output_mlp_out=True)  # asked for: the class entry is gone
    assert "mlp_out" not in eager_llama()(INPUT_IDS, output_mlp_out=True)


def test_recorders_and_report_survive_deepcopy_and_pickle():
    with apply_patches({"LlamaMLP": QuietMLP, "LlamaMLq": QuietMLP}):
        model = LlamaModel(tiny_llama_config())
    register_output_recorder(model, "mlp_out", OutputRecorder(QuietMLP, index=0))
    clones = (copy.deepcopy(model), pickle.loads(pickle.dumps(model)))  # before Transformers' own hooks exist
    expected = model(INPUT_IDS, output_mlp_out=True).mlp_out
    for clone in clones:
        got = clone(INPUT_IDS, output_mlp_out=True).mlp_out
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, expected))
        report = patch_report(clone)
        assert [r.path for r in report.rows] == ["layers.0.mlp", "layers.1.mlp"]
        assert report.unmatched_keys == ["LlamaMLq"]


def test_replacement_parameters_missing_from_checkpoint_are_named(tmp_path, caplog):
    # a fused replacement loaded without conversion rules: Transformers initialises qkv_proj at random
    from modelpatch import ConversionError, allow_init_values
    from modelpatch.recipes.attention import FusedQKVLlamaAttention

    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    # the checkpoint's q/k/v tensors are there, unread: an error by default (it was a warning, and a model whose
    # qkv_proj computed with random values)
    with pytest.raises(ConversionError) as info, apply_patches({"LlamaAttention": FusedQKVLlamaAttention}):
        LlamaForCausalLM.from_pretrained(tmp_path)
    assert "model.layers.0.self_attn (FusedQKVLlamaAttention replacing LlamaAttention): qkv_proj.weight" in str(
        info.value
    )
    with allow_init_values(), caplog.at_level(logging.WARNING, logger="modelpatch"):
        with apply_patches({"LlamaAttention": FusedQKVLlamaAttention}):
            LlamaForCausalLM.from_pretrained(tmp_path)
    assert "model.layers.0.self_attn (FusedQKVLlamaAttention replacing LlamaAttention): qkv_proj.weight" in caplog.text
    with pytest.raises(ConversionError, match="model.layers.1.self_attn"):
        with apply_patches({"LlamaAttention": FusedQKVLlamaAttention}, strict=True):
            LlamaForCausalLM.from_pretrained(tmp_path)


def test_nested_recipe_blocks_keep_both_conversion_rules(tmp_path):
    # the inner block's rules for qwen2_moe used to replace the outer block's: fused qkv_proj came back random
    from transformers import Qwen2MoeForCausalLM

    from modelpatch.recipes import get_recipe

    vanilla = save_tiny(Qwen2MoeForCausalLM, tiny_qwen2_moe_config(num_key_value_heads=2), tmp_path)
    with get_recipe("qwen2_moe-fused-qkv").apply(strict=True):
        with get_recipe("qwen2_moe-linear-experts").apply(strict=True):
            model = Qwen2MoeForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert (model(INPUT_IDS).logits - vanilla(INPUT_IDS).logits).abs().max() < 1e-5


def test_load_converted_state_dict_applies_transformers_builtin_rules(tmp_path):
    # Trainer resume of a plain qwen2_moe: the checkpoint stores one tensor per expert, the model a fused one
    from transformers import Qwen2MoeForCausalLM

    from modelpatch import load_converted_state_dict

    vanilla = save_tiny(Qwen2MoeForCausalLM, tiny_qwen2_moe_config(), tmp_path)
    fresh = Qwen2MoeForCausalLM(tiny_qwen2_moe_config())
    load_converted_state_dict(fresh, tmp_path)
    for name, tensor in vanilla.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


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
