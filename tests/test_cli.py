"""The ``modelpatch`` command line: verify (built-in full example, real MiniLM checkpoint, a failing patch),
explain (meta dry run, conflicts), convert (forward + reverse bit-exact), one-line errors, the console script."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

from helpers import one_line_error, save_tiny, tiny_llama_config
from modelpatch.cli import main
from modelpatch.cli.checkpoint import example_checkpoint
from recipes_support import MINILM_DIR, save_case, tensors

FUSED_QWEN2_MOE = "modelpatch.recipes.fused_qkv.decoder.FusedQKVQwen2MoeAttention"
LINEAR_QWEN2_MOE = "modelpatch.recipes.linear_experts.layer.LinearQwen2MoeExperts"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("modelpatch-cache")
    old = os.environ.get("MODELPATCH_CACHE")
    os.environ["MODELPATCH_CACHE"] = str(path)
    yield path
    if old is None:
        del os.environ["MODELPATCH_CACHE"]
    else:
        os.environ["MODELPATCH_CACHE"] = old


def run_json(capsys, argv) -> tuple[int, dict]:
    capsys.readouterr()  # what the test's setup printed (DeepSpeed logs to stdout when a save first imports it)
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_verify_without_arguments_runs_the_full_example(cache, capsys):
    code, report = run_json(capsys, [])
    assert code == 0 and report["ok"] is True, report["checks"]
    assert report["recipe"] == "qwen2_moe-full-example" and report["model_class"] == "Qwen2MoeForCausalLM"
    assert report["model_dir"] == str(cache / "qwen2_moe-tiny-v1")
    replaced = {(r["path"], r["replacement"]) for r in report["patch_report"]["replaced"]}
    assert replaced == {
        (f"model.layers.{i}.{m}", cls)
        for i in (0, 1)
        for m, cls in (("self_attn", FUSED_QWEN2_MOE), ("mlp.experts", LINEAR_QWEN2_MOE))
    }
    loads = [r for r in report["conversion_report"] if r["direction"] == "load"]
    assert sorted(r["target_keys"][0] for r in loads) == sorted(
        f"model.layers.{i}.self_attn.qkv_proj.{p}" for i in (0, 1) for p in ("weight", "bias")
    )
    assert all(p["status"] == "checkpoint" for p in report["provenance"]) and len(report["provenance"]) == 47
    stored = set(tensors(cache / "qwen2_moe-tiny-v1"))  # provenance names keys as stored in the file
    assert {k for p in report["provenance"] for k in p["checkpoint_keys"]} == stored
    assert report["output"]["kind"] == "logits" and report["output"]["max_abs_diff"] <= 1e-5
    assert report["round_trip"] == {"bit_exact": True, "first_difference": None}
    assert [c["name"] for c in report["checks"]] == [
        "patches", "loading", "provenance", "outputs", "padding", "cache (dynamic)", "cache (static)", "generate",
        "routing", "round trip",
    ]  # fmt: skip
    # the paths patches break, against the unpatched model: every figure within float32 noise
    paths = {p["name"]: p for p in report["paths"]}
    assert all(
        p["status"] == "ok" and 0 <= p["figure"] <= 1e-5 and p["first_divergence"] is None for p in paths.values()
    )
    assert paths["routing"]["detail"] == "the same experts for all 20 tokens x 2 MoE layers"
    assert paths["generate"]["detail"] == "4 of 4 greedy tokens equal (2 rows x 2, left-padded, dynamic cache)"
    assert "prefill 12 + 1 decode step(s), left-padded" in paths["cache (static)"]["detail"]
    # the table form passes too, and says so; the README's example output is what it prints (figures aside)
    assert main(["verify", "--no-progress"]) == 0
    printed = capsys.readouterr().out.rstrip()
    assert printed.endswith("PASS")
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "README.md")) as fh:
        readme = fh.read()
    block = readme[readme.index("```\n== checks\n") + 4 :]
    block = block[: block.index("```")].rstrip()

    def shape(text: str) -> str:
        text = re.sub(r"\d+(\.\d+)?(e[-+]\d+)?", "N", text)
        return re.sub(r" +", " ", re.sub(r"-{3,}", "---", text))

    assert shape(printed[printed.index("== checks") :]) == shape(block)


BAD_ROUTER = """
import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

