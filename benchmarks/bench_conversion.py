"""Benchmark: patched (fused-QKV, GQA) vs vanilla ``from_pretrained`` of a ~100M-parameter llama checkpoint.

Each load runs in a fresh subprocess; wall time of ``from_pretrained`` and peak RSS (``VmHWM``, whole process,
and the increase over the process after imports) are measured, repeated (vanilla and patched interleaved) and the
medians compared in this run. A second measure loads both ways many times in one warm process (no import or
first-call costs, less noise). Also times ``save_pretrained`` of the patched model (reverse conversion to the
original layout) vs vanilla. Target: patched/vanilla ≤ 1.15 for load time and peak RSS.

    python benchmarks/bench_conversion.py [--repeats 11] [--warm 15] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
    )


def _rss_mb() -> float:
    """Peak RSS of this process in MB. ``VmHWM`` (per address space) rather than ``ru_maxrss``, which Linux carries
    over from the parent across fork/exec and would hide the child's own peak."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def warm_child(folder: str, rounds: int) -> None:
    """Median ``from_pretrained`` time of each mode over ``rounds`` interleaved loads in this process."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    from transformers import AutoModelForCausalLM

    from conversion_models import QKV_RULE, FusedQKVAttention, patched
    from modelpatch.conversion import apply_conversion_rules

    torch.set_num_threads(1)

    def load(mode):
        start = time.perf_counter()
        if mode == "patched":
            with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [QKV_RULE]}):
                AutoModelForCausalLM.from_pretrained(folder)
        else:
            AutoModelForCausalLM.from_pretrained(folder)
        return time.perf_counter() - start

    for mode in ("vanilla", "patched", "vanilla", "patched"):  # warm-up: imports, first-call caches
        load(mode)
    times = {"vanilla": [], "patched": []}
    for _ in range(rounds):
        for mode in times:
            times[mode].append(load(mode))
    print(json.dumps({mode: statistics.median(ts) for mode, ts in times.items()}))


def child(mode: str, folder: str, out: str | None) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    from transformers import AutoModelForCausalLM

    from conversion_models import QKV_RULE, FusedQKVAttention, patched
    from modelpatch.conversion import apply_conversion_rules

    torch.set_num_threads(1)
    base = _rss_mb()
    start = time.perf_counter()
    if mode == "patched":
        with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [QKV_RULE]}):
            model = AutoModelForCausalLM.from_pretrained(folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
    load_s = time.perf_counter() - start
    peak = _rss_mb()
    start = time.perf_counter()
    with torch.no_grad():  # Transformers keeps unconverted tensors on the safetensors mmap until first read
        for param in model.parameters():
            param.sum()
    ready_s = load_s + time.perf_counter() - start
    touched = _rss_mb()
    save_s = None
    if out:
        start = time.perf_counter()
        model.save_pretrained(out)
        save_s = time.perf_counter() - start
    n_params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "load_s": load_s,
                "peak_mb": peak,
                "delta_mb": peak - base,
                "touched_mb": touched,
                "ready_s": ready_s,
                "save_s": save_s,
                "params": n_params,
            }
        )
    )


def _run(mode, folder, out=None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, folder] + ([out] if out else [])
    if mode == "warm":
        cmd = [sys.executable, os.path.abspath(__file__), "--warm-child", folder, str(out)]
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11, help="fresh-process loads of each mode")
    parser.add_argument("--warm", type=int, default=15, help="loads of each mode in one warm process")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--child", nargs="+")
    parser.add_argument("--warm-child", nargs=2)
    args = parser.parse_args()
    if args.warm_child:
        warm_child(args.warm_child[0], int(args.warm_child[1]))
        return
    if args.child:
        child(args.child[0], args.child[1], args.child[2] if len(args.child) > 2 else None)
        return
    import torch
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "ckpt")
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(args.layers))
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        print(f"checkpoint: llama GQA, {n_params / 1e6:.1f}M parameters, fp32, {folder}")
        runs = {"vanilla": [], "patched": []}
        for i in range(args.repeats):
            for mode in ("vanilla", "patched"):  # interleaved so drift affects both alike
                runs[mode].append(_run(mode, folder, os.path.join(tmp, f"out-{mode}-{i}") if i == 0 else None))
        med = {
            m: {
                k: statistics.median(r[k] for r in rs)
                for k in ("load_s", "ready_s", "peak_mb", "delta_mb", "touched_mb")
            }
            for m, rs in runs.items()
        }
        for mode in ("vanilla", "patched"):
            s = med[mode]
            print(
                f"{mode:8s} load {s['load_s']:.3f}s (+ first read of every weight: {s['ready_s']:.3f}s)  peak RSS {s['peak_mb']:.0f} MB "
                f"(+{s['delta_mb']:.0f} MB over imports; {s['touched_mb']:.0f} MB once every weight was read)  "
                f"save {runs[mode][0]['save_s']:.3f}s"
            )
        warm = _run("warm", folder, args.warm)
        print(
            f"warm, one process, median of {args.warm}: vanilla {warm['vanilla'] * 1e3:.1f} ms, "
            f"patched {warm['patched'] * 1e3:.1f} ms"
        )
        v, p = med["vanilla"], med["patched"]
        print(
            f"ratio patched/vanilla: load time {p['load_s'] / v['load_s']:.3f}x "
            f"(load + first read of every weight {p['ready_s'] / v['ready_s']:.3f}x), peak RSS "
            f"{p['peak_mb'] / v['peak_mb']:.3f}x (increase over imports {p['delta_mb'] / max(v['delta_mb'], 1):.3f}x; "
            f"after reading every weight {p['touched_mb'] / v['touched_mb']:.3f}x), "
            f"save time {runs['patched'][0]['save_s'] / runs['vanilla'][0]['save_s']:.3f}x, "
            f"warm load time {warm['patched'] / warm['vanilla']:.3f}x"
        )


if __name__ == "__main__":
    main()
