"""Linear experts derived from the decorated experts classes: the new exact operations, the alternative checkpoint
layouts (the layout loaded is the layout saved; a built model saves the Hub layout), the generic recipe, the lazy
class table and the reasons of unsupported families. (Every family: tests/test_conversion_linear_experts_support.py.)
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GptOssConfig

from helpers import TINY, tiny_mixtral_config, tiny_qwen3_moe_config
from modelpatch.conversion import Deinterleave, Interleave, SwapDims
from modelpatch.recipes import LINEAR_EXPERTS_CLASSES, UnsupportedExpertsError, get_recipe
from modelpatch.recipes.linear_experts import LinearExperts, experts_family

IDS = torch.tensor([[3, 17, 99, 4, 55, 23, 8, 1]])


def test_deinterleave_interleave_swapdims_are_exact_inverses():
    fused = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8)
    pieces = Deinterleave(dim=2).convert({"f": fused}, ["f"], ["g", "u"])
    assert torch.equal(pieces["g"], fused[..., 0::2]) and torch.equal(pieces["u"], fused[..., 1::2])
    back = Interleave(dim=2).convert(dict(pieces), ["g", "u"], ["f"])
    assert torch.equal(back["f"], fused)
    assert type(Deinterleave(dim=1).reverse_op) is Interleave and Interleave(dim=1).reverse_op.dim == 1
    swapped = SwapDims(1, 2).convert({"f": fused, "l": [fused, fused]}, ["f"], ["f"])
    assert torch.equal(swapped["f"], fused.transpose(1, 2)) and len(swapped["l"]) == 2
    assert torch.equal(SwapDims(1, 2).reverse_op.convert(swapped, ["f"], ["f"])["f"], fused)


def _gpt_oss_config():
    return GptOssConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2)


def _randomized(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def test_gpt_oss_interleaved_transposed_biased_experts(tmp_path):
    # gate = columns 0::2 and up = 1::2 of the transposed (E, H, 2I) tensor; biases split the same way
    vanilla = _randomized(AutoModelForCausalLM.from_config(_gpt_oss_config()))
    vanilla.save_pretrained(tmp_path / "ck")
    with get_recipe("gpt_oss-linear-experts").apply(strict=True):
        patched = AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    fused, linear = vanilla.model.layers[1].mlp.experts, patched.model.layers[1].mlp.experts
    assert type(linear) is LINEAR_EXPERTS_CLASSES["gpt_oss"] and type(linear).__name__ == "LinearGptOssExperts"
    for e, expert in enumerate(linear):
        assert torch.equal(expert.gate_proj.weight, fused.gate_up_proj[e, :, 0::2].t())
        assert torch.equal(expert.up_proj.weight, fused.gate_up_proj[e, :, 1::2].t())
        assert torch.equal(expert.down_proj.weight, fused.down_proj[e].t())
        assert torch.equal(expert.gate_proj.bias, fused.gate_up_proj_bias[e, 0::2])
        assert torch.equal(expert.down_proj.bias, fused.down_proj_bias[e])
        assert (expert.alpha, expert.limit) == (fused.alpha, fused.limit)  # what gpt-oss's _apply_gate reads
    with torch.no_grad():
        assert (vanilla(IDS).logits - patched(IDS).logits).abs().max().item() <= 1e-5
    patched.save_pretrained(tmp_path / "back")
    ck, back = load_file(tmp_path / "ck" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(ck) and all(torch.equal(back[k], ck[k]) for k in ck)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_mixtral_layout_loaded_is_layout_saved_without_warnings(layout, tmp_path, caplog):
    vanilla = _randomized(AutoModelForCausalLM.from_config(tiny_mixtral_config()))
    vanilla.save_pretrained(tmp_path / "ck", **({} if layout == "per-expert" else {"save_original_format": False}))
    ck = load_file(tmp_path / "ck" / "model.safetensors")
    assert ("model.layers.0.block_sparse_moe.experts.3.w2.weight" in ck) == (layout == "per-expert")
    with caplog.at_level(logging.INFO, logger="modelpatch"), get_recipe("mixtral-linear-experts").apply(strict=True):
        patched = AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    assert not [r for r in caplog.records if "matched no checkpoint key" in r.getMessage()]
    experts = patched.model.layers[0].mlp.experts
    fused = vanilla.model.layers[0].mlp.experts
    half = fused.gate_up_proj.shape[1] // 2
    assert torch.equal(experts[3].w1.weight, fused.gate_up_proj[3, :half])
    assert torch.equal(experts[3].w3.weight, fused.gate_up_proj[3, half:])
    assert torch.equal(experts[3].w2.weight, fused.down_proj[3])
    patched.save_pretrained(tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(ck) and all(torch.equal(back[k], ck[k]) for k in ck)


def test_built_from_config_saves_the_hub_layout(tmp_path):
    with get_recipe("mixtral-linear-experts").apply():
        model = AutoModelForCausalLM.from_config(tiny_mixtral_config())
    model.save_pretrained(tmp_path / "out")
    keys = set(load_file(tmp_path / "out" / "model.safetensors"))
    AutoModelForCausalLM.from_config(tiny_mixtral_config()).save_pretrained(tmp_path / "plain")
    assert keys == set(load_file(tmp_path / "plain" / "model.safetensors"))  # block_sparse_moe.experts.{e}.w1..w3
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in keys


def test_generic_recipe_covers_every_family_and_loads_both(tmp_path):
    generic = get_recipe("linear-experts")
    assert generic.patch_mapping["Qwen3MoeExperts"] is LINEAR_EXPERTS_CLASSES["qwen3_moe"]
    assert generic.patch_mapping["GptOssExperts"] is LINEAR_EXPERTS_CLASSES["gpt_oss"]
    assert "MuseSparkExperts" not in generic.patch_mapping  # unsupported (post-expert norm)
    assert len(generic.patch_mapping) >= 55 and all(
        issubclass(c, LinearExperts) for c in generic.patch_mapping.values()
    )
    vanilla = _randomized(AutoModelForCausalLM.from_config(tiny_qwen3_moe_config()))
    vanilla.save_pretrained(tmp_path / "fused", save_original_format=False)
    with generic.apply(strict=True):
        patched = AutoModelForCausalLM.from_pretrained(tmp_path / "fused").eval()
    assert type(patched.model.layers[0].mlp.experts) is LINEAR_EXPERTS_CLASSES["qwen3_moe"]
    with torch.no_grad():
        assert (vanilla(IDS).logits - patched(IDS).logits).abs().max().item() <= 1e-5


def test_unsupported_families_name_the_reason():
    with pytest.raises(UnsupportedExpertsError, match="MuseSparkExperts has a post-expert norm"):
        get_recipe("muse_spark_text-linear-experts")
    with pytest.raises(UnsupportedExpertsError, match="no experts class decorated"):
        experts_family("llama")
    assert "muse_spark_text-linear-experts" not in get_recipe.__globals__["list_recipes"]()
    assert experts_family("mixtral").names == ("w1", "w3", "w2")  # from Transformers' conversion mapping
    assert experts_family("nemotron_h").names == ("up_proj", "down_proj")  # has_gate=False


def test_a_class_shared_by_two_model_types_has_one_set_of_names_whichever_comes_first():
    """minimax_m3_vl_text uses minimax_m3_vl's experts class and has no expert converter of its own: it took the
    default names, and whichever type built the replacement class first decided the linears' names for both, so a
    fused load failed after the generic recipe had been built (found by running the suite in another order)."""
    import linear_experts_support as support

    get_recipe("linear-experts")  # builds every family's class first, as the failing order did
    text, composite = experts_family("minimax_m3_vl_text"), experts_family("minimax_m3_vl")
    assert text.names == composite.names == ("w1", "w3", "w2")  # the composite's conversion mapping
    assert LINEAR_EXPERTS_CLASSES["minimax_m3_vl_text"] is LINEAR_EXPERTS_CLASSES["minimax_m3_vl"]
    assert support.check("minimax_m3_vl_text", "minimax_m3_vl_text") == (True, "MiniMaxM3VLExperts", "w1/w3/w2")


def test_built_from_config_saves_what_plain_transformers_loads_for_fused_only_families(tmp_path):
    """gpt_oss has no per-expert Hub layout (Transformers saves and loads its experts fused): a model built inside
    the recipe saved per-expert tensors, which plain Transformers loaded with random experts and only a load report
    (logits 2.6e-2 off). The default layout of such a family is the fused one."""
    torch.manual_seed(0)
    with get_recipe("gpt_oss-linear-experts").apply():
        built = _randomized(AutoModelForCausalLM.from_config(_gpt_oss_config()))
    built.save_pretrained(tmp_path / "saved")
    keys = set(load_file(tmp_path / "saved" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        assert torch.equal(plain(IDS).logits, built(IDS).logits)


def test_a_rule_after_renamings_saves_its_pieces_with_the_sizes_it_loaded():
    """Ling (bailing_hybrid): Transformers renames `.attention.` to `.self_attn.`, then concatenates the q/k/v
    convolution kernels; on save the concatenation runs backwards before the renaming is undone, and the shapes
    recorded at load were keyed by the checkpoint's `.attention.` names only, so the save refused to split
    (measured "no" on 5.23, 5.24, 5.25). Its SwiGLU limits are on (0.5) in the tiny config."""
    import linear_experts_support as support

    assert support.check("bailing_hybrid", "bailing_hybrid") == (
        True,
        "BailingHybridExperts",
        "gate_proj/up_proj/down_proj",
    )


def test_step3p5_experts_clip_like_the_fused_ones_where_transformers_decorates_them():
    """5.25 decorates Step-3.5's experts; their SwiGLU limit is None on unclipped layers, an attribute the per-expert
    modules lacked (AttributeError: 'ExpertMLP' object has no attribute 'limit')."""
    import linear_experts_support as support

    try:
        family = experts_family("step3p5")
    except UnsupportedExpertsError:  # 5.23 / 5.24: Step3p7Experts is not decorated
        assert transformers_release() < (5, 25)
        return
    assert family.original == "Step3p7Experts"
    assert support.check("step3p5", "step3p5") == (True, "Step3p7Experts", "gate_proj/up_proj/down_proj")


def transformers_release() -> tuple[int, ...]:
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2])