class BadRouter(Qwen2MoeTopKRouter):
    # the top-k taken over the logits plus a bias towards the last expert
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        bias = torch.zeros(self.num_experts)
        bias[-1] = 0.5
        top, idx = torch.topk(torch.softmax(logits + bias, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        return logits, (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), idx

PATCH_MAPPING = {"Qwen2MoeTopKRouter": BadRouter}
"""


def test_a_router_that_picks_other_experts_fails_the_routing_check(cache, tmp_path, capsys):
    patches = tmp_path / "bad_router.py"
    patches.write_text(BAD_ROUTER)
    code, report = run_json(capsys, ["verify", "--patches", str(patches), "--checks", "routing", "--no-progress"])
    assert code == 1
    routing = report["paths"][0]
    assert routing["name"] == "routing" and routing["status"] == "FAIL"
    assert routing["first_divergence"] == {"row": 0, "token": 0, "layer": 0}
    assert 0 < routing["figure"] <= 1  # R3's router disagreement rate over (token, layer) pairs
    count = round(routing["figure"] * 40)
    assert routing["detail"] == (
        f"router disagreement: {count} of 40 token-layers (rate {routing['figure']:.3g}; 20 tokens x 2 MoE layers); "
        "first: row 0, token 0, layer 0: experts [1, 3], unpatched [1, 2]"
    )


TOPK_WITHOUT_TORCH_TOPK = """
import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

class OtherTopKRouter(Qwen2MoeTopKRouter):
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        {choice}
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

PATCH_MAPPING = {{"Qwen2MoeTopKRouter": OtherTopKRouter}}
"""


@pytest.mark.parametrize(
    "choice, status",
    [
        ("top, idx = [t[:, : self.top_k] for t in probs.sort(dim=-1, descending=True)]", "ok"),
        ("top, idx = torch.topk(-probs, self.top_k, dim=-1, largest=False); top = -top", "ok"),
        ("top, idx = [t[:, : self.top_k] for t in probs.sort(dim=-1)]", "FAIL"),  # the k *least* likely experts
    ],
)
def test_a_router_without_torch_topk_is_judged_by_the_experts_it_returns(choice, status, cache, tmp_path, capsys):
    # the record finds no torch.topk in these routers ("saw 0"): a correct one must not fail, a wrong one must
    patches = tmp_path / "other_topk.py"
    patches.write_text(TOPK_WITHOUT_TORCH_TOPK.format(choice=choice))
    code, report = run_json(capsys, ["verify", "--patches", str(patches), "--checks", "routing", "--no-progress"])
    routing = report["paths"][0]
    assert routing["status"] == status and code == (0 if status == "ok" else 1), routing
    assert "expert ids read from the routers' outputs" in routing["detail"]
    if status == "ok":
        assert routing["detail"].startswith("the same experts for all 20 tokens x 2 MoE layers")
    else:
        assert routing["figure"] == 1.0 and routing["first_divergence"] == {"row": 0, "token": 0, "layer": 0}


CHANGED_AFTER_TOPK = """
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

class ChangedRouter(Qwen2MoeTopKRouter):
    def forward(self, hidden_states):
        logits, scores, idx = super().forward(hidden_states)  # one torch.topk: what the routing record sees
        idx, scores = idx.clone(), scores.clone()
        {change}
        return logits, scores, idx

PATCH_MAPPING = {{"Qwen2MoeTopKRouter": ChangedRouter}}
"""


@pytest.mark.parametrize(
    "change, status",
    [
        ("idx[0, 1] = (idx[0, 1] + 1) % 4\n        idx[0, 1] = (idx[0, 1] + (idx[0, 1] == idx[0, 0])) % 4", "FAIL"),
        ("idx[-1] = idx[-1].flip(0); scores[-1] = scores[-1].flip(0)", "ok"),  # the same experts in another order
    ],
)
def test_the_routing_check_compares_the_experts_a_router_returns_not_its_topk(change, status, cache, tmp_path, capsys):
    patches = tmp_path / "changed_router.py"
    patches.write_text(CHANGED_AFTER_TOPK.format(change=change))
    code, report = run_json(capsys, ["verify", "--patches", str(patches), "--checks", "routing", "--no-progress"])
    routing = report["paths"][0]
    assert routing["status"] == status and code == (0 if status == "ok" else 1), routing
    if status == "FAIL":  # one token returns another expert than its torch.topk chose
        assert routing["first_divergence"] == {"row": 0, "token": 0, "layer": 0}
        assert routing["detail"].startswith("router disagreement: 2 of 40 token-layers (rate 0.05; 20 tokens x 2 ")
        assert routing["figure"] == 2 / 40  # token 0 of row 0, in both MoE layers
        assert (
            "(expert ids read from the routers' outputs: a router returns experts other than its torch.topk's)"
            in (routing["detail"])
        )
    else:
        assert routing["detail"] == "the same experts for all 20 tokens x 2 MoE layers"


def test_example_checkpoint_is_deterministic(cache, tmp_path, monkeypatch):
    first = example_checkpoint()
    monkeypatch.setenv("MODELPATCH_CACHE", str(tmp_path))
    second = example_checkpoint()
    assert second != first

    def digest(folder):
        return hashlib.sha256(open(os.path.join(folder, "model.safetensors"), "rb").read()).hexdigest()

    assert digest(first) == digest(second)
    ck = tensors(second)
    assert ck["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # GQA: 2 of 4 heads
    assert not torch.equal(
        ck["model.layers.0.mlp.experts.0.gate_proj.weight"], ck["model.layers.0.mlp.experts.1.gate_proj.weight"]
    )


def test_verify_real_minilm_checkpoint(capsys):
    code, report = run_json(capsys, ["verify", "--model", MINILM_DIR, "--recipe", "bert-fused-qkv"])
    assert code == 0 and report["ok"] is True
    assert report["output"]["kind"] == "mean-pooled embeddings" and report["output"]["max_abs_diff"] <= 1e-5
    assert report["input"].endswith("tokenizer")
    assert len(report["patch_report"]["replaced"]) == 6
    assert report["round_trip"]["bit_exact"] is True
    assert {p["status"] for p in report["provenance"]} == {"checkpoint"}
    # an encoder: the padded batch is compared (last hidden states), the decoding paths are skipped, never passed
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["padding"]["status"] == "ok" and checks["padding"]["detail"].startswith(
        "max abs diff of last hidden states at 25 non-pad positions"
    )
    no_head = "BertModel has no generation head (can_generate() is False)"
    for name in ("cache (dynamic)", "cache (static)", "generate"):
        assert checks[name] == {"name": name, "ok": None, "status": "skipped", "detail": no_head}
    assert checks["routing"]["status"] == "skipped" and checks["routing"]["detail"] == "BertModel has no MoE router"


def test_verify_decoder_bert_decodes_like_the_original(tmp_path, capsys):
    """A decoder BERT (BertLMHeadModel) with the fused-QKV recipe: its cache is written and read as the original's.
    (On Transformers 5.24, which passes the cache as ``cache``, the recipe wrote none: "prefill: layer 0 keys not
    cached", 1 of 4 generated tokens different.)"""
    config = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=128,
        is_decoder=True, architectures=["BertLMHeadModel"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertLMHeadModel(config).save_pretrained(tmp_path / "ck")
    argv = ["verify", "--model", str(tmp_path / "ck"), "--recipe", "bert-fused-qkv", "--checks", "cache,generate"]
    code, report = run_json(capsys, [*argv, "--no-progress"])
    assert code == 0, report["checks"]
    paths = {p["name"]: p for p in report["paths"]}
    assert [paths[n]["status"] for n in ("cache (dynamic)", "cache (static)", "generate")] == ["ok"] * 3
    assert paths["cache (dynamic)"]["figure"] <= 1e-5


def test_verify_fails_for_a_patch_without_conversion_rules(tmp_path, capsys):
    """A fused QKV attention without its rule: qkv_proj is never loaded; verify says which, exits 1."""
    path = save_case("llama-fused-qkv", tmp_path / "ck")
    patches = tmp_path / "patches.py"
    patches.write_text(
        "from modelpatch.recipes import FUSED_QKV_CLASSES\n"
        "PATCH_MAPPING = {'LlamaAttention': FUSED_QKV_CLASSES['llama']}\n"
    )
    code, report = run_json(capsys, ["verify", "--model", path, "--patches", str(patches), "--checks", "none"])
    assert code == 1 and report["ok"] is False
    checks = {c["name"]: c["ok"] for c in report["checks"]}
    assert checks == {"patches": True, "loading": False, "provenance": False, "outputs": False, "round trip": False}
    assert "model.layers.0.self_attn.qkv_proj.weight" in report["loading"]["missing_keys"]
    bad = {p["parameter"] for p in report["provenance"] if p["status"] != "checkpoint"}
    assert bad == {f"model.layers.{i}.self_attn.qkv_proj.{p}" for i in (0, 1) for p in ("weight", "bias")}


def test_verify_patches_file_with_rules(tmp_path, capsys):
    path = save_case("mixtral-linear-experts", tmp_path / "ck")
    patches = tmp_path / "patches.py"
    patches.write_text(
        "from modelpatch.conversion import WeightRenaming\n"
        "from modelpatch.recipes import LINEAR_EXPERTS_CLASSES\n"
        "PATCH_MAPPING = {'MixtralExperts': LINEAR_EXPERTS_CLASSES['mixtral']}\n"
        "CONVERSION_RULES = {'mixtral': [WeightRenaming('block_sparse_moe', 'mlp')]}\n"
        "CONVERSION_OVERWRITE = True\n"
    )
    code, report = run_json(capsys, ["verify", "--model", path, "--patches", str(patches)])
    assert code == 0, report["checks"]
    assert report["rules_that_matched_nothing"] == []
    assert report["output"]["max_abs_diff"] <= 1e-5


def test_recipes_lists_no_recipe_the_support_table_measured_inexact(capsys):
    from linear_experts_support import parse, readme_table

    assert main(["recipes"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()}
    rows = parse(readme_table())[transformers.__version__]
    assert (
        sorted(f"{mt}-linear-experts" for mt, (ok, _, _) in rows.items() if not ok and f"{mt}-linear-experts" in listed)
        == []
    )
    assert {f"{mt}-linear-experts" for mt, (ok, _, _) in rows.items() if ok} <= listed


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["verify", "--model", "/no/such/dir", "--recipe", "bert-fused-qkv"],
            "model folder '/no/such/dir' does not exist",
        ),
        (
            ["verify", "--model", os.path.dirname(__file__), "--recipe", "bert-fused-qkv"],
            "is not a checkpoint: no config.json",
        ),
        (["verify", "--model", MINILM_DIR, "--recipe", "nope"], "unknown recipe 'nope'; known: bert-fused-qkv"),
        (["verify", "--model", "/no/such/folder"], "model folder '/no/such/folder' does not exist"),
        (["explain", "--model-type", "bert", "--patches", "{raising}"], "raised RuntimeError: boom"),
        (
            ["explain", "--model-type", "bert", "--patches", "no_such_module_xyz"],
            "patches module 'no_such_module_xyz' not found",
        ),
        (
            ["explain", "--model-type", "no_such_type", "--recipe", "bert-fused-qkv"],
            "unknown model type 'no_such_type'",
        ),
        # a misspelled model type gets the closest known ones, in every subcommand taking --model-type
        (
            ["explain", "--model-type", "lama", "--recipe", "llama-fused-qkv"],
            "unknown model type 'lama': did you mean 'llama' or 'mllama' or 'llama4'?",
        ),
        (
            ["convert", MINILM_DIR, "{out}", "--model-type", "lama", "--recipe", "bert-fused-qkv"],
            "unknown model type 'lama': did you mean 'llama' or 'mllama' or 'llama4'?",
        ),
        (["explain", "--model-type", "bert", "--patches", "{invalid}"], "invalid patches: "),
        (
            ["explain", "--model-type", "laguna", "--recipe", "laguna-linear-experts"],
            "no linear-experts recipe for 'laguna' on this Transformers release: measured on Transformers ",
        ),
        (["verify", "--model", MINILM_DIR, "--patches", "{empty}"], "defines no PATCH_MAPPING dict (or RECIPE)"),
    ],
)
def test_one_line_errors(argv, message, tmp_path, capsys):
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('boom')\n")
    invalid, empty = tmp_path / "invalid.py", tmp_path / "empty.py"
    invalid.write_text("PATCH_MAPPING = {'BertSelfAttention': 42}\n")  # not an nn.Module subclass
    empty.write_text("X = 1\n")
    files = {"{raising}": raising, "{invalid}": invalid, "{empty}": empty, "{out}": tmp_path / "out"}
    argv = [str(files.get(a, a)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("modelpatch: error: ") and message in err
    assert "Traceback" not in err


def test_patches_module_in_the_current_directory(tmp_path, monkeypatch, capsys):
    """A console script has no current directory on sys.path; --patches my_module must still find ./my_module.py."""
    (tmp_path / "my_patches_module.py").write_text(
        "from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention\n"
        "PATCH_MAPPING = {'LlamaAttention': FusedQKVLlamaAttention}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["explain", "--model-type", "llama", "--patches", "my_patches_module"]) == 0
    assert "FusedQKVLlamaAttention" in capsys.readouterr().out
    assert str(tmp_path) not in sys.path


@pytest.mark.parametrize("atol", ["-1", "nan", "inf"])
def test_atol_must_be_finite_and_non_negative(atol, capsys):
    assert main(["verify", "--atol", atol]) == 2
    assert "must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checks", "padding,kv"], "--checks: unknown check(s) kv; choose from padding, cache, generate, routing"),
        (["--new-tokens", "0"], "--new-tokens: must be an integer >= 1, got '0'"),
        (["--checks", "none,padding"], "--checks: 'none' runs no check and goes alone, got 'none,padding'"),
    ],
)
def test_check_options_are_validated_before_any_load(argv, message, capsys):
    assert main(["verify", *argv]) == 2
    assert message in capsys.readouterr().err


def test_not_a_checkpoint_without_weights(tmp_path, capsys):
    shutil.copy(os.path.join(MINILM_DIR, "config.json"), tmp_path)
    assert main(["verify", "--model", str(tmp_path), "--recipe", "bert-fused-qkv"]) == 2
    assert "is not a checkpoint: no model.safetensors" in capsys.readouterr().err


def test_explain_reads_no_weights_and_reports(tmp_path, capsys):
    # a folder with only config.json: explain needs no weights at all
    shutil.copy(os.path.join(MINILM_DIR, "config.json"), tmp_path)
    code, report = run_json(capsys, ["explain", "--model", str(tmp_path), "--recipe", "bert-fused-qkv"])
    assert code == 0
    assert report["replaced"] == {"BertSelfAttention": {"BertSelfAttention -> FusedQKVBertSelfAttention": 6}}
    assert report["unmatched_keys"] == [] and report["conflicts"] == []
    assert report["conversion_rules"][0]["checkpoint_keys"] is None
    # with the real folder, the rule's matches come from the safetensors header
    code, report = run_json(capsys, ["explain", "--model", MINILM_DIR, "--recipe", "bert-fused-qkv"])
    assert code == 0 and report["problems"] == {"patches": [], "loading": []}
    assert len(report["conversion_rules"][0]["checkpoint_keys"]) == 36  # 6 layers x q/k/v x weight/bias
    assert report["conversion_rules"][0]["registered_as"] == "bert"


def test_explain_reports_container_conflict_and_unmatched_key(tmp_path, capsys):
    patches = tmp_path / "broad.py"
    patches.write_text(
        "from modelpatch.recipes import FusedQKVBertSelfAttention\n"
        "PATCH_MAPPING = {'.*Attention': FusedQKVBertSelfAttention, 'BertAtention': FusedQKVBertSelfAttention}\n"
    )
    code, report = run_json(capsys, ["explain", "--model-type", "bert", "--patches", str(patches)])
    assert code == 1
    assert report["replaced"][".*Attention"] == {"BertAttention -> FusedQKVBertSelfAttention": 12}
    assert report["unmatched_keys"] == ["BertAtention"]
    assert report["problems"]["patches"] == [
        f"keys that replaced nothing: ['BertAtention']; 'BertAtention': no module class of Transformers "
        f"{transformers.__version__} is named so; did you mean 'BertAttention'?",
        "2 container/inner conflict(s)",
    ]
    assert len(report["conflicts"]) == 2
    assert all("container BertAttention" in c for c in report["conflicts"])
    assert any("BertSelfAttention" in c for c in report["conflicts"])


@pytest.mark.parametrize("command", ["explain", "verify"])
def test_a_key_far_from_any_class_is_named_with_the_closest_classes(command, tmp_path, capsys):
    # 'LlamaAttn' and 'FooBar' are far from any class: the CLI said only "replaced nothing", with no "did you mean"
    patches = tmp_path / "far.py"
    patches.write_text(
        "from transformers.models.llama.modeling_llama import LlamaMLP\n"
        "class MyMLP(LlamaMLP):\n    pass\n"
        "PATCH_MAPPING = {'LlamaAttn': MyMLP, 'FooBar': MyMLP, 'LlamaMLP': MyMLP}\n"
    )
    where = ["--model-type", "llama"] if command == "explain" else ["--model", str(tmp_path / "llama")]
    if command == "verify":
        from transformers import LlamaForCausalLM

        from helpers import save_tiny, tiny_llama_config

        save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path / "llama")
        where += ["--checks", "padding", "--no-progress"]
    code, report = run_json(capsys, [command, *where, "--patches", str(patches)])
    words = (
        f"keys that replaced nothing: ['LlamaAttn', 'FooBar']; 'LlamaAttn': no module class of Transformers "
        f"{transformers.__version__} is named so; did you mean 'LlamaAttention'?; 'FooBar': no module class of "
        f"Transformers {transformers.__version__} is named so"
    )
    assert code == 1
    if command == "explain":
        assert report["problems"]["patches"] == [words]
    else:
        check = next(c for c in report["checks"] if c["name"] == "patches")
        assert check["detail"] == f"2 module(s) replaced; {words}" and check["ok"] is False


