"""Registry, scoping, composition with Transformers' built-in rules, and clean-up."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen2MoeForCausalLM
from transformers import conversion_mapping as tcm

from conversion_models import (
    PER_EXPERT_RULES,
    QKV_RULE,
    FusedQKVAttention,
    ModuleListExperts,
    assert_same_tensors,
    checkpoint,
    clean_conversions,  # noqa: F401 - autouse fixture
    expected_fused,
    patched,
    randomize_,
)
from helpers import INPUT_IDS, save_tiny, tiny_llama_config, tiny_qwen2_moe_config
from modelpatch import apply_patches
from modelpatch.conversion import (
    Concatenate,
    ConversionError,
    SplitModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
    apply_conversion_rules,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
    unregister_checkpoint_conversion_mapping,
)
from modelpatch.errors import ModelpatchValueError
from modelpatch.recipes import get_recipe
from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """Vanilla qwen2_moe saved by Transformers (hub layout: one tensor per expert)."""
    model = randomize_(Qwen2MoeForCausalLM(tiny_qwen2_moe_config(num_key_value_heads=2)))
    folder = tmp_path_factory.mktemp("qwen2moe")
    model.save_pretrained(folder)
    return model, folder, checkpoint(folder)


def _assert_vanilla_experts_loaded(folder, ck):
    model = AutoModelForCausalLM.from_pretrained(folder)
    experts = model.model.layers[1].mlp.experts
    for e in range(4):
        gate = ck[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"]
        up = ck[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]
        assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up]))
        assert torch.equal(experts.down_proj[e], ck[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])


def _builtin_reprs(name):
    return [repr(r) for r in tcm.get_checkpoint_conversion_mapping(name)]


def test_register_get_unregister_brings_back_builtins():
    builtin = _builtin_reprs("qwen2_moe")
    register_checkpoint_conversion_mapping("qwen2_moe", [QKV_RULE], overwrite=True)
    assert [repr(r) for r in get_checkpoint_conversion_mapping("qwen2_moe")] == [repr(QKV_RULE)]
    assert _builtin_reprs("qwen2_moe") == builtin  # Transformers' table is never mutated
    with pytest.raises(ValueError, match="already registered"):
        register_checkpoint_conversion_mapping("qwen2_moe", [QKV_RULE])
    unregister_checkpoint_conversion_mapping("qwen2_moe")
    assert [repr(r) for r in get_checkpoint_conversion_mapping("qwen2_moe")] == builtin
    with pytest.raises(KeyError, match="qwen2_moe"):
        unregister_checkpoint_conversion_mapping("qwen2_moe")


def test_composition_keeps_builtins_a_user_rule_does_not_replace():
    register_checkpoint_conversion_mapping("qwen2_moe", [QKV_RULE])
    effective = [repr(r) for r in get_checkpoint_conversion_mapping("qwen2_moe")]
    assert effective == [repr(QKV_RULE)] + _builtin_reprs("qwen2_moe")
    unregister_checkpoint_conversion_mapping("qwen2_moe")
    register_checkpoint_conversion_mapping("qwen2_moe", PER_EXPERT_RULES)
    assert [repr(r) for r in get_checkpoint_conversion_mapping("qwen2_moe")] == [repr(r) for r in PER_EXPERT_RULES]


def test_bad_registration_leaves_registry_unchanged():
    with pytest.raises(TypeError):
        register_checkpoint_conversion_mapping("llama", [object()])
    with pytest.raises(TypeError):
        register_checkpoint_conversion_mapping("", [QKV_RULE])
    assert get_checkpoint_conversion_mapping("llama") is None


def test_patterns_match_on_module_path_boundaries():
    rule = WeightConverter("experts.down_proj", "experts.*.down_proj.weight", [SplitModulelist(dim=0)])
    assert rule.rename_source_key("model.layers.0.mlp.shared_experts.down_proj.weight")[1] is None
    assert (
        rule.rename_source_key("model.layers.0.mlp.experts.down_proj")[0]
        == "model.layers.0.mlp.experts.*.down_proj.weight"
    )
    reverse = rule.reverse_transform()
    assert reverse.rename_source_key("model.layers.0.mlp.shared_experts.down_proj.weight")[1] is None
    renaming = WeightRenaming("attn", "self_attn")
    assert renaming.rename_source_key("layers.0.self_attn.q.weight")[0] == "layers.0.self_attn.q.weight"
    assert renaming.rename_source_key("layers.0.attn.q.weight")[0] == "layers.0.self_attn.q.weight"


def test_overwrite_rule_does_not_survive_unregister(qwen2_moe):
    _, folder, ck = qwen2_moe
    register_checkpoint_conversion_mapping("qwen2_moe", [QKV_RULE], overwrite=True)
    with apply_patches({"Qwen2MoeExperts": ModuleListExperts, "Qwen2MoeAttention": FusedQKVAttention}):
        AutoModelForCausalLM.from_pretrained(folder)
    unregister_checkpoint_conversion_mapping("qwen2_moe")
    _assert_vanilla_experts_loaded(folder, ck)


def test_clear_patch_mapping_also_drops_the_overwrite_rule(qwen2_moe):
    # a user who cleans up with clear_patch_mapping() only: with Transformers' own registries the qwen2_moe
    # override survives that and every later vanilla load gets randomly initialised experts
    _, folder, ck = qwen2_moe
    with patched({"Qwen2MoeExperts": ModuleListExperts, "Qwen2MoeAttention": FusedQKVAttention}):
        register_checkpoint_conversion_mapping("qwen2_moe", [QKV_RULE], overwrite=True)
        AutoModelForCausalLM.from_pretrained(folder)
    assert [repr(r) for r in get_checkpoint_conversion_mapping("qwen2_moe")] == _builtin_reprs("qwen2_moe")
    _assert_vanilla_experts_loaded(folder, ck)


def test_scoped_rules_undo_on_exit_even_on_error(qwen2_moe):
    _, folder, ck = qwen2_moe
    with pytest.raises(RuntimeError):
        with apply_conversion_rules({"qwen2_moe": [QKV_RULE]}, overwrite=True):
            assert get_checkpoint_conversion_mapping("qwen2_moe")[0].source_patterns == ["q_proj", "k_proj", "v_proj"]
            raise RuntimeError("boom")
    assert [repr(r) for r in get_checkpoint_conversion_mapping("qwen2_moe")] == _builtin_reprs("qwen2_moe")
    _assert_vanilla_experts_loaded(folder, ck)


def test_scope_is_local_to_the_thread():
    seen = []
    with apply_conversion_rules({"llama": [QKV_RULE]}):
        worker = threading.Thread(target=lambda: seen.append(get_checkpoint_conversion_mapping("llama")))
        worker.start()
        worker.join()
        assert get_checkpoint_conversion_mapping("llama") is not None
    assert seen == [None]


def test_class_name_wins_over_model_type(qwen2_moe, tmp_path):
    _, folder, ck = qwen2_moe
    wrong = WeightConverter(["q_proj", "k_proj"], "qkv_proj", [Concatenate(dim=0)])  # would not fit the model
    with (
        patched({"Qwen2MoeAttention": FusedQKVAttention}),
        apply_conversion_rules({"qwen2_moe": [wrong], "Qwen2MoeForCausalLM": [QKV_RULE]}),
    ):
        model = AutoModelForCausalLM.from_pretrained(folder)
    expected = expected_fused(model.state_dict(), ck)
    assert torch.equal(
        model.model.layers[0].self_attn.qkv_proj.weight, expected["model.layers.0.self_attn.qkv_proj.weight"]
    )
    # composed with the built-in experts rule (not replaced): the fused experts were loaded too
    gate = ck["model.layers.0.mlp.experts.2.gate_proj.weight"]
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj[2][: gate.shape[0]], gate)
    model.save_pretrained(tmp_path)
    assert_same_tensors(checkpoint(tmp_path), ck)


def test_save_after_scope_still_writes_original_layout(qwen2_moe, tmp_path):
    _, folder, ck = qwen2_moe
    with patched({"Qwen2MoeAttention": FusedQKVAttention}), apply_conversion_rules({"qwen2_moe": [QKV_RULE]}):
        model = AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path)
    assert_same_tensors(checkpoint(tmp_path), ck)


def test_conversion_error_type_is_value_error():
    assert issubclass(ConversionError, ValueError)


def test_rules_under_a_name_no_release_knows_are_named_with_the_closest(caplog):
    """Rules registered under a misspelled model type ('lama') never applied, and nothing said so: a warning names
    them with the closest known name; strict makes it an error (registry unchanged)."""
    import logging

    rule = WeightRenaming("self_attn.qq_proj", "self_attn.q_proj")
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        for name in ("llama", "LlamaModel", "qwen2_moe"):  # known: silent
            register_checkpoint_conversion_mapping(name, [rule])
            unregister_checkpoint_conversion_mapping(name)
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        register_checkpoint_conversion_mapping("lama", [rule])
        with apply_conversion_rules({"LlamaForCausalLn": [rule]}):
            pass
    unregister_checkpoint_conversion_mapping("lama")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "registered under 'lama', which is neither a model_type nor a class name" in messages[0]
    assert "did you mean 'llama'?" in messages[0]
    assert "did you mean 'LlamaForCausalLM'?" in messages[1]
    with pytest.raises(
        ModelpatchValueError, match=r"'lama'.*did you mean 'llama'\?.*\(strict\); nothing was registered"
    ):
        register_checkpoint_conversion_mapping("lama", [rule], strict=True)
    assert get_checkpoint_conversion_mapping("lama") is None


# -- issue 24: a sub-model's class-name rules apply to that sub-model, or a conflict raises ------------------------

O_PROJ_TRANSPOSED = WeightConverter("self_attn.o_proj.weight", "self_attn.o_proj.weight", [Transpose(0, 1)])


@pytest.fixture(scope="module")
def llama_o_proj_transposed(tmp_path_factory):
    """A tiny llama checkpoint whose (square) ``o_proj`` weights are stored transposed: read without the rule that
    transposes them back, it loads with no missing key and no warning, and computes wrong logits."""
    reference = randomize_(LlamaForCausalLM(tiny_llama_config()))
    folder = tmp_path_factory.mktemp("llama_o_proj_t")
    reference.save_pretrained(folder)
    (file,) = folder.glob("*.safetensors")
    tensors = {k: v.t().contiguous() if ".o_proj." in k else v for k, v in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = reference(ids).logits
    return folder, ids, logits


def test_sub_model_class_rules_apply_beside_the_roots_model_type_rules(llama_o_proj_transposed, tmp_path):
    """Rules registered under ``LlamaModel`` (the sub-model of ``LlamaForCausalLM``) lost silently to the ``llama``
    rules of a recipe: max abs diff of logits 1.81, no warning. Like Transformers' ``get_model_conversion_mapping``,
    a sub-model's class-name entry applies under its prefix below an ancestor's ``model_type`` entry."""
    folder, ids, expected = llama_o_proj_transposed
    register_checkpoint_conversion_mapping("LlamaModel", [O_PROJ_TRANSPOSED])
    with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [QKV_RULE]}):
        model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max().item() == 0.0
    model.save_pretrained(tmp_path)  # both rules reversed: the checkpoint as it was
    assert_same_tensors(checkpoint(tmp_path), checkpoint(folder))


def test_sub_model_class_rule_conflicting_with_an_ancestors_rule_raises_naming_both(llama_o_proj_transposed):
    """Two different rules for the same parameters (q, v, k order under ``LlamaModel``, q, k, v under ``llama``):
    only the first converter reads a key, so the other lost silently; now an error names both. An exact copy of
    the ancestor's rule is applied once (no error, exact logits)."""
    folder, ids, expected = llama_o_proj_transposed
    qvk = WeightConverter(["q_proj", "v_proj", "k_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    with patched({"LlamaAttention": FusedQKVAttention}):
        with apply_conversion_rules({"llama": [QKV_RULE], "LlamaModel": [qvk, O_PROJ_TRANSPOSED]}):
            with pytest.raises(ConversionError) as caught:
                AutoModelForCausalLM.from_pretrained(folder)
        message = str(caught.value)
        assert "conflicting conversion rules for sub-model 'model' (LlamaModel)" in message
        assert f"{qvk!r} registered under 'LlamaModel'" in message
        assert f"{QKV_RULE!r} registered under 'llama' (for the root model (LlamaForCausalLM)" in message
        with apply_conversion_rules({"llama": [QKV_RULE], "LlamaModel": [QKV_RULE, O_PROJ_TRANSPOSED]}):
            model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max().item() == 0.0


def test_sub_model_class_rules_compose_with_a_recipes_model_type_rules(qwen2_moe, tmp_path):
    """A recipe's ``qwen2_moe`` rules (linear experts, ``overwrite``) and the user's ``Qwen2MoeModel`` q/k/v fusion:
    the sub-model's rules were skipped (the load refused, q/k/v unread); both apply now, exact, and the save
    writes the checkpoint back."""
    from modelpatch.recipes import get_recipe

    reference, folder, ck = qwen2_moe
    recipe = get_recipe("qwen2_moe-linear-experts")
    with apply_patches(
        {**recipe.patch_mapping, "Qwen2MoeAttention": FusedQKVAttention},
        conversion_rules={**recipe.build_conversion_rules(), "Qwen2MoeModel": [QKV_RULE]},
        overwrite=["qwen2_moe"],
    ):
        model = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)
    expected = expected_fused(model.state_dict(), ck)
    assert torch.equal(
        model.model.layers[1].self_attn.qkv_proj.weight, expected["model.layers.1.self_attn.qkv_proj.weight"]
    )
    model.save_pretrained(tmp_path)
    assert_same_tensors(checkpoint(tmp_path), ck)


# -- apply_patches(conversion_rules=..., overwrite=...) ---------------------------------------------------------------


QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])


