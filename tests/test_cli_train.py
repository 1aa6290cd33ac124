"""``modelpatch verify --train``: the same optimizer steps on the unpatched and the patched model, compared per
checkpoint key (src/modelpatch/cli/train_check.py).

Passing: per-expert linear experts on a tiny Qwen2-MoE (idle experts named, every key within the optimizer's bound),
a fused-QKV Llama (float32 and a bfloat16 verify, trained in float32), the built-in example with no argument, SGD
and Adafactor (the keys whose layout differs are not judged under Adafactor). Failing (exit 1, the parameter named):
linear experts with ``skip_idle_experts = True`` (idle experts get ``grad=None``, AdamW skips them), an attention
that scales its output in training only. Bad options: one-line errors, exit 2, nothing trained.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from modelpatch.cli import main
from modelpatch.cli.errors import CliError
from modelpatch.cli.train_check import OPTIMIZERS, run_train_check
from modelpatch.recipes import get_recipe
from modelpatch.routing import record_routing
from recipes_support import save_case, tensors

SKIP_IDLE = """
import dataclasses
from modelpatch.recipes import get_recipe

_base = get_recipe("qwen2_moe-linear-experts")


class SkippingQwen2MoeExperts(_base.patch_mapping["Qwen2MoeExperts"]):
    skip_idle_experts = True  # idle experts stay out of the graph: grad=None, the optimizer skips them


RECIPE = dataclasses.replace(_base, name="skip-idle", patch_mapping={"Qwen2MoeExperts": SkippingQwen2MoeExperts})
"""

TRAINING_ONLY_SCALE = """
import dataclasses
from modelpatch.recipes import get_recipe
from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention


class ScaledInTrainingAttention(FusedQKVLlamaAttention):
    def forward(self, hidden_states, *args, **kwargs):
        out, weights = super().forward(hidden_states, *args, **kwargs)
        return (out * 1.01 if self.training and self.layer_idx == 1 else out), weights


