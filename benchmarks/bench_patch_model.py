"""Benchmark: ``patch_model`` on a built ~140M-parameter Qwen3-MoE vs loading the same model patched from disk.

The recipe is ``qwen3_moe-linear-experts`` (every fused experts tensor split into one ``nn.Linear`` per expert, the
largest move modelpatch makes). Two ways to the same patched model, each in a fresh subprocess, interleaved:

* **patch**: plain ``from_pretrained``, every weight read once (Transformers leaves untouched tensors memory-mapped),
  then ``recipe.patch(model)`` — timed alone. For the memory figure the weights are first copied into the process's
  own memory (as in a model a trainer built) and glibc maps every tensor over 64 KiB on its own
  (``MALLOC_MMAP_THRESHOLD_``), so the RSS follows the live tensors; the peak RSS is measured from a reset high-water
  mark (``VmHWM``, reset through ``/proc/self/clear_refs``): the *extra* memory while patching is that peak minus the
  RSS before, compared with the largest replaced module (one layer's experts);
* **load**: ``with recipe.apply(): from_pretrained(...)``, every weight read once.

Printed: medians of each, and the ratios patch_model time / patched-load time, whole-process peak RSS (default
allocator, weights as loaded) of (plain load + patch) / patched load, and extra memory while patching / largest replaced module. Also checks that both ways give
bit-identical parameters.

    python benchmarks/bench_patch_model.py [--repeats 5] [--layers 8]
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

from memory import reset_peak, status_mb

RECIPE = "qwen3_moe-linear-experts"


def _config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_experts=16,
        num_experts_per_tok=2,
        vocab_size=32000,
        tie_word_embeddings=False,
    )


def _touch(model) -> None:
    import torch

    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.sum()


def child(mode: str, folder: str, digest_path: str | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from modelpatch.recipes import get_recipe

    torch.set_num_threads(1)
    recipe = get_recipe(RECIPE)
    result: dict = {}
    start = time.perf_counter()
    if mode == "load":
        with recipe.apply():
            model = AutoModelForCausalLM.from_pretrained(folder)
        _touch(model)
        result["time_s"] = time.perf_counter() - start
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
        _touch(model)
        result["plain_load_s"] = time.perf_counter() - start
        with torch.no_grad():  # own memory, as a model built by a trainer: freed tensors really leave the RSS
            for tensor in model.state_dict().values():
                tensor.data = tensor.data.clone()
        warm = AutoModelForCausalLM.from_config(
            _config(1).__class__(**{**_config(1).to_dict(), "hidden_size": 64, "vocab_size": 128})
        )
        recipe.patch(warm).revert()  # first-call costs (imports, dispatcher caches) are not the patch's memory
        del warm
        largest = max(
            sum(t.numel() * t.element_size() for t in layer.mlp.experts.state_dict().values())
            for layer in model.model.layers
        )
        result["largest_module_mb"] = largest / 2**20
        before = status_mb("VmRSS")
        result["peak_reset"] = reset_peak()
        start = time.perf_counter()
        recipe.patch(model)
        result["time_s"] = time.perf_counter() - start
        result["patch_extra_mb"] = status_mb("VmHWM") - before
    result["params"] = sum(p.numel() for p in model.parameters())
    if digest_path:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, digest_path)
    print(json.dumps(result))


def _whole_peak(mode: str, folder: str) -> float:
    """Peak RSS of a whole run without the reset (plain load + patch, or patched load)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--peak-child", mode, folder]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env()).stdout
    return float(out.strip().splitlines()[-1])


def peak_child(mode: str, folder: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from modelpatch.recipes import get_recipe

    torch.set_num_threads(1)
    recipe = get_recipe(RECIPE)
    if mode == "load":
        with recipe.apply():
            model = AutoModelForCausalLM.from_pretrained(folder)
        _touch(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
        _touch(model)
        recipe.patch(model)
    print(status_mb("VmHWM"))


def _env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    return dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONPATH=path)


def _run(mode: str, folder: str, digest: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, folder] + ([digest] if digest else [])
    # every tensor over 64 KiB in its own mapping, unmapped when freed: the RSS follows live tensors exactly
    env = dict(_env(), MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh-process runs of each way")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--child", nargs="+")
    parser.add_argument("--peak-child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2] if len(args.child) > 2 else None)
        return
    if args.peak_child:
        peak_child(*args.peak_child)
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
        print(f"checkpoint: qwen3_moe, {n_params / 1e6:.1f}M parameters, fp32, recipe {RECIPE}")
        runs: dict[str, list[dict]] = {"patch": [], "load": []}
        peaks: dict[str, list[float]] = {"patch": [], "load": []}
        for i in range(args.repeats):
            for mode in runs:  # interleaved so drift affects both alike
                digest = os.path.join(tmp, f"{mode}.pt") if i == 0 else None
                runs[mode].append(_run(mode, folder, digest))
                peaks[mode].append(_whole_peak(mode, folder))
        a, b = torch.load(os.path.join(tmp, "patch.pt")), torch.load(os.path.join(tmp, "load.pt"))
        identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        med = {m: statistics.median(r["time_s"] for r in rs) for m, rs in runs.items()}
        plain = statistics.median(r["plain_load_s"] for r in runs["patch"])
        extra = statistics.median(r["patch_extra_mb"] for r in runs["patch"])
        largest = runs["patch"][0]["largest_module_mb"]
        peak = {m: statistics.median(v) for m, v in peaks.items()}
        print(
            f"patch_model on the built model: {med['patch']:.3f}s (after a plain load + first read of {plain:.3f}s); "
            f"extra memory while patching {extra:.0f} MB, largest replaced module {largest:.0f} MB"
            + ("" if runs["patch"][0]["peak_reset"] else " (VmHWM could not be reset: extra is an upper bound)")
        )
        print(f"patched load from disk (+ first read of every weight): {med['load']:.3f}s")
        print(f"peak RSS: plain load + patch_model {peak['patch']:.0f} MB, patched load {peak['load']:.0f} MB")
        print(f"same parameters both ways (bit for bit): {identical}")
        print(
            f"ratio: patch_model time / patched load time {med['patch'] / med['load']:.3f}x; "
            f"(plain load + patch_model) / patched load: time {(plain + med['patch']) / med['load']:.3f}x, "
            f"peak RSS {peak['patch'] / peak['load']:.3f}x; extra memory while patching / largest replaced module "
            f"{extra / largest:.3f}x"
        )


if __name__ == "__main__":
    main()
