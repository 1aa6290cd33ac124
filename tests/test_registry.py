"""Registry API: validation is atomic, keys resolve by the documented rules."""

import re

import pytest
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import __version__ as transformers_version

from modelpatch import (
    Concatenate,
    WeightConverter,
    clear_patch_mapping,
    get_checkpoint_conversion_mapping,
    get_patch_mapping,
    register_checkpoint_conversion_mapping,
    register_patch_mapping,
    unregister_checkpoint_conversion_mapping,
    unregister_patch_mapping,
)
from modelpatch.patching.registry import build_patch_mapping
from modelpatch.recipes import get_recipe


class A(nn.Module):
    pass


class B(nn.Module):
    pass


class C(nn.Module):
    pass


def test_register_get_unregister_clear():
    register_patch_mapping({"LlamaAttention": A})
    register_patch_mapping({".*MLP$": B, "Qwen2MoeExperts": C})
    assert get_patch_mapping() == {"LlamaAttention": A, ".*MLP$": B, "Qwen2MoeExperts": C}
    assert list(get_patch_mapping()) == ["LlamaAttention", ".*MLP$", "Qwen2MoeExperts"]
    unregister_patch_mapping(["Qwen2MoeExperts"])
    assert get_patch_mapping() == {"LlamaAttention": A, ".*MLP$": B}
    unregister_patch_mapping([".*MLP$"])
    assert get_patch_mapping() == {"LlamaAttention": A}
    clear_patch_mapping()
    assert get_patch_mapping() == {}


def test_get_patch_mapping_returns_a_copy():
    register_patch_mapping({"LlamaAttention": A})
    copy = get_patch_mapping()
    copy["LlamaMLP"] = B
    assert get_patch_mapping() == {"LlamaAttention": A}


def test_overwrite():
    register_patch_mapping({"LlamaAttention": A})
    with pytest.raises(ValueError, match="LlamaAttention"):
        register_patch_mapping({"LlamaAttention": B})
    assert get_patch_mapping() == {"LlamaAttention": A}
    register_patch_mapping({"LlamaAttention": B}, overwrite=True)
    assert get_patch_mapping() == {"LlamaAttention": B}


@pytest.mark.parametrize(
    "bad, error, fragment",
    [
        ({"Good": A, "Bad": 3}, TypeError, "'Bad'"),
        ({"Good": A, "Bad": object}, TypeError, "'Bad'"),
        ({"Good": A, "Bad": nn.Linear(1, 1)}, TypeError, "'Bad'"),
        ({"Good": A, "Bad[": B}, ValueError, "'Bad\\['"),
        ({"Good": A, "(unclosed": B}, ValueError, "missing \\), unterminated subpattern"),
        ({"Good": A, "": B}, ValueError, "empty"),
        ({"Good": A, 5: B}, TypeError, "5"),
    ],
)
def test_invalid_registration_changes_nothing(bad, error, fragment):
    register_patch_mapping({"Existing": C})
    with pytest.raises(error, match=fragment):
        register_patch_mapping(bad)
    assert get_patch_mapping() == {"Existing": C}


def test_duplicate_in_failed_call_changes_nothing():
    register_patch_mapping({"X": A})
    with pytest.raises(ValueError, match="'X'"):
        register_patch_mapping({"New": B, "X": C})
    assert get_patch_mapping() == {"X": A}


def test_unregister_unknown_key_changes_nothing():
    register_patch_mapping({"X": A, "Y": B})
    with pytest.raises(ValueError, match="'Z'"):
        unregister_patch_mapping(["X", "Z"])
    assert get_patch_mapping() == {"X": A, "Y": B}


def test_unregister_accepts_a_single_string():
    register_patch_mapping({"X": A, "Y": B})
    unregister_patch_mapping("X")
    assert get_patch_mapping() == {"Y": B}


def test_mapping_must_be_a_dict():
    with pytest.raises(TypeError, match="dict"):
        register_patch_mapping([("X", A)])


def test_exact_key_is_not_a_regex():
    mapping = build_patch_mapping({"LlamaAttention": A})
    assert mapping.resolve("LlamaAttention").replacement is A
    assert mapping.resolve("DiffLlamaAttention") is None
    assert mapping.resolve("LlamaAttentionX") is None


def test_exact_beats_pattern_and_first_pattern_wins():
    mapping = build_patch_mapping({".*Attention": A, "Llama.*": C, "LlamaAttention": B})
    assert mapping.resolve("LlamaAttention").replacement is B
    assert mapping.resolve("MistralAttention").replacement is A
    assert mapping.resolve("LlamaMLP").replacement is C
    assert mapping.resolve("LlamaSdpaAttention").replacement is A  # first registered pattern
    assert mapping.resolve("BertModel") is None


def test_patterns_are_case_sensitive_and_anchorable():
    mapping = build_patch_mapping({"^Llama\\d+Attention$": A})
    assert mapping.resolve("Llama3Attention").replacement is A
    assert mapping.resolve("llama3Attention") is None
    assert mapping.resolve("XLlama3Attention") is None


# --- property-based: resolution against a small reference model of the rules -----------------------

_names = st.from_regex(r"[A-Z][a-z]{0,3}[A-Z]?[a-z]{0,3}", fullmatch=True)
_patterns = st.sampled_from([".*Attention", "^Ll", "MLP$", "a", "[A-Z][a-z]+[A-Z]", "^[A-Z]$", "Ab|Cd"])
_replacements = st.sampled_from([A, B, C])


