"""Benchmark: the full example (qwen2_moe: per-expert experts + fused QKV + ``Concatenate``).

Three ways to load the same ~90M-parameter Qwen2-MoE checkpoint, each load in a fresh subprocess (so peak RSS is
the load's own), interleaved and repeated, medians compared in this run:

* ``vanilla``       plain Transformers, no patch;
* ``modelpatch``    ``modelpatch.recipes.FULL_EXAMPLE.apply()``;
* ``transformers``  the same replacement classes through ``transformers.monkey_patching.register_patch_mapping``
                    and ``transformers.conversion_mapping.register_checkpoint_conversion_mapping(..., overwrite=True)``
                    (Transformers' own implementation of the feature, as a script for it is written).

Figures: ``from_pretrained`` wall time, peak RSS (``VmHWM``) right after it and once every weight has been read
(tensors left memory-mapped by a lazy load only count then), ``save_pretrained`` time (with reverse conversion for
the patched models) and whether the saved checkpoint equals the original bit for bit. The checkpoint uses full
multi-head attention (8 query = 8 key/value heads): Transformers' reverse ``Chunk`` splits equally, so with
grouped-query attention its saved checkpoint would not even have the right shapes.

    python benchmarks/bench_full_example.py [--repeats 3] [--layers 4]

``run()`` returns ``[(figure, modelpatch, transformers, vanilla, unit)]`` for ``benchmarks/run_all.py``.
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

MODES = ("vanilla", "modelpatch", "transformers")


def _config(layers: int):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_experts=16,
        num_experts_per_tok=2,
        vocab_size=32000,
        qkv_bias=True,
        tie_word_embeddings=False,
    )


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _same_as(folder: str, saved: str) -> bool:
    import torch
    from safetensors.torch import load_file

    a, b = load_file(os.path.join(folder, "model.safetensors")), load_file(os.path.join(saved, "model.safetensors"))
    return set(a) == set(b) and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def child(mode: str, folder: str, out: str) -> None:
    """Load ``folder`` one way, save to ``out``; print one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    if mode == "transformers":
        from transformers import Concatenate, WeightConverter
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.monkey_patching import register_patch_mapping

        from modelpatch.recipes import FULL_EXAMPLE

        register_patch_mapping(dict(FULL_EXAMPLE.patch_mapping))
        register_checkpoint_conversion_mapping(
            "qwen2_moe",
            [
                WeightConverter(
                    source_patterns=["q_proj", "k_proj", "v_proj"],
                    target_patterns=["qkv_proj"],
                    operations=[Concatenate(dim=0)],
                )
            ],
            overwrite=True,
        )
    elif mode == "modelpatch":
        from modelpatch.recipes import FULL_EXAMPLE
    base = _peak_rss_mb()
    start = time.perf_counter()
    if mode == "modelpatch":
        with FULL_EXAMPLE.apply():
            model = AutoModelForCausalLM.from_pretrained(folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
    load_s = time.perf_counter() - start
    peak = _peak_rss_mb()
    with torch.no_grad():  # touch every weight: lazily mapped tensors now count too
        checksum = sum(float(p.sum()) for p in model.parameters())
    peak_read = _peak_rss_mb()
    start = time.perf_counter()
    try:
        model.save_pretrained(out)
        save_s, exact = time.perf_counter() - start, _same_as(folder, out)
    except Exception as exc:  # noqa: BLE001 - the reference may fail to save: report it
        save_s, exact = float("nan"), f"{type(exc).__name__}: {exc}"[:120]
    print(
        json.dumps(
            {
                "load_s": load_s,
                "peak_mb": peak,
                "peak_read_mb": peak_read,
                "checksum": checksum,
                "delta_mb": peak - base,
                "save_s": save_s,
                "exact": exact,
                "class": type(model.model.layers[0].mlp.experts).__name__,
            }
        )
    )


def _run_child(mode: str, folder: str, out: str) -> dict:
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", mode, folder, out],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(repeats: int = 3, layers: int = 4, verbose: bool = True) -> list[tuple]:
    import torch
    from transformers import Qwen2MoeForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "ckpt")
        torch.manual_seed(0)
        model = Qwen2MoeForCausalLM(_config(layers))
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        if verbose:
            print(f"checkpoint: qwen2_moe, {layers} layers x 16 experts, {n_params / 1e6:.1f}M parameters, fp32")
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for i in range(repeats):
            for mode in MODES:  # interleaved so machine drift hits every mode alike
                runs[mode].append(_run_child(mode, folder, os.path.join(tmp, f"out-{mode}-{i}")))
    med = {}
    for mode, results in runs.items():
        ok = [r for r in results if "error" not in r]
        med[mode] = (
            {k: statistics.median(r[k] for r in ok) for k in ("load_s", "peak_mb", "peak_read_mb", "save_s")}
            if ok
            else None
        )
        med[mode] = med[mode] and {**med[mode], "exact": ok[0]["exact"]}
        if not ok and verbose:
            print(f"{mode}: failed: {results[0]['error']}")
    rows = []
    for figure, key, unit in (
        ("from_pretrained, full example", "load_s", "s"),
        ("peak RSS right after from_pretrained", "peak_mb", "MB"),
        ("peak RSS once every weight was read", "peak_read_mb", "MB"),
        ("save_pretrained (reverse conversion), full example", "save_s", "s"),
    ):
        rows.append(
            (
                figure,
                *(med[m][key] if med[m] else float("nan") for m in ("modelpatch", "transformers", "vanilla")),
                unit,
            )
        )
    if verbose:
        for mode in MODES:
            if med[mode]:
                print(f"  {mode:12s} saved checkpoint bit-exact: {med[mode]['exact']}")
    return rows


def print_rows(rows) -> None:
    print(f"{'figure':<52} {'modelpatch':>11} {'transformers':>13} {'vanilla':>9} {'mp/tf':>7} {'mp/vanilla':>10}")
    for figure, ours, theirs, vanilla, unit in rows:
        print(
            f"{figure:<52} {ours:>9.3f}{unit:<2} {theirs:>11.3f}{unit:<2} {vanilla:>7.3f}{unit:<2} "
            f"{ours / theirs:>7.3f} {ours / vanilla:>10.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "SRC", "OUT"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    print_rows(run(args.repeats, args.layers))


if __name__ == "__main__":
    main()
