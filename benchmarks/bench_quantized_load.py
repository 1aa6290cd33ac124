"""Benchmark: quantized load (torchao int8 weight-only) of a ~110M-parameter Qwen3-MoE checkpoint with the
``qwen3_moe-linear-experts`` recipe vs the unpatched quantized load of the same checkpoint.

Each load runs in a fresh subprocess (vanilla and patched interleaved, repeated); the wall time of
``from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))`` and the peak RSS (``VmHWM``,
whole process) are measured and the medians compared in this run, with the spread (min-max) of each. The two loads
do not do the same work: unpatched, torchao quantizes only the attention projections (the fused 3-D experts are
skipped, and stay in fp32); with the recipe it also quantizes every expert ``nn.Linear`` (the point of the recipe),
so the counts of quantized weights and the model's memory once loaded are printed too. The same two loads in full
precision (no quantizer) run in the same round, which separates modelpatch's own cost (the fp32 ratio) from the
quantizer's (seconds of quantization per million parameters quantized, each way). Target: patched/vanilla ≤ 1.10
for load time and peak RSS.

    python benchmarks/bench_quantized_load.py [--repeats 5] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from memory import status_mb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_experts=16,
        num_experts_per_tok=2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
        tie_word_embeddings=False,
    )


def child(mode: str, folder: str) -> None:
    import torch
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    from modelpatch.recipes import get_recipe

    torch.set_num_threads(1)
    base = status_mb("VmHWM")
    kwargs = {} if mode.endswith("-fp32") else {"quantization_config": TorchAoConfig(Int8WeightOnlyConfig())}
    start = time.perf_counter()
    if mode.startswith("patched"):
        with get_recipe("qwen3_moe-linear-experts").apply():
            model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    load_s = time.perf_counter() - start
    peak = status_mb("VmHWM")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = sum(type(m.weight).__name__ == "Int8Tensor" for m in linears)
    quantized_params = sum(m.weight.numel() for m in linears if type(m.weight).__name__ == "Int8Tensor")
    fp32 = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    print(
        json.dumps(
            {
                "load_s": load_s,
                "peak_mb": peak,
                "delta_mb": peak - base,
                "rss_mb": status_mb("VmRSS"),
                "quantized": quantized,
                "quantized_params": quantized_params,
                "fused_fp32": fp32,
            }
        )
    )


def _run(mode: str, folder: str) -> dict:
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, folder]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _spread(values) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh-process loads of each mode")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    import torch
    from transformers import Qwen3MoeForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "ckpt")
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(_config(args.layers))
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        print(f"checkpoint: qwen3_moe, 16 experts, {n_params / 1e6:.1f}M parameters, fp32 (per-expert layout)")
        runs: dict[str, list[dict]] = {"vanilla": [], "patched": [], "vanilla-fp32": [], "patched-fp32": []}
        for _ in range(args.repeats):
            for mode in runs:  # interleaved so drift affects both alike
                runs[mode].append(_run(mode, folder))
        med = {
            m: {k: statistics.median(r[k] for r in rs) for k in ("load_s", "peak_mb", "rss_mb")}
            for m, rs in runs.items()
        }
        for mode, rs in runs.items():
            if mode.endswith("-fp32"):
                print(f"{mode:12s} load {med[mode]['load_s']:.3f}s (spread {_spread([r['load_s'] for r in rs])})")
                continue
            s = med[mode]
            print(
                f"{mode:12s} load {s['load_s']:.3f}s (spread {_spread([r['load_s'] for r in rs])})  peak RSS "
                f"{s['peak_mb']:.0f} MB (spread {_spread([r['peak_mb'] for r in rs])}), {s['rss_mb']:.0f} MB once "
                f"loaded; {rs[0]['quantized']} Linear quantized, {rs[0]['fused_fp32'] / 1e6:.1f}M fused experts "
                "parameters left in fp32"
            )
        v, p = med["vanilla"], med["patched"]
        ratios = [r["load_s"] for r in runs["patched"]], [r["load_s"] for r in runs["vanilla"]]
        print(
            f"ratio patched/vanilla (medians, {args.repeats} runs each): load time {p['load_s'] / v['load_s']:.3f}x "
            f"(per-run pairs {min(a / b for a, b in zip(*ratios)):.3f}-{max(a / b for a, b in zip(*ratios)):.3f}x), "
            f"peak RSS {p['peak_mb'] / v['peak_mb']:.3f}x, RSS once loaded {p['rss_mb'] / v['rss_mb']:.3f}x "
            "(target <= 1.10x for load time and peak RSS)"
        )
        fp = med["patched-fp32"]["load_s"] / med["vanilla-fp32"]["load_s"]
        cost = {
            m: (med[m]["load_s"] - med[f"{m}-fp32"]["load_s"]) / (runs[m][0]["quantized_params"] / 1e6)
            for m in ("vanilla", "patched")
        }
        print(
            f"without a quantizer, patched/vanilla load time {fp:.3f}x (modelpatch's own cost); quantization time per "
            f"million parameters quantized: vanilla {cost['vanilla'] * 1e3:.1f} ms, patched {cost['patched'] * 1e3:.1f} ms "
            f"(vanilla quantizes {runs['vanilla'][0]['quantized_params'] / 1e6:.1f}M, patched "
            f"{runs['patched'][0]['quantized_params'] / 1e6:.1f}M)"
        )


if __name__ == "__main__":
    main()