def _reference_resolve(entries: list[tuple[str, type]], name: str):
    """The rules, written out plainly: exact identifier keys first, then patterns in order."""
    for key, value in entries:
        if key.isidentifier() and key == name:
            return value
    for key, value in entries:
        if not key.isidentifier() and re.search(key, name):
            return value
    return None


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(st.tuples(st.one_of(_names, _patterns), _replacements), max_size=6, unique_by=lambda e: e[0]),
    name=st.one_of(_names, st.sampled_from(["LlamaAttention", "MLP", "Ab", "Cd"])),
)
def test_resolution_matches_reference_model(entries, name):
    mapping = build_patch_mapping(dict(entries))
    rule = mapping.resolve(name)
    expected = _reference_resolve(entries, name)
    assert (rule.replacement if rule else None) is expected


@settings(max_examples=50, deadline=None)
@given(entries=st.lists(st.tuples(_names, _replacements), max_size=5, unique_by=lambda e: e[0]))
def test_register_then_unregister_restores_registry(entries):
    register_patch_mapping({"Keep": A})
    before = get_patch_mapping()
    new = {k: v for k, v in entries if k != "Keep"}
    register_patch_mapping(new)
    assert get_patch_mapping() == {**before, **new}
    unregister_patch_mapping(list(new))
    assert get_patch_mapping() == before
    clear_patch_mapping()


def test_a_misspelled_class_name_is_named_with_the_closest_at_registration(caplog):
    """A key that names (or, a pattern, matches) no module class of Transformers replaces nothing: registration names
    it, with the closest class names when any are close, and strict (the argument or registry-wide strict mode)
    refuses it, the registry unchanged (issue 24, item 2). A near miss ('LlamaAtention') and a key far from any class
    ('LlamaAttn', 'FooBar': a fresh-user finding, registered quietly before) alike. Known classes and patterns that
    match one are registered quietly."""
    import logging

    from modelpatch import UnmatchedPatchKeyError, set_strict_patching

    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        register_patch_mapping({"LlamaAttention": A, ".*MLP$": B})
        assert not caplog.records
        register_patch_mapping({"LlamaAtention": A, "Qwen2MoeExpert": B, "LlamaAttn": C, "FooBar": C, ".*Atention$": C})
    never = "The key replaces nothing unless remote code loaded later defines"
    assert [r.getMessage() for r in caplog.records] == [
        *(
            f"modelpatch: patch key {key!r} names no module class of the installed Transformers {transformers_version} "
            f"nor of loaded remote code{close} {never} that class"
            for key, close in (
                ("LlamaAtention", ": did you mean 'LlamaAttention'?"),
                ("Qwen2MoeExpert", ": did you mean 'Qwen2MoeExperts'?"),
                ("LlamaAttn", ": did you mean 'LlamaAttention'?"),
                ("FooBar", "."),
            )
        ),
        f"modelpatch: patch key '.*Atention$' matches no module class of the installed Transformers "
        f"{transformers_version} nor of loaded remote code. {never} such a class",
    ]
    before = get_patch_mapping()
    with pytest.raises(UnmatchedPatchKeyError, match=r"'llamamlp'.*did you mean 'LlamaMLP'\? \(class names are case"):
        register_patch_mapping({"LlamaMLP": B, "llamamlp": B}, strict=True)
    with pytest.raises(UnmatchedPatchKeyError, match=r"'FooBaz' names no module class .*nothing was registered"):
        register_patch_mapping({"FooBaz": A}, strict=True)
    set_strict_patching(True)
    try:
        with pytest.raises(UnmatchedPatchKeyError, match=r"'GPT2Atention'.*'GPT2Attention'.*nothing was registered"):
            register_patch_mapping({"GPT2Atention": A})
    finally:
        set_strict_patching(False)
    assert get_patch_mapping() == before


# -- clean-up in either order -----------------------------------------------------------------------------------------


FusedQKVAttention = get_recipe("llama-fused-qkv").patch_mapping["LlamaAttention"]


QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])


def test_unregister_after_clear_is_a_no_op_for_both_registries():
    register_patch_mapping({"LlamaAttention": FusedQKVAttention})
    register_checkpoint_conversion_mapping("llama", [QKV])
    try:
        clear_patch_mapping()  # clears user conversion rules too
    finally:
        unregister_checkpoint_conversion_mapping("llama")  # raised KeyError before
        unregister_patch_mapping(["LlamaAttention"])
    assert get_patch_mapping() == {}
    assert get_checkpoint_conversion_mapping("llama") is None
    # never registered: still an error, unless missing_ok
    with pytest.raises(KeyError):
        unregister_checkpoint_conversion_mapping("llama")
    with pytest.raises(ValueError):
        unregister_patch_mapping(["LlamaAttention"])
    unregister_checkpoint_conversion_mapping("llama", missing_ok=True)
    unregister_patch_mapping(["LlamaAttention"], missing_ok=True)


def test_recipe_unregister_after_clear_patch_mapping():
    recipe = get_recipe("llama-fused-qkv")
    recipe.register()
    clear_patch_mapping()
    recipe.unregister()  # raised KeyError before
    assert get_patch_mapping() == {}