def test_convert_forward_then_reverse_is_bit_exact(tmp_path, capsys):
    src = save_case("qwen2_moe-fused-qkv", tmp_path / "ck")
    fused, back = tmp_path / "fused", tmp_path / "back"
    assert main(["convert", src, str(fused), "--recipe", "qwen2_moe-full-example"]) == 0
    ck, converted = tensors(src), tensors(fused)
    qkv = converted["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([ck[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert qkv.shape == (64 + 2 * 32, 64)  # GQA sizes
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in converted  # per-expert kept (overwrite)
    assert main(["convert", str(fused), str(back), "--recipe", "qwen2_moe-full-example", "--reverse"]) == 0
    restored = tensors(back)
    assert sorted(restored) == sorted(ck) and all(torch.equal(restored[k], ck[k]) for k in ck)
    assert "4 group(s)" in capsys.readouterr().out


def test_convert_errors_are_one_line(tmp_path, capsys):
    src = save_case("llama-fused-qkv", tmp_path / "ck")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated file
    capsys.readouterr()
    cases = [
        ([src, str(tmp_path / "ck" / "config.json" / "out"), "--recipe", "llama-fused-qkv"], "cannot convert"),
        ([str(broken), str(tmp_path / "out2"), "--recipe", "llama-fused-qkv"], "SafetensorError"),
        ([src, str(tmp_path / "out3"), "--recipe", "llama-fused-qkv", "--reverse"], "matches a key of"),
    ]
    for argv, message in cases:
        assert main(["convert", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.slow
def test_console_script(cache):
    """The installed ``modelpatch`` entry point, in a fresh process, on the real checkpoint."""
    script = shutil.which("modelpatch", path=os.path.dirname(sys.executable))
    assert script is not None, "pip install -e . installs the console script"
    done = subprocess.run(
        [script, "verify", "--model", MINILM_DIR, "--recipe", "bert-fused-qkv", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["output"]["max_abs_diff"] <= 1e-5 and report["round_trip"]["bit_exact"]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["verify", "explain"])
def test_invalid_config_json_is_a_one_line_error(command, tmp_path, capsys):
    # found by a fresh-user test: transformers' OSError escaped as a traceback with exit status 1
    for name in os.listdir(MINILM_DIR):
        if name.endswith(".safetensors"):
            shutil.copy(os.path.join(MINILM_DIR, name), tmp_path)
    (tmp_path / "config.json").write_text("{ not json")
    assert main([command, "--model", str(tmp_path), "--recipe", "bert-fused-qkv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err and "config.json" in err


@pytest.mark.parametrize("command", ["convert", "verify", "explain", "routing-check"])
def test_a_recipe_of_another_family_is_one_line_in_every_subcommand(command, tmp_path, capsys):
    """``convert --recipe mixtral-linear-experts`` on a qwen2_moe checkpoint exited 0 having applied Transformers'
    own rules, and ``verify`` said FAIL: every subcommand exits 2 with one line naming both model types, having
    written nothing."""
    src = save_case("qwen2_moe-linear-experts", tmp_path / "ck")
    out = tmp_path / "out"
    argv = {
        "convert": ["convert", src, str(out)],
        "verify": ["verify", "--model", src],
        "explain": ["explain", "--model", src],
        "routing-check": ["routing-check", "--model", src, "--routes", str(tmp_path / "none.npy")],
    }[command]
    capsys.readouterr()
    assert main([*argv, "--recipe", "mixtral-linear-experts"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "recipe mixtral-linear-experts is for model type(s) mixtral" in err and "qwen2_moe" in err, err
    assert not out.exists()


def test_json_stdout_holds_the_report_alone(tmp_path, capsys):
    """What libraries print while a command runs goes to stderr, so ``--json`` parses: a print at import of the
    patches file, and a logging handler bound to stdout before the command (as DeepSpeed's is when Transformers
    imports it), which is pointed back at stdout afterwards."""
    import logging

    noisy = logging.getLogger("modelpatch-test-noisy-library")
    handler = logging.StreamHandler(sys.stdout)
    noisy.addHandler(handler)
    patches = tmp_path / "patches.py"
    patches.write_text(
        "import logging\n"
        "from modelpatch.recipes import FUSED_QKV_CLASSES\n"
        "print('printed by the patches file')\n"
        "logging.getLogger('modelpatch-test-noisy-library').warning('logged to stdout')\n"
        "PATCH_MAPPING = {'LlamaAttention': FUSED_QKV_CLASSES['llama']}\n"
    )
    try:
        capsys.readouterr()
        code = main(["explain", "--model-type", "llama", "--patches", str(patches), "--json"])
        out, err = capsys.readouterr()
        assert json.loads(out)["replaced"]["LlamaAttention"], out
        assert "printed by the patches file" in err and "logged to stdout" in err
        assert handler.stream is sys.stdout and code == 0
    finally:
        noisy.removeHandler(handler)


def test_verify_json_is_strict_json_when_the_outputs_are_nan(tmp_path, capsys):
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path / "ck")
    (tmp_path / "nan.py").write_text(
        "from transformers.models.llama.modeling_llama import LlamaAttention\n"
        "from modelpatch import register_patch_mapping\n"
        "class NanAttention(LlamaAttention):\n"
        "    def forward(self, *a, **k):\n"
        "        out, w = super().forward(*a, **k)\n"
        "        return out * float('nan'), w\n"
        "register_patch_mapping({'LlamaAttention': NanAttention})\n"
    )
    capsys.readouterr()
    status = main(["verify", "--model", str(tmp_path / "ck"), "--patches", str(tmp_path / "nan.py"), "--json"])
    out = capsys.readouterr().out
    assert status == 1
    document = json.loads(out, parse_constant=lambda token: pytest.fail(f"non-standard JSON token {token}"))
    assert "NaN" in json.dumps(document)
    # a NaN is reported as nan by every check that measures a difference (padding and cache said inf)
    assert document["output"]["max_abs_diff"] == "NaN"
    figures = {p["name"]: p["figure"] for p in document["paths"]}
    assert figures["padding"] == figures["cache (dynamic)"] == figures["cache (static)"] == "NaN", figures
    details = {c["name"]: c["detail"] for c in document["checks"]}
    assert "max abs diff of logits nan" in details["outputs"] and " nan (atol" in details["padding"]
    assert details["cache (dynamic)"].startswith("prefill: layer 1 keys differ by nan; first: row 0, token 0")


def test_convert_names_the_real_reason_when_nothing_is_converted(tmp_path, capsys):
    """A second ``convert`` into the same folder said the source was "already in the converted layout" (it is in
    the original layout) and pointed to a ``--reverse`` that fails; a recipe with nothing to convert for the
    checkpoint got the same dead end. Each case now has its own one line, and nothing is written."""
    src = save_case("qwen2_moe-fused-qkv", tmp_path / "ck")  # per-expert experts: the layout linear experts load
    out = tmp_path / "out"
    assert main(["convert", src, str(out), "--recipe", "qwen2_moe-full-example"]) == 0
    written = sorted(os.listdir(out))
    capsys.readouterr()
    err = one_line_error(capsys, ["convert", src, str(out), "--recipe", "qwen2_moe-full-example"])
    assert err == (
        f"modelpatch: error: convert_checkpoint: destination '{out}' exists and is not empty (stale shards of an "
        "earlier run would mix with the new ones); remove it or choose another"
    )
    assert sorted(os.listdir(out)) == written
    fresh = tmp_path / "fresh"
    err = one_line_error(capsys, ["convert", src, str(fresh), "--recipe", "qwen2_moe-linear-experts"])
    assert err == (
        f"modelpatch: error: no rule of qwen2_moe-linear-experts changes a key of '{src}': its keys already are the "
        "layout the recipe loads, so there is nothing to convert (load it as it is, e.g. `modelpatch verify --model "
        f"{src} --recipe qwen2_moe-linear-experts`); nothing was written"
    )
    err = one_line_error(capsys, ["convert", src, str(fresh), "--recipe", "qwen2_moe-linear-experts", "--reverse"])
    assert err.startswith(
        f"modelpatch: error: no rule of qwen2_moe-linear-experts matches a key of '{src}' in reverse: it is not in "
        "the layout qwen2_moe-linear-experts converts to"
    )
    assert not fresh.exists()
    # the converted folder itself: already converted, and the reverse it names works
    err = one_line_error(capsys, ["convert", str(out), str(fresh), "--recipe", "qwen2_moe-full-example"])
    assert f"'{out}' is already in the converted layout of qwen2_moe-full-example" in err and "--reverse" in err
    assert main(["convert", str(out), str(fresh), "--recipe", "qwen2_moe-full-example", "--reverse"]) == 0
    original, back = tensors(src), tensors(fresh)
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)


EXTRA_PARAMETER = """
import torch
import torch.nn as nn
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention

class ScaledAttention(Qwen2MoeAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.out_scale = nn.Parameter(torch.ones(1))  # no checkpoint key: its initial value

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * self.out_scale, weights

PATCH_MAPPING = {"Qwen2MoeAttention": ScaledAttention}
"""


def test_provenance_names_a_parameter_the_checkpoint_lacks_beside_built_in_conversions(tmp_path, capsys):
    """qwen2_moe loads its experts through Transformers' built-in conversions; a replacement's extra parameter,
    which from_pretrained reports missing, was counted with them ("ok, all 37 parameters from the checkpoint")."""
    src = save_case("qwen2_moe-linear-experts", tmp_path / "ck")
    patches = tmp_path / "extra_parameter.py"
    patches.write_text(EXTRA_PARAMETER)
    code = main(["verify", "--model", src, "--patches", str(patches), "--checks", "none", "--json", "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    rows = {row["parameter"]: row for row in report["provenance"]}
    for layer in (0, 1):
        row = rows[f"model.layers.{layer}.self_attn.out_scale"]
        assert row["status"] == "not in checkpoint" and row["checkpoint_keys"] == [], row
    others = [r for name, r in rows.items() if not name.endswith("out_scale")]
    assert others and all(r["status"] in ("checkpoint", "checkpoint (built-in conversion)", "tied") for r in others)
    assert any(r["status"] == "checkpoint (built-in conversion)" for r in others)  # the case that hid it
    check = next(c for c in report["checks"] if c["name"] == "provenance")
    assert check["ok"] is False and f"{len(others)} of {len(rows)} parameters" in check["detail"], check
