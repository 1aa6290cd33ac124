"""Benchmark: patched (``llama-fused-qkv`` recipe) vs vanilla ``from_pretrained`` of a ~100M-parameter llama checkpoint.

Two measures, each with the vanilla baseline taken in the same run:

* warm, one process (the main figures): ``--warm`` rounds, each loading both ways (the order alternating from round
  to round, so drift affects both alike), no import or first-call costs. Times ``from_pretrained`` alone, and
  ``from_pretrained`` followed by a first forward pass (which reads every weight: a vanilla load leaves them as
  views of the memory-mapped file, while the fused ``qkv_proj`` is read and written during the load). Prints the
  medians, their ratio and the spread of the per-round ratios. Targets: load <= 1.10x, load + first forward
  <= 1.05x.
* fresh process: ``--repeats`` loads of each mode in a new interpreter (interleaved), with peak RSS (``VmHWM``, whole
  process, and its increase over the process after imports) and ``save_pretrained`` of the patched model (reverse
  conversion to the original layout) vs vanilla.

    python benchmarks/bench_conversion.py [--warm 21] [--repeats 11] [--layers 8] [--dtype float32]
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


def _load(mode: str, folder: str, **kwargs):
    from transformers import AutoModelForCausalLM

    from modelpatch.recipes import get_recipe

    if mode == "patched":
        with get_recipe("llama-fused-qkv").apply():
            return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, q2, q3


def warm_child(folder: str, rounds: int, dtype: str) -> None:
    """Per mode, the ``from_pretrained`` time and that plus a first forward, over ``rounds`` rounds in this process."""
    import torch

    torch.set_num_threads(1)
    kwargs = {"dtype": getattr(torch, dtype)}
    input_ids = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(0))

    def run(mode: str) -> tuple[float, float, float]:
        gc.collect()
        start, cpu = time.perf_counter(), time.process_time()
        model = _load("vanilla" if mode == "floor" else mode, folder, **kwargs)
        kept = []  # floor: the bytes any fused load must read and write into new memory (q/k/v -> qkv), kept alive
        if mode == "floor":
            with torch.no_grad():
                for layer in model.model.layers:
                    attention = layer.self_attn
                    kept.append(torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]))
        loaded, loaded_cpu = time.perf_counter() - start, time.process_time() - cpu
        with torch.no_grad():
            model(input_ids)
        return loaded, time.perf_counter() - start, loaded_cpu

    modes = ("vanilla", "patched", "floor")
    for mode in modes * 2:  # warm-up: imports, first-call caches
        run(mode)
    times: dict = {mode: [] for mode in modes}
    for i in range(rounds):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            times[mode].append(run(mode))
    print(json.dumps(times))


def child(mode: str, folder: str, out: str | None) -> None:
    import torch
    import transformers  # noqa: F401 - imported before the baseline RSS, like modelpatch

    import modelpatch.recipes  # noqa: F401

    torch.set_num_threads(1)
    base = _rss_mb()
    start = time.perf_counter()
    model = _load(mode, folder)
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


def _run(args: list[str]) -> dict:
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True, env=env)
    if result.returncode:
        raise SystemExit(f"benchmark child {args} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _report_warm(times: dict, rounds: int) -> None:
    for index, what, target in ((0, "load", 1.10), (1, "load + first forward", 1.05), (2, "load, CPU time", None)):
        med = {mode: statistics.median(t[index] for t in ts) for mode, ts in times.items()}
        per_round = [p[index] / v[index] for v, p in zip(times["vanilla"], times["patched"])]
        q1, _, q3 = _quartiles(per_round)
        print(
            f"warm, one process, {what}, median of {rounds}: vanilla {med['vanilla'] * 1e3:.1f} ms, "
            f"patched {med['patched'] * 1e3:.1f} ms -> ratio {med['patched'] / med['vanilla']:.3f}x "
            f"(per-round ratios: quartiles {q1:.3f}-{q3:.3f}, range {min(per_round):.3f}-{max(per_round):.3f}"
            + (f"; target <= {target:.2f}x)" if target else ")")
        )
    floor = [f[0] / v[0] for v, f in zip(times["vanilla"], times["floor"])]
    print(
        f"floor of the load: vanilla + writing the fused q/k/v into new memory (torch.cat of the loaded weights), "
        f"{statistics.median(t[0] for t in times['floor']) * 1e3:.1f} ms -> ratio "
        f"{statistics.median(t[0] for t in times['floor']) / statistics.median(t[0] for t in times['vanilla']):.3f}x "
        f"(per-round quartiles {_quartiles(floor)[0]:.3f}-{_quartiles(floor)[2]:.3f}): what any load that "
        "materialises qkv_proj pays on this machine"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=21, help="rounds (one load of each mode) in one warm process")
    parser.add_argument("--repeats", type=int, default=11, help="fresh-process loads of each mode (0: skip)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="from_pretrained(dtype=...) of the warm measure")
    parser.add_argument("--child", nargs="+")
    parser.add_argument("--warm-child", nargs=3)
    args = parser.parse_args()
    if args.warm_child:
        warm_child(args.warm_child[0], int(args.warm_child[1]), args.warm_child[2])
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
        print(f"checkpoint: llama GQA, {n_params / 1e6:.1f}M parameters, fp32, loaded as {args.dtype}")
        _report_warm(_run(["--warm-child", folder, str(args.warm), args.dtype]), args.warm)
        if not args.repeats:
            return
        runs: dict = {"vanilla": [], "patched": []}
        for i in range(args.repeats):
            for mode in ("vanilla", "patched"):  # interleaved so drift affects both alike
                out = [os.path.join(tmp, f"out-{mode}-{i}")] if i == 0 else []
                runs[mode].append(_run(["--child", mode, folder, *out]))
        keys = ("load_s", "ready_s", "peak_mb", "delta_mb", "touched_mb")
        med = {m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in runs.items()}
        for mode in ("vanilla", "patched"):
            s = med[mode]
            print(
                f"fresh process, {mode:8s} load {s['load_s']:.3f}s (+ first read of every weight: "
                f"{s['ready_s']:.3f}s)  peak RSS {s['peak_mb']:.0f} MB (+{s['delta_mb']:.0f} MB over imports; "
                f"{s['touched_mb']:.0f} MB once every weight was read)  save {runs[mode][0]['save_s']:.3f}s"
            )
        v, p = med["vanilla"], med["patched"]
        print(
            f"fresh process, ratio patched/vanilla (median of {args.repeats}): load time "
            f"{p['load_s'] / v['load_s']:.3f}x (load + first read of every weight {p['ready_s'] / v['ready_s']:.3f}x), "
            f"peak RSS {p['peak_mb'] / v['peak_mb']:.3f}x (increase over imports "
            f"{p['delta_mb'] / max(v['delta_mb'], 1):.3f}x; after reading every weight "
            f"{p['touched_mb'] / v['touched_mb']:.3f}x), save time "
            f"{runs['patched'][0]['save_s'] / runs['vanilla'][0]['save_s']:.3f}x"
        )


if __name__ == "__main__":
    main()