RECIPE = dataclasses.replace(
    get_recipe("llama-fused-qkv"), name="scaled", patch_mapping={"LlamaAttention": ScaledInTrainingAttention}
)
"""

EXPERTS = [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
PROJ = ("gate_proj", "up_proj", "down_proj")
EVAL_CHECKS = ["patches", "loading", "provenance", "outputs", "padding", "cache (dynamic)", "cache (static)"]
EVAL_CHECKS += ["generate", "routing", "round trip"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-ck")
    return {name: save_case(name, root / name) for name in ("qwen2_moe-linear-experts", "llama-fused-qkv")}


def run_json(capsys, argv) -> tuple[int, dict]:
    code = main([*argv, "--json", "--no-progress"])
    return code, json.loads(capsys.readouterr().out)


def _checks(report) -> dict[str, bool | None]:
    """``{name: ok}``; ``None`` for a check skipped (e.g. routing on a dense model)."""
    return {c["name"]: c["ok"] for c in report["checks"]}


def _assert_within_bounds(training) -> None:
    for key in training["keys"]:
        if key["status"] == "fp32 rounding":  # beyond the fp32 bound, within the float64 one when trained in float64
            assert key["judged"] > training["bound"] and key["float64"] <= training["bound_float64"], key
        else:
            assert key["status"] == "ok" and key["judged"] <= training["bound"], key


def test_linear_experts_train_like_the_fused_original(checkpoints, capsys):
    path = checkpoints["qwen2_moe-linear-experts"]
    code, report = run_json(capsys, ["verify", "--model", path, "--recipe", "qwen2_moe-linear-experts", "--train"])
    assert code == 0 and report["ok"] is True
    assert [c["name"] for c in report["checks"]] == [*EVAL_CHECKS, "training", "gradients"]
    training = report["training"]
    assert training["ok"] is True and training["optimizer"] == "adamw" and training["steps"] == 3
    assert training["lr"] == 1e-3 and training["bound"] == pytest.approx(5e-5, rel=1e-12)
    assert training["loss"] == "the model's loss with labels=input_ids"
    # every checkpoint key, in the checkpoint layout (one tensor per expert), judged
    assert sorted(k["key"] for k in training["keys"]) == sorted(tensors(path))
    assert len(training["keys"]) == 55
    _assert_within_bounds(training)
    assert training["diverged"] == [] and training["missing_gradients"] == []
    assert training["max_moved"] > 20 * training["bound"]  # the steps moved the weights
    assert training["losses"]["patched"] == pytest.approx(training["losses"]["unpatched"], abs=1e-5)
    # the idle experts: one entry per (step, module) with an expert that got no token
    assert training["experts_modules"] == 2
    idle = {(i["step"], i["module"]): i["experts"] for i in training["idle_experts"]}
    assert idle and set(m for _, m in idle) <= set(EXPERTS) and all(i["of"] == 4 for i in training["idle_experts"])
    # step 0 runs on the checkpoint's weights: the routing recorded on a plain load agrees
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)
    for layer, module in enumerate(EXPERTS):
        routed = set(trace[layer][0].flatten().tolist())
        assert idle.get((0, module), []) == sorted(set(range(4)) - routed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_qkv_llama_trains_like_the_original(checkpoints, dtype, capsys):
    path = checkpoints["llama-fused-qkv"]
    argv = ["verify", "--model", path, "--recipe", "llama-fused-qkv", "--train", "--dtype", dtype]
    code, report = run_json(capsys, argv)
    assert code == 0, report["checks"]
    training = report["training"]
    keys = {k["key"] for k in training["keys"]}
    assert keys == set(tensors(path))  # q_proj/k_proj/v_proj, not qkv_proj
    assert {f"model.layers.1.self_attn.{p}_proj.{s}" for p in "qkv" for s in ("weight", "bias")} <= keys
    _assert_within_bounds(training)
    assert training["experts_modules"] == 0 and training["idle_experts"] == []
    assert training["max_moved"] > 20 * training["bound"]


def test_train_without_arguments_runs_on_the_built_in_example(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MODELPATCH_CACHE", str(tmp_path))
    code, report = run_json(capsys, ["verify", "--train", "--steps", "2", "--optimizer", "adam"])
    assert code == 0 and report["recipe"] == "qwen2_moe-full-example"
    assert report["model_dir"] == os.path.join(str(tmp_path), "qwen2_moe-tiny-v1")
    training = report["training"]
    assert (training["optimizer"], training["steps"], len(training["losses"]["patched"])) == ("adam", 2, 2)
    assert training["settings"] == "adam (lr=0.001, torch.optim.Adam defaults)"
    _assert_within_bounds(training)
    assert {i["step"] for i in training["idle_experts"]} <= {0, 1} and training["idle_experts"]
    # the text report has the section and both checks
    assert main(["verify", "--train", "--steps", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "== training (adamw, 2 step(s))" in out and "experts that got no token" in out
    assert out.rstrip().endswith("PASS")


def test_sgd_bound_and_adafactor_layouts(checkpoints, capsys):
    path = checkpoints["qwen2_moe-linear-experts"]
    base = ["verify", "--model", path, "--recipe", "qwen2_moe-linear-experts", "--train"]
    code, report = run_json(capsys, [*base, "--optimizer", "sgd"])
    training = report["training"]
    assert code == 0 and training["bound"] == 1e-6 and training["lr"] == 0.05
    assert training["max_abs_diff"] <= 1e-6 and training["fp32_rounding"] == []
    # SGD's step is linear in lr: the bound follows it above the lr it was measured at
    assert OPTIMIZERS["sgd"].bound(0.5) == pytest.approx(1e-5) and OPTIMIZERS["sgd"].bound(0.01) == 1e-6
    # Adafactor: statistics per tensor, so the experts (fused in the original) are reported, not judged; every other
    # key is judged after the first step
    code, report = run_json(capsys, [*base, "--optimizer", "adafactor"])
    training = report["training"]
    assert code == 0 and training["bound"] == pytest.approx(0.05 * 1e-2)
    unjudged = {k["key"] for k in training["keys"] if k["status"] == "layout-dependent"}
    assert unjudged == {f"{m}.{e}.{p}.weight" for m in EXPERTS for e in range(4) for p in PROJ}
    assert all(k["judged"] is None for k in training["keys"] if k["key"] in unjudged)
    _assert_within_bounds({**training, "keys": [k for k in training["keys"] if k["key"] not in unjudged]})


def test_skip_idle_experts_fails_and_names_the_parameters(checkpoints, tmp_path, capsys):
    patches = tmp_path / "skip_idle.py"
    patches.write_text(SKIP_IDLE)
    path = checkpoints["qwen2_moe-linear-experts"]
    code, report = run_json(capsys, ["verify", "--model", path, "--patches", str(patches), "--train"])
    assert code == 1 and report["ok"] is False
    checks = _checks(report)
    assert all(checks[name] for name in EVAL_CHECKS)  # eval mode sees no difference
    assert checks["training"] is False and checks["gradients"] is False
    training = report["training"]
    # exactly the idle experts' parameters, in the steps they were idle, have no gradient
    expected: dict[str, list[int]] = {}
    for idle in training["idle_experts"]:
        for e in idle["experts"]:
            for p in PROJ:
                expected.setdefault(f"{idle['module']}.{e}.{p}.weight", []).append(idle["step"])
    got = {m["parameter"]: m["steps"] for m in training["missing_gradients"]}
    assert got == expected and got
    assert {m["unpatched_gradient_on"] for m in training["missing_gradients"]} <= {f"{m}.*" for m in EXPERTS}
    # AdamW stepped the fused original's idle slices (momentum, weight decay) and skipped these: they diverge, in
    # float64 too
    assert training["diverged"] and set(training["diverged"]) <= set(expected)
    by_key = {k["key"]: k for k in training["keys"]}
    assert all(by_key[k]["float64"] > 5 * training["bound"] for k in training["diverged"])
    worst = training["diverged"][0]
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "training")
    assert worst in detail and "beyond the bound 5e-05" in detail


def test_training_only_change_fails_and_names_the_parameters(checkpoints, tmp_path, capsys):
    patches = tmp_path / "scaled.py"
    patches.write_text(TRAINING_ONLY_SCALE)
    path = checkpoints["llama-fused-qkv"]
    code, report = run_json(capsys, ["verify", "--model", path, "--patches", str(patches), "--train"])
    assert code == 1
    checks = _checks(report)
    assert checks == {**dict.fromkeys(EVAL_CHECKS, True), "routing": None, "training": False, "gradients": True}
    assert report["output"]["max_abs_diff"] == 0.0
    assert checks["training"] is False and checks["gradients"] is True
    training = report["training"]
    assert training["losses"]["patched"][0] != training["losses"]["unpatched"][0]
    assert {"model.layers.1.self_attn.o_proj.weight", "lm_head.weight"} <= set(training["diverged"])
    by_key = {k["key"]: k for k in training["keys"]}
    assert all(by_key[k]["float64"] > training["bound"] for k in training["diverged"])
    # the text report lists every diverged key with its status
    assert main(["verify", "--model", path, "--patches", str(patches), "--train", "--no-progress"]) == 1
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.rstrip().endswith("DIVERGED")]
    assert len(rows) == len(training["diverged"]) and "model.layers.1.self_attn.o_proj.weight" in out


@pytest.mark.parametrize(
    "options, message",
    [
        (["--train", "--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
        (["--train", "--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
        (["--train", "--steps", "two"], "argument --steps: must be an integer >= 1, got 'two'"),
        (["--train", "--tokens", "-3"], "argument --tokens: must be an integer >= 1, got '-3'"),
        (["--train", "--lr", "0"], "argument --lr: must be a finite number > 0, got '0'"),
        (["--train", "--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
        (["--steps", "3", "--optimizer", "sgd"], "--steps, --optimizer only apply with --train"),
    ],
)
def test_bad_training_options_are_one_line_errors(options, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MODELPATCH_CACHE", str(tmp_path))
    assert main(["verify", *options]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(("modelpatch verify: error:", "modelpatch: error:"))
    assert not os.listdir(tmp_path)  # refused before the example checkpoint was even written


def test_run_train_check_refuses_bad_settings_before_training(checkpoints):
    path = checkpoints["llama-fused-qkv"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    with get_recipe("llama-fused-qkv").apply():
        patched = transformers.AutoModelForCausalLM.from_pretrained(path)
    before = {k: v.clone() for k, v in patched.state_dict().items()}
    for kwargs, message in [
        ({"optimizer": "lion"}, "unknown optimizer 'lion'; known: sgd, adam, adamw, adafactor"),
        ({"steps": 0}, "--steps: must be an integer >= 1, got 0"),
        ({"tokens": 0}, "--tokens: must be an integer >= 1, got 0"),
        ({"lr": float("inf")}, "--lr: must be a finite number > 0, got inf"),
        ({"tokens": 1}, "--tokens: a causal LM's loss with labels=input_ids needs at least 2 tokens per step"),
    ]:
        with pytest.raises(CliError, match=message.replace("(", r"\(")):
            run_train_check(reference, patched, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in patched.state_dict().items())
    assert all(p.grad is None for p in patched.parameters()) and not patched.training
    # a model without token embeddings to draw ids for
    embedding = reference.model.embed_tokens
    reference.model.embed_tokens = torch.nn.Identity()
    with pytest.raises(
        CliError, match="LlamaForCausalLM's is Identity, not an nn.Embedding; verify it without --train"
    ):
        run_train_check(reference, patched)
    reference.model.embed_tokens = embedding
    assert all(p.grad is None for p in reference.parameters())


def test_steps_that_move_nothing_are_not_a_pass(checkpoints, capsys):
    path = checkpoints["llama-fused-qkv"]
    argv = ["verify", "--model", path, "--recipe", "llama-fused-qkv", "--train", "--optimizer", "sgd", "--lr", "1e-9"]
    code, report = run_json(capsys, argv)
    expected = {**dict.fromkeys(EVAL_CHECKS, True), "routing": None, "training": False, "gradients": True}
    assert code == 1 and _checks(report) == expected  # routing: skipped, a dense model
    training = report["training"]
    assert training["diverged"] == [] and training["max_moved"] <= training["bound"] == 1e-6
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "training")
    assert "no weight moved more than the bound 1e-06" in detail and "raise --lr or --steps" in detail


NAN_IN_TRAINING = TRAINING_ONLY_SCALE.replace("out * 1.01", "out * float('nan')")


def test_a_loss_that_is_not_finite_fails_the_training_check(checkpoints, tmp_path, capsys):
    """A NaN loss has no gradient to compare: with weight decay moving the weights alike in both runs, the check
    passed ("largest judged difference 0") on NaN losses. It fails, naming the run and the step."""
    patches = tmp_path / "nan.py"
    patches.write_text(NAN_IN_TRAINING)
    path = checkpoints["llama-fused-qkv"]
    code, report = run_json(capsys, ["verify", "--model", path, "--patches", str(patches), "--train"])
    assert code == 1
    training = report["training"]
    assert training["ok"] is False and training["nonfinite_loss"][:2] == ["patched", 1]
    assert all(v == v for v in training["losses"]["unpatched"])  # finite: the unpatched run is fine
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "training")
    assert detail.startswith("the patched model's loss is nan at step 1 of 3 adamw step(s): no gradient to compare")
