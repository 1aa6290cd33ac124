"""Conversion rules built with Transformers' own classes are taken like modelpatch's, and an operation *class* where an
instance belongs is refused where the rule is built or registered, with the fix in the message."""

from __future__ import annotations

import pytest
from transformers import core_model_loading as tcml

from modelpatch import (
    Concatenate,
    WeightConverter,
    apply_patches,
    register_checkpoint_conversion_mapping,
)
from modelpatch.conversion import registry
from modelpatch.conversion.rules import as_modelpatch_rule
from modelpatch.recipes import Recipe, RuleSpec
from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention

QKV = (["q_proj", "k_proj", "v_proj"], ["qkv_proj"])
FIX = "write operations=[Concatenate(dim=0)] instead of operations=[Concatenate]"


def test_modelpatch_converter_refuses_an_operation_class():
    with pytest.raises(TypeError) as error:
        WeightConverter(*QKV, [Concatenate])
    assert str(error.value) == f"operation modelpatch.conversion.ops.Concatenate is a class, not an instance: {FIX}"


@pytest.mark.parametrize("where", ["register", "apply_patches", "Recipe.apply"])
def test_transformers_converter_with_an_operation_class_is_refused_at_registration(where):
    rule = tcml.WeightConverter(*QKV, [tcml.Concatenate])  # Transformers itself accepts it, and fails at load
    with pytest.raises(TypeError) as error:
        if where == "register":
            register_checkpoint_conversion_mapping("llama", [rule])
        elif where == "apply_patches":
            with apply_patches({"LlamaAttention": FusedQKVLlamaAttention}, conversion_rules={"llama": [rule]}):
                pass
        else:
            with Recipe(
                "r", "d", {"LlamaAttention": FusedQKVLlamaAttention}, {"llama": RuleSpec(lambda: [rule])}
            ).apply():
                pass
    assert (
        str(error.value) == f"operation transformers.core_model_loading.Concatenate is a class, not an instance: {FIX}"
    )
    assert registry.lookup("llama") is None  # nothing registered


def test_single_operation_instead_of_a_list():
    with pytest.raises(
        TypeError,
        match=r"operations must be a list, got one operation: write "
        r"operations=\[Concatenate\(dim=0\)\]",
    ):
        WeightConverter(*QKV, Concatenate(dim=0))


def test_transformers_rule_is_rebuilt_with_its_settings():
    rule = tcml.WeightConverter(*QKV, [tcml.Concatenate(dim=0)], force_cpu=True)
    rule.scope_prefix, rule.base_model_prefix = "text_model", "model"
    rebuilt = as_modelpatch_rule(rule)
    assert isinstance(rebuilt, WeightConverter) and isinstance(rebuilt.operations[0], Concatenate)
    assert (rebuilt.force_cpu, rebuilt.scope_prefix, rebuilt.base_model_prefix) == (True, "text_model", "model")
    # the report names the rebuilt rule; the same text whether it was written with Transformers' classes or ours
    assert repr(rebuilt) == repr(WeightConverter(*QKV, [Concatenate(dim=0)]))
