"""Tensor parallelism (``from_pretrained(..., tp_plan=...)``) of patched models: the replacements' own plans.

The recipes give the tensor-parallel plan of their modules (:mod:`modelpatch.integrations.tensor_parallel`): a fused
``qkv_proj`` is split so that each rank holds whole heads of each of q, k and v (not a slice of the
concatenation; with grouped-query attention ``qkv_proj`` stays whole and each rank computes its heads' rows), per-expert Linears as Transformers splits the fused experts. A ``torchrun --standalone
--nproc_per_node 2`` launch of tests/tp_dist_worker.py (CPU, gloo) loads tiny qwen2_moe checkpoints with the
linear-experts recipe and with the full example (fused QKV + linear experts), and a tiny llama (grouped-query attention) with
the fused-QKV recipe; the test compares with the same load in this process: logits, the gathered weights, greedy
generation, ``save_pretrained`` (the checkpoint's keys and values) and one SGD step. Loads that cannot be split
exactly are refused before anything is sharded: heads that do not divide by the number of ranks, and a user
``tp_plan`` entry for a module a recipe removed or splitting a replacement otherwise than its plan.

Measured 2026-12-05 (Transformers 5.23, torch 2.13, 2 CPU processes): logits max abs diff against one process
1.8e-07 (linear experts), 1.5e-07 (full example), 1.2e-07 (fused QKV, grouped-query); gathered weights and saved
tensors 0.0; after one SGD step (lr 0.1, weights moved by up to 0.06) weights 6.0e-08 and logits 2.5e-07; 2
momentum steps with idle experts 0.0. The launch takes about 30 s on 2 shared cores (the test about 40 s); the
same passes with Transformers 5.24 and 5.25 (where experts are not tensor-parallel: replicated, as the original).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import modelpatch
import tp_dist_worker as worker
from helpers import tiny_llama_config, tiny_qwen2_moe_config
from modelpatch.integrations.tensor_parallel import (
    PACKED_QKV_COLWISE,
    QKV_HEADS,
    TensorParallelError,
    adapt_tensor_parallel_plan,
)
from modelpatch.recipes import get_recipe

LAUNCH_TIMEOUT = 300  # seconds (measured about 30 s)
LOGITS_BOUND = 1e-5
TRAINED_BOUND = 1e-5


def torchrun(script: Path, *args: str, env: dict | None = None) -> str:
    """Run ``script`` on 2 CPU processes (``torchrun --standalone``, gloo) with the modelpatch this process
    imported; returns what went wrong (empty when nothing did)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(modelpatch.__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [*command, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return f"torchrun killed after {LAUNCH_TIMEOUT} s:\n{stderr.decode()[-5000:]}"
    if proc.returncode != 0:
        return f"torchrun exit code {proc.returncode}:\n{stdout.decode()[-2000:]}{stderr.decode()[-6000:]}"
    return ""


def _max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


@pytest.mark.slow
def test_tensor_parallel_loads_generates_saves_and_trains_like_one_process(tmp_path):
    """One launch (see the module docstring); the reference is the same work in this process."""
    from safetensors.torch import load_file

    paths = worker.make_checkpoints(tmp_path / "checkpoints")
    (tmp_path / "checkpoints.json").write_text(json.dumps(paths))
    failed = torchrun(Path(__file__).with_name("tp_dist_worker.py"), str(tmp_path / "checkpoints.json"), str(tmp_path))
    assert not failed, failed
    results = torch.load(tmp_path / "tp.pt", weights_only=False)

    for name, (checkpoint, recipe) in worker.LOADS.items():
        got = results[name]
        model = worker.load(paths[checkpoint], recipe)
        with torch.no_grad():
            logits = model(worker.IDS).logits
        assert (got["logits"] - logits).abs().max().item() <= LOGITS_BOUND, name
        assert _max_diff(got["state"], model.state_dict()) == 0.0, name  # the gathered layout is the model's
        assert torch.equal(got["generated"], model.generate(worker.IDS, max_new_tokens=4, do_sample=False)), name
        # the checkpoint layout, exactly: Transformers gathers, modelpatch converts back
        original = load_file(os.path.join(paths[checkpoint], "model.safetensors"))
        saved = load_file(tmp_path / f"saved-{name}" / "model.safetensors")
        assert _max_diff(saved, original) == 0.0, name
        # o_proj's columns (half of the heads) on each rank
        assert got["local"]["model.layers.0.self_attn.o_proj.weight"] == (64, 32), (name, got["local"])
        if name in worker.TRAINED:  # one SGD step, the same on 1 and 2 processes
            worker.sgd_step(model)
            with torch.no_grad():
                logits = model(worker.IDS).logits
            assert _max_diff(got["trained"], model.state_dict()) <= TRAINED_BOUND, name
            assert (got["trained_logits"] - logits).abs().max().item() <= LOGITS_BOUND, name

    # experts no token reached get zero gradients (DTensors under tensor parallelism): momentum moves them alike
    model = worker.load(paths[worker.LOADS["experts"][0]], worker.LOADS["experts"][1])
    worker.idle_steps(model)
    assert _max_diff(results["idle"], model.state_dict()) <= TRAINED_BOUND

    # each rank holds half of every expert's rows (gate, up) and columns (down), where Transformers' plan splits the
    # fused experts (5.23, 5.24); 5.25 shards experts only under expert parallelism: replicated, as the original
    from transformers import Qwen2MoeConfig

    split_experts = any(".experts" in key for key in Qwen2MoeConfig.base_model_tp_plan)
    for name in ("experts", "full"):
        local = results[name]["local"]
        if split_experts:
            assert local["model.layers.0.mlp.experts.0.gate_proj.weight"] == (16, 64), local
            assert local["model.layers.0.mlp.experts.0.down_proj.weight"] == (64, 16), local
        else:
            assert not [key for key in local if ".experts." in key], local
    # fused QKV, multi-head: half of the heads of each of q, k and v on each rank (96 of 192 rows); grouped-query:
    # qkv_proj whole on each rank (no placement splits q and k/v of different sizes), each computing its heads' rows
    assert results["full"]["local"]["model.layers.0.self_attn.qkv_proj.weight"] == (96, 64)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in results["gqa"]["local"]

    refused = results["refused"]
    assert refused["heads"].startswith("TensorParallelError: from_pretrained(tp_plan='auto', tp_size=2): "), refused
    assert "layers.0.self_attn (FusedQKVLlamaAttention replacing LlamaAttention)" in refused["heads"], refused
    assert "4 query heads and 1 key/value heads do not split over tp_size=2 ranks" in refused["heads"], refused
    removed = refused["removed"]
    assert removed.startswith("TensorParallelError: from_pretrained(tp_plan=...) entry "), removed
    assert "'model.layers.*.self_attn.q_proj'" in removed and "(a recipe removed it)" in removed, removed
    assert "model.layers.0.self_attn (FusedQKVQwen2MoeAttention replacing Qwen2MoeAttention)" in removed, removed
    for case in ("split", "split_config"):
        split = refused[case]
        assert split.startswith("TensorParallelError: from_pretrained(tp_plan=...) entry "), split
        assert "'model.layers.*.self_attn.qkv_proj': 'colwise'" in split, split
        assert f"splits it as '{PACKED_QKV_COLWISE}'" in split, split


def _built(config, recipe: str):
    from transformers import AutoModelForCausalLM

    with get_recipe(recipe).apply():
        return AutoModelForCausalLM.from_config(config)


REQUEST = {"plan": "auto", "tp_size": 2, "tp": True, "ep": False}


def test_plan_names_the_replacements_modules():
    """The model's plan (``model.tp_plan``) names the fused ``qkv_proj`` and the per-expert Linears, not the
    modules the recipe removed; without a tensor-parallel load nothing is refused."""
    model = _built(tiny_qwen2_moe_config(), "qwen2_moe-full-example")
    plan = model.tp_plan
    assert plan["model.layers.*.self_attn.qkv_proj"] == PACKED_QKV_COLWISE
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    if any(".experts" in key for key in type(model.config).base_model_tp_plan):  # 5.25: experts under EP only
        assert plan["model.layers.*.mlp.experts"] == "moe_tp_experts"
        assert plan["model.layers.*.mlp.experts.*.gate_proj.weight"] == "colwise"
        assert plan["model.layers.*.mlp.experts.*.down_proj.weight"] == "rowwise"
    else:
        assert not [key for key in plan if ".experts" in key], plan
    assert not [k for k in plan if k.endswith((".q_proj", ".k_proj", ".v_proj", ".experts.gate_up_proj"))], plan
    gqa = _built(tiny_llama_config(), "llama-fused-qkv")  # grouped-query: qkv_proj whole, each rank its heads' rows
    assert (
        gqa.tp_plan["model.layers.*.self_attn"] == QKV_HEADS and "model.layers.*.self_attn.qkv_proj" not in gqa.tp_plan
    )
    mqa = _built(tiny_llama_config(num_key_value_heads=1), "llama-fused-qkv")  # refused only under TP
    with pytest.raises(TensorParallelError, match=r"tp_size=2\): model\.layers\.0\.self_attn \(FusedQKVLlama"):
        adapt_tensor_parallel_plan(mqa, REQUEST)


def test_replacement_without_a_plan_is_refused_under_tensor_parallelism():
    """A user replacement of a module Transformers shards, without ``modelpatch_tp_plan``: refused, naming it."""
    import torch.nn as nn
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP

    class PlainMLP(LlamaMLP):
        pass

    with modelpatch.apply_patches({"LlamaMLP": PlainMLP}):
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    assert isinstance(model.model.layers[0].mlp, PlainMLP) and isinstance(model.model.layers[0].mlp, nn.Module)
    assert model.tp_plan["model.layers.*.mlp.gate_proj"] == "colwise"  # untouched: refused only under TP
    with pytest.raises(TensorParallelError, match=r"model\.layers\.0\.mlp \(PlainMLP replacing LlamaMLP\), planned"):
        adapt_tensor_parallel_plan(model, REQUEST)


def test_biased_experts_give_no_plan():
    """Per-expert Linears with biases (gpt-oss): a row-split ``down`` bias would be added once per rank, so their
    plan is refused (Transformers 5.23-5.25 does not shard gpt-oss's experts either: the model loads replicated)."""
    from transformers import GptOssConfig

    from helpers import TINY

    config = GptOssConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    model = _built(config, "gpt_oss-linear-experts")
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(TensorParallelError, match="its experts have biases"):
        experts.modelpatch_tp_plan(2)
    assert not [key for key in model.tp_plan if ".experts" in key], model.tp_plan
