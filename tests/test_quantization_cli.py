"""``modelpatch verify --quantization NAME`` in process: the census (Linear layers and expert weights quantized,
which were not), the output difference to the full-precision patched model, the quantized save round trip, and the
one-line errors for an unknown name."""

from __future__ import annotations

import json

import pytest

from modelpatch.cli import main
from modelpatch.cli.errors import CliError
from modelpatch.cli.quantize import Quantization, quantization_config
from quantization_support import save_checkpoint


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return save_checkpoint("qwen3_moe-linear-experts", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_checkpoint("llama-fused-qkv", tmp_path_factory.mktemp("llama"))


def verify(capsys, *argv) -> tuple[int, dict]:
    code = main(["verify", *argv, "--json", "--no-progress"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("quantizer", ["torchao-int8", "bnb-8bit"])
def test_experts_recipe_quantizes_every_expert_and_round_trips(qwen3_moe, capsys, quantizer):
    code, report = verify(
        capsys, "--model", qwen3_moe, "--recipe", "qwen3_moe-linear-experts", "--quantization", quantizer
    )
    assert code == 0 and report["ok"] is True
    quantization = report["quantization"]
    assert quantization["census"] == {
        "linear": 2 * (4 + 4 * 3) + 1,  # q/k/v/o and 4 experts x 3 per layer, lm_head
        "linear_quantized": 2 * (4 + 4 * 3),
        "expert_linear": 24,
        "expert_linear_quantized": 24,
        "not_quantized": ["lm_head"],
        "fused_experts_full_precision": [],
    }
    assert 0 < quantization["output"]["max_abs_diff_to_full_precision"] <= quantization["output"]["atol"] == 0.05
    assert quantization["save"] == {"layout": "original", "note": "", "reload_max_abs_diff": 0.0}
    checks = {c["name"]: c["ok"] for c in report["checks"]}
    assert checks["quantized"] is True and checks["quantized save"] is True


def test_bnb_4bit_fused_qkv_saves_the_patched_layout_and_says_why(llama, capsys):
    code, report = verify(capsys, "--model", llama, "--recipe", "llama-fused-qkv", "--quantization", "bnb-4bit")
    assert code == 0
    save = report["quantization"]["save"]
    assert save["layout"] == "patched (save_original_format=False)" and save["reload_max_abs_diff"] == 0.0
    assert save["note"].startswith("Cannot save 'model.layers.0.self_attn.qkv_proj.weight' (bitsandbytes 4-bit)")
    assert report["quantization"]["census"]["linear_quantized"] == 2 * 5  # qkv, o, gate, up, down per layer


def test_fused_experts_left_by_the_recipe_fail_the_quantized_check(qwen3_moe, capsys, tmp_path):
    """Patches that leave the experts fused (an attention subclass): the census names them and the check fails
    (exit status 1). (A recipe of another family is refused before any load: tests/test_cli.py.)"""
    patches = tmp_path / "attention_only.py"
    patches.write_text(
        "from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention\n"
        "class SameAttention(Qwen3MoeAttention):\n    pass\n"
        "PATCH_MAPPING = {'Qwen3MoeAttention': SameAttention}\n"
    )
    code, report = verify(capsys, "--model", qwen3_moe, "--patches", str(patches), "--quantization", "torchao-int8")
    assert code == 1
    census = report["quantization"]["census"]
    assert census["expert_linear"] == 0 and census["fused_experts_full_precision"] == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
    ]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["quantized"]["ok"] is False and "4 fused experts parameter(s)" in checks["quantized"]["detail"]


def test_human_report_lists_the_quantization(qwen3_moe, capsys):
    code = main(
        [
            "verify",
            "--model",
            qwen3_moe,
            "--recipe",
            "qwen3_moe-linear-experts",
            "--quantization",
            "torchao-int8",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "== quantization (torchao-int8)" in out
    assert "expert Linear layers quantized   24 of 24" in out
    assert "not quantized                    lm_head" in out


def test_unknown_quantization_is_one_line_listing_the_known_ones(qwen3_moe, capsys):
    code = main(["verify", "--model", qwen3_moe, "--recipe", "qwen3_moe-linear-experts", "--quantization", "int3"])
    err = capsys.readouterr().err
    assert code == 2
    assert (
        err == "modelpatch: error: unknown quantization 'int3'; known: torchao-int8, quanto-int8, bnb-8bit, bnb-4bit\n"
    )


def test_missing_backend_names_the_extra_to_install():
    absent = Quantization("absent-int8", "absent", "modelpatch_absent_backend", lambda: None, 0.05)
    with pytest.raises(CliError) as error:
        quantization_config("absent-int8", {"absent-int8": absent})
    assert str(error.value) == (
        "--quantization absent-int8 needs modelpatch_absent_backend (No module named 'modelpatch_absent_backend'); "
        "install it with pip install 'modelpatch[absent]'"
    )


def test_a_recipe_for_another_model_type_is_a_one_line_error(capsys):
    """With no --model, verify used the built-in qwen2_moe checkpoint and failed "0 module(s) replaced" without
    saying that the recipe is for qwen3_moe."""
    code = main(["verify", "--recipe", "qwen3_moe-linear-experts", "--quantization", "torchao-int8", "--no-progress"])
    assert code == 2
    assert "recipe qwen3_moe-linear-experts is for model type(s) qwen3_moe" in capsys.readouterr().err


def test_half_precision_doubles_the_quantized_tolerance(qwen3_moe, capsys):
    """In bfloat16 the activations' rounding adds to the quantizer's error: a fresh-user run failed at 0.0625 against
    the float32 budget of 0.05 with every expert quantized."""
    code, report = verify(
        capsys,
        "--model",
        qwen3_moe,
        "--recipe",
        "qwen3_moe-linear-experts",
        "--quantization",
        "torchao-int8",
        "--dtype",
        "bfloat16",
    )
    output = report["quantization"]["output"]
    assert code == 0 and output["atol"] == 0.1 and output["max_abs_diff_to_full_precision"] <= 0.1
    assert report["quantization"]["census"]["expert_linear_quantized"] == 24


def test_bnb_4bit_on_layers_bitsandbytes_cannot_pack_is_one_line(tmp_path, capsys):
    """bitsandbytes 0.50's 4-bit CPU packing (AVX-512-BF16 CPUs) crashed the first forward of 32-input expert
    Linears (``shape '[64, 0]' is invalid``, a traceback); where it packs, verify says so in one line (exit 2)."""
    from bitsandbytes.functional import has_avx512bf16
    from transformers import AutoModelForCausalLM

    from helpers import tiny_qwen3_moe_config
    from modelpatch.cli.quantize import bnb_cpu_packing_problem
    from modelpatch.recipes import get_recipe

    AutoModelForCausalLM.from_config(tiny_qwen3_moe_config()).save_pretrained(tmp_path)  # experts 32 wide
    with get_recipe("qwen3_moe-linear-experts").apply():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization_config("bnb-4bit")[1])
    expected = (
        "bitsandbytes cannot pack 'model.layers.0.mlp.experts.0.down_proj' (32 inputs, 64 outputs) for its 4-bit CPU "
        "kernels on this machine (AVX-512-BF16): they need in_features a multiple of 64 and out_features a multiple "
        "of 32"
    )
    assert bnb_cpu_packing_problem(model, packing=True) == expected  # the rule, on every CPU
    assert bnb_cpu_packing_problem(model, packing=False) is None
    capsys.readouterr()
    code = main(
        ["verify", "--model", str(tmp_path), "--recipe", "qwen3_moe-linear-experts", "--quantization", "bnb-4bit"]
        + ["--no-progress"]
    )
    captured = capsys.readouterr()
    if has_avx512bf16():  # where bitsandbytes packs
        assert code == 2
        assert captured.err == f"modelpatch: error: --quantization bnb-4bit: {expected}\n"  # one line
    else:  # bitsandbytes' unpacked CPU path runs these layers
        assert code == 0, captured.out
