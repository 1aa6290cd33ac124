"""Benchmark: DeepSpeed ZeRO-3 (the normal path: ``from_pretrained`` under ``deepspeed.zero.Init``), a model loaded
with the ``qwen2_moe-linear-experts`` recipe against the unpatched model, on 2 processes (``torchrun``; on a
machine without a GPU ``DS_ACCELERATOR=cpu`` and gloo).

One qwen2_moe checkpoint (hidden 256, 4 layers, 16 experts top-2, vocab 1024, ~15M parameters), saved once. Each
variant runs in its own ``torchrun`` launch (fresh processes), ``--repeats`` times, alternating: the load time
(``from_pretrained``, barrier to barrier, 3 loads after a first that pays imports and DeepSpeed's set-up: their
median and the fastest), the step time (a DeepSpeed engine with SGD, each rank a ``(1, 64)`` batch; median and
fastest of 5 steps after one, and the median forward, backward and optimizer step apart) and the peak RSS of rank
0 (``ru_maxrss``) at the end. ZeRO-3 runs with ``stage3_param_persistence_threshold`` at what Transformers' "auto"
sets, 10 x hidden size (see the config below for why). Printed: medians over the launches (fastest of the fastest for the ``fastest`` rows: on a shared machine the least disturbed figure),
patched / unpatched (targets: load <= 1.15x, step <= 1.10x, peak memory per rank <= 1.05x) and the spread of that
ratio over the rounds.

    python benchmarks/bench_zero3.py [--repeats 2]

Needs ``pip install -e ".[deepspeed]"`` (and DeepSpeed's CPU op: ``python tests/deepspeed_warmup.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

RECIPE = "qwen2_moe-linear-experts"
HIDDEN = 256
LOADS = 3  # timed loads per launch


def checkpoint(folder: str) -> str:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=512,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=16,
        num_experts_per_tok=2,
        vocab_size=1024,
    )
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(config).save_pretrained(folder)
    return folder


def worker(path: str, how: str, out: str) -> None:
    """One of 2 processes: ZeRO-3 on, 2 loads (the second timed), 6 engine steps, rank 0 writes ``out``."""
    import deepspeed
    import torch.distributed as dist
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, TrainingArguments

    from modelpatch.recipes import get_recipe

    torch.set_num_threads(1)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # accelerate 1.15/1.16 without a GPU: see tests/zero3_dist_worker.py
    config = {
        # what Transformers' "auto" sets (10 x hidden_size); DeepSpeed's own default (1e5 elements) would keep every
        # per-expert Linear of these tiny experts (256 x 256 = 65,536) unpartitioned: replicated on each rank and
        # all-gathered after every optimizer step (the step then costs 1.24-1.39x), where the fused tensor is split
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10 * HIDDEN},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "zero_allow_untested_optimizer": True,
    }
    args = TrainingArguments(output_dir=os.path.dirname(out), deepspeed=config, report_to=[])  # ZeRO-3 on

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if how == "unpatched":
                return AutoModelForCausalLM.from_pretrained(path)
            with get_recipe(RECIPE).apply():
                return AutoModelForCausalLM.from_pretrained(path)

    load()  # the first load pays imports and DeepSpeed set-up
    loads = []
    for _ in range(LOADS):
        model = None  # the previous load's partitions are freed before the next is built (reference cycles too)
        gc.collect()
        dist.barrier()
        started = time.perf_counter()
        model = load()
        dist.barrier()
        loads.append(time.perf_counter() - started)
    engine, *_ = deepspeed.initialize(
        model=model.train(), optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), config=config
    )
    ids = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    steps = []
    phases = []
    for _ in range(6):
        dist.barrier()
        started = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        dist.barrier()
        t1 = time.perf_counter()
        engine.backward(loss)
        dist.barrier()
        t2 = time.perf_counter()
        engine.step()
        dist.barrier()
        steps.append(time.perf_counter() - started)
        phases.append((t1 - started, t2 - t1, time.perf_counter() - t2))
    if dist.get_rank() == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with open(out, "w") as fh:
            record = {"load": statistics.median(loads), "load_min": min(loads), "step": statistics.median(steps[1:])}
            fwd, bwd, opt = (statistics.median(p[i] for p in phases[1:]) for i in range(3))
            json.dump({**record, "step_min": min(steps[1:]), "peak_mb": peak, "fwd": fwd, "bwd": bwd, "opt": opt}, fh)
    del args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    results: dict[str, list[dict]] = {"unpatched": [], "patched": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(os.path.join(tmp, "qwen2_moe"))
        for repeat in range(options.repeats):
            for how in results:
                out = os.path.join(tmp, f"{how}-{repeat}.json")
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                command += [os.path.abspath(__file__), "--worker", path, how, out]
                subprocess.run(command, env=env, check=True, capture_output=True, timeout=900)
                with open(out) as fh:
                    results[how].append(json.load(fh))
    print("| ZeRO-3, 2 processes, qwen2_moe 15M, 16 experts | patched | unpatched | ratio (target) | per round |")
    print("|---|---|---|---|---|")
    for key, label, target in (
        ("load", "load (s), median", 1.15),
        ("load_min", "load (s), fastest", 1.15),
        ("step", "SGD step (s), median", 1.10),
        ("step_min", "SGD step (s), fastest", 1.10),
        ("peak_mb", "peak RSS rank 0 (MB)", 1.05),
        ("fwd", "  of it: forward (s), median", 1.10),
        ("bwd", "  of it: backward (s), median", 1.10),
        ("opt", "  of it: optimizer step (s), median", 1.10),
    ):
        pick = min if key.endswith("_min") else statistics.median
        patched = pick(r[key] for r in results["patched"])
        unpatched = pick(r[key] for r in results["unpatched"])
        rounds = [p[key] / u[key] for p, u in zip(results["patched"], results["unpatched"])]
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}"
        print(f"| {label} | {patched:.3f} | {unpatched:.3f} | {patched / unpatched:.2f} (<= {target}) | {spread} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:])
    else:
        sys.exit(main())
