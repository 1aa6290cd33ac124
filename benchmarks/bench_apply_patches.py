"""Cost of entering and leaving a patch block, modelpatch vs ``transformers.monkey_patching``.

Imports 30 model families' modeling modules first (the reference walks every attribute of every
Transformers module on each entry, so its cost grows with what is imported), then times
``with apply_patches(): pass`` with one registered key in both implementations, in the same process.

Run: ``python benchmarks/bench_apply_patches.py`` (prints a table; goal: modelpatch <= 1 ms).
"""

from __future__ import annotations

import importlib
import time

import torch.nn as nn

FAMILIES = [
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3",
    "phi",
    "phi3",
    "phimoe",
    "gpt2",
    "gpt_neo",
    "gpt_neox",
    "gptj",
    "bert",
    "roberta",
    "t5",
    "bart",
    "olmo",
    "olmoe",
    "deepseek_v3",
    "granite",
    "granitemoe",
    "jamba",
    "starcoder2",
    "falcon",
    "opt",
]


class Replacement(nn.Module):
    pass


def _time(block, repeats: int) -> float:
    block()  # warm up caches on both sides
    start = time.perf_counter()
    for _ in range(repeats):
        block()
    return (time.perf_counter() - start) / repeats


def main() -> list[tuple[str, float, float]]:
    for family in FAMILIES:
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    import transformers.monkey_patching as reference

    import modelpatch

    def ours():
        with modelpatch.apply_patches():
            pass

    def theirs():
        with reference.apply_patches():
            pass

    rows = []
    for label, key in [("exact key", "LlamaAttention"), ("regex key, 24 classes", ".*DecoderLayer$")]:
        modelpatch.register_patch_mapping({key: Replacement})
        reference.register_patch_mapping({key: Replacement})
        try:
            rows.append((f"apply_patches enter+exit, {label}, 30 families", _time(ours, 1000), _time(theirs, 3)))
        finally:
            modelpatch.clear_patch_mapping()
            reference.clear_patch_mapping()
    print(f"{'figure':<58} {'modelpatch':>12} {'transformers':>14} {'ratio':>8}")
    for name, a, b in rows:
        print(f"{name:<58} {a * 1e3:>10.4f}ms {b * 1e3:>12.2f}ms {a / b:>8.5f}")
    return rows


if __name__ == "__main__":
    main()
