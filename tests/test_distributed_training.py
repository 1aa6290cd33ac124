"""Patched models train under torch.distributed exactly as one process does (2 CPU processes, gloo).

* ``DistributedDataParallel(find_unused_parameters=False)`` and FSDP2 (``fully_shard`` on every per-expert module,
  every decoder layer and the root), on ``qwen2_moe-linear-experts`` and ``llama-fused-qkv``: each rank trains on
  its half of a global batch (one sequence of 3 tokens: 6 top-2 slots over 4 experts, so a rank leaves experts
  idle that the other rank routes tokens to), 3 steps of SGD (momentum, weight decay) and AdamW (weight decay);
  the final weights in the checkpoint layout (``modelpatch.iter_original_state_dict``, gathered from the shards
  under FSDP2) equal those of the unpatched model trained in one process on the whole batch (the language-model
  loss is a mean over tokens, and each rank holds as many tokens, so the mean of the ranks' gradients is the
  whole batch's). The unpatched model under the same wrapper is checked too: it is the noise floor.
* Routing replay under both wrappers: the routing each rank records equals what one process records on the whole
  batch, a replay gives the recorded outputs, the experts are called with the recorded indices, and replayed SGD
  steps with perturbed routers equal one process replaying the whole batch's trace.
* ``transformers.Trainer`` under ``accelerate launch`` (2 real processes; ``TrainingArguments(use_cpu=True)``, so
  accelerate's multi-CPU mode with gloo): a patched qwen2_moe (fused QKV + per-expert linear experts) trains
  4 steps with checkpoints every 2 steps; a new model and a new Trainer resume from ``checkpoint-2`` and end with
  the same weights, bit for bit.

The workers are tests/train_dist_worker.py (forkserver processes) and tests/trainer_dist_worker.py (``accelerate
launch``); every process is killed after its timeout, so a collective that hangs fails the test instead of the
run.

Bounds (measured 2026-12-03 on 2 CPU processes; lr: tests/training_parity.py, SGD 0.05, AdamW 1e-3):

* the patched model against the unpatched model under the same wrapper (the same reductions of the same
  gradients): SGD 1e-6 (measured max 1.2e-07), AdamW ``0.05 * lr`` (measured 2.2e-06);
* a wrapper against one process on the whole batch: the mean of the two halves' gradients is summed in another
  order than the whole batch's, which momentum carries on: SGD 5e-6 (measured max 1.46e-06, the unpatched model's
  own), AdamW ``0.05 * lr`` (measured 7.9e-06).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
from filelock import FileLock

import helpers
import train_dist_worker as worker
import training_parity as tp

SGD_BOUND = 1e-6  # the parity suite's (tests/test_training_parity.py)
WRAPPER_SGD_BOUND = 5e-6
ADAM_BOUND = 0.05  # times the learning rate
WORKER_TIMEOUT = 180  # seconds for all scenarios of both workers together (measured 25-45 s)
LAUNCH_TIMEOUT = 240  # seconds for the accelerate launch (measured 30-45 s)


def _bound(optimizer: str, same_wrapper: bool) -> float:
    if optimizer == "sgd":
        return SGD_BOUND if same_wrapper else WRAPPER_SGD_BOUND
    return ADAM_BOUND * tp.LEARNING_RATES[optimizer]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return worker.make_checkpoints(tmp_path_factory.mktemp("checkpoints"))


def _run_workers(out: Path) -> str:
    """Both workers of tests/train_dist_worker.py on checkpoints made under ``out``, their results written there;
    returns what went wrong with the processes (exit codes, a timeout), empty when nothing did."""
    folders = worker.make_checkpoints(out)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "transformers", "modelpatch.recipes", "modelpatch.routing", "training_parity", "train_dist_worker"]
    )
    procs = [ctx.Process(target=worker.run, args=(r, 2, str(out / "init"), folders, str(out))) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + WORKER_TIMEOUT
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not hung and all(p.exitcode == 0 for p in procs):
        return ""
    return f"exit codes {[p.exitcode for p in procs]}" + (
        f", pids {hung} killed after {WORKER_TIMEOUT} s" if hung else ""
    )


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory) -> dict:
    """Both workers' results per scenario (``{name: [rank 0, rank 1]}``), and ``"failed"``: what went wrong with
    the processes. Run once per test session: under pytest-xdist the workers share one run (a file lock in the
    session's base folder), instead of each running the processes."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.getbasetemp().parent / "distributed-training"
        out.mkdir(exist_ok=True)
    else:
        out = tmp_path_factory.mktemp("distributed-training")
    with FileLock(f"{out}.lock"):
        if not (out / "failed.txt").exists():
            (out / "failed.txt").write_text(_run_workers(out))
    results: dict = {"failed": (out / "failed.txt").read_text()}
    for name, _ in worker.SCENARIOS:
        files = [out / f"{name}.rank{r}.pt" for r in (0, 1)]
        if all(f.exists() for f in files):
            results[name] = [torch.load(f, weights_only=False) for f in files]
    return results


def _scenario(results: dict, name: str) -> list[dict]:
    assert name in results, f"scenario {name!r} did not finish ({results['failed']}; tracebacks in captured stderr)"
    return [r["result"] for r in results[name]]


def _check_training(results: dict, wrapper: str) -> None:
    ranks = _scenario(results, f"train-{wrapper}")
    assert ranks[0].keys() == ranks[1].keys()
    assert len(ranks[0]) == len(worker.FAMILIES) * len(worker.OPTIMIZER_NAMES) * 3
    for (family, optimizer, run), got in ranks[0].items():
        what = (family, optimizer, run, got["worst"])
        same = run == f"patched-{wrapper}"
        assert got["missing_grads"] == 0, what  # every trainable parameter got a gradient in every step
        wrapped = run.endswith(wrapper)
        assert got["find_unused_parameters"] is (False if wrapped and wrapper == "ddp" else None), what
        # FSDP2 shards each of the 2 x 4 experts on its own
        assert got["sharded_experts"] == (8 if same and wrapper == "fsdp2" and family == "qwen2_moe" else 0), what
        # the same weights on both ranks (FSDP2: gathered), and what one process reaches on the whole batch
        assert ranks[1][(family, optimizer, run)]["diff"] == got["diff"], what
        assert got["diff"] <= _bound(optimizer, same_wrapper=run == "patched-single"), what + (got["diff"],)
        if same:
            assert got["same_wrapper"] <= _bound(optimizer, same_wrapper=True), what + (got["same_wrapper"],)
        assert got["moved"] > 20 * _bound(optimizer, same_wrapper=False), what  # the steps moved the weights
    for optimizer in worker.OPTIMIZER_NAMES:
        # a rank routed no token to an expert that the other rank's tokens reached (the idle experts' zero
        # gradients are averaged with the other rank's), in both layouts
        for run in (f"unpatched-{wrapper}", f"patched-{wrapper}"):
            assert sum(r[("qwen2_moe", optimizer, run)]["idle_here_hit_elsewhere"] for r in ranks) >= 2, run


@pytest.mark.slow
def test_ddp_without_unused_parameter_search_trains_like_one_process(worker_results):
    _check_training(worker_results, "ddp")


@pytest.mark.slow
def test_fsdp2_per_layer_and_per_expert_trains_like_one_process(worker_results):
    _check_training(worker_results, "fsdp2")


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_routing_replay_under_distributed_wrappers(worker_results, wrapper):
    ranks = _scenario(worker_results, f"replay-{wrapper}")
    for got in ranks:
        assert got["recorded_equal"], got  # each rank's trace is its row of the one-process trace
        assert got["record_logits_diff"] <= 1e-5, got
        assert got["replay_logits_diff"] <= 1e-6, got  # replayed with the routers it was recorded with
        assert got["replay_indices_equal"] and got["train_indices_equal"], got  # the experts saw the trace
        assert got["natural_differs"] > 0, got  # the perturbed routers would route otherwise
        assert got["train_loss_diff"] <= 1e-5 and got["train_logits_diff"] <= 1e-5, got
        assert got["weights_diff"] <= WRAPPER_SGD_BOUND, got
        assert got["moved"] > 20 * WRAPPER_SGD_BOUND, got
        assert got["sharded_experts"] == (8 if wrapper == "fsdp2" else 0), got
    assert sum(r["idle_here_hit_elsewhere"] for r in ranks) >= 1, ranks


def _launch(model: str, out: Path, phases: str) -> None:
    """``accelerate launch`` of 2 processes running ``phases`` of tests/trainer_dist_worker.py; the whole process
    group (launcher and workers) is killed after ``LAUNCH_TIMEOUT``."""
    script = Path(__file__).with_name("trainer_dist_worker.py")
    command = helpers.accelerate_command("--multi_gpu") + [str(script), model, str(out), phases]
    failed = helpers.launch(command, LAUNCH_TIMEOUT, env={"ACCELERATE_USE_CPU": "true"})
    assert not failed, failed


@pytest.mark.slow
def test_trainer_under_accelerate_launch_checkpoints_and_resumes(checkpoints, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    # the resumed run is a new model loaded from the pretrained checkpoint and a new Trainer in the same two
    # processes: all it starts from is in checkpoint-2 (weights, optimizer, scheduler, RNG states, step); a second
    # launch would add 30-40 s of imports on 2 cores
    _launch(checkpoints["qwen2_moe"], tmp_path, "full,resume,unpatched")
    runs = {
        phase: [json.loads((tmp_path / f"{phase}.rank{r}.json").read_text()) for r in (0, 1)]
        for phase in ("full", "resume", "unpatched")
    }
    for phase, ranks in runs.items():
        for got in ranks:
            assert got["world"] == 2 and got["distributed_type"] == "DistributedType.MULTI_CPU", got
            assert got["wrapper"] == "DistributedDataParallel" and got["find_unused_parameters"] is False, got
            assert got["global_step"] == 4, (phase, got)
        assert ranks[0]["checksum"] == ranks[1]["checksum"], phase  # DDP kept the replicas equal
    assert [(r["started_at"], r["steps_run"]) for r in runs["full"]] == [(0, 4)] * 2
    assert [(r["started_at"], r["steps_run"]) for r in runs["resume"]] == [(2, 2)] * 2  # it did resume
    assert sum(r["idle_expert_calls"] for r in runs["full"]) > 0  # ranks left experts idle

    full, resumed, unpatched = (torch.load(tmp_path / f"{p}.pt") for p in ("full", "resume", "unpatched"))
    assert full.keys() == resumed.keys() == unpatched.keys()
    assert max((full[k] - resumed[k]).abs().max().item() for k in full) == 0.0
    # the checkpoints are in the original layout, what the run ended with (plain Transformers loads them)
    saved = load_file(tmp_path / "full" / "checkpoint-4" / "model.safetensors")
    assert saved.keys() == full.keys()
    assert max((saved[k].float() - full[k]).abs().max().item() for k in full) == 0.0
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "checkpoint-2", output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    # and the patched model trained as the unpatched one (AdamW at lr 1e-2)
    diff = max((full[k] - unpatched[k]).abs().max().item() for k in full)
    assert diff <= ADAM_BOUND * 1e-2, diff