def test_conversion_rules_as_a_list_is_a_type_error_naming_the_form():
    with pytest.raises(TypeError, match=r"conversion_rules=\{'llama': \[rule\]\}"):
        apply_patches({"LlamaAttention": FusedQKVLlamaAttention}, conversion_rules=[QKV])


def test_overwrite_names_must_have_rules():
    with pytest.raises(ValueError, match="mixtral"):
        apply_patches(
            {"LlamaAttention": FusedQKVLlamaAttention}, conversion_rules={"llama": [QKV]}, overwrite=["mixtral"]
        )
    with pytest.raises(ValueError, match="conversion_rules"):
        apply_patches({"LlamaAttention": FusedQKVLlamaAttention}, overwrite=True)


def test_apply_patches_with_overwrite_loads_like_the_recipe(tmp_path):
    """The full example recipe (per-expert experts, built-in expert fusion dropped with overwrite) and the same
    mapping and rules given to apply_patches produce identical models: one code path."""
    save_tiny(Qwen2MoeForCausalLM, tiny_qwen2_moe_config(), tmp_path)
    recipe = get_recipe("qwen2_moe-full-example")
    with recipe.apply(strict=True):
        by_recipe = AutoModelForCausalLM.from_pretrained(tmp_path)
    overwritten = [name for name, spec in recipe.conversion.items() if spec.overwrite]
    assert overwritten == ["qwen2_moe"]
    with apply_patches(
        dict(recipe.patch_mapping), strict=True, conversion_rules=recipe.build_conversion_rules(), overwrite=overwritten
    ):
        by_block = AutoModelForCausalLM.from_pretrained(tmp_path)
    a, b = by_recipe.state_dict(), by_block.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert any("experts.0." in k for k in a)  # per-expert layout, so overwrite really took effect


# -- rules of strict and nested blocks --------------------------------------------------------------------------------


def test_strict_block_raises_for_a_conversion_rule_matching_nothing(tmp_path):
    from modelpatch.conversion import Concatenate, ConversionError, WeightConverter
    from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention

    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    qkv = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    never = WeightConverter(["gate_a", "gate_b"], ["mlp.gate_ab"], [Concatenate(dim=0)])
    with pytest.raises(ConversionError, match="gate_a.*matched no checkpoint key"):
        with apply_patches(
            {"LlamaAttention": FusedQKVLlamaAttention}, strict=True, conversion_rules={"llama": [qkv, never]}
        ):
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
