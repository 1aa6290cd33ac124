"""Benchmark: ``iter_original_state_dict`` (weight push in the original layout) on a ~150M-parameter Qwen2-MoE.

The model is built with the recipe ``qwen2_moe-fused-qkv`` (fp32): its attention has a fused ``qkv_proj``
(modelpatch's rules split it back) and its experts are fused by Transformers (``gate_up_proj (E, 2I, H)``, split
back per expert by Transformers' own reverse), so both stages of the reverse run. Each measurement runs in a fresh
subprocess whose weights live in its own memory, with glibc mapping every tensor over 64 KiB on its own
(``MALLOC_MMAP_THRESHOLD_``), so the RSS follows the live tensors; peaks are read from a reset high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs``).

* **stream**: iterate ``iter_original_state_dict(model)``, copying each tensor into one preallocated staging buffer
  (as a push to an engine does) and dropping it; the *extra* memory is the peak RSS minus the RSS before, compared
  with the largest conversion group (the bytes of the largest fused parameter a rule splits: one layer's experts);
* **dict**: ``dict(iter_original_state_dict(model))``, the whole original-layout state dict at once (what
  ``save_pretrained`` holds before writing);
* **save**: ``model.save_pretrained`` into a folder on ``/dev/shm`` (tmpfs; else the temp dir), the same conversion
  plus serialisation.

Printed: medians over the runs, the ratios extra memory / largest group (stream and dict), stream time / save time,
and whether the streamed tensors equal the saved file bit for bit.

    python benchmarks/bench_weight_sync.py [--repeats 3] [--layers 8]
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

RECIPE = "qwen2_moe-fused-qkv"


def _config(layers: int, small: bool = False):
    from transformers import Qwen2MoeConfig

    if small:
        return Qwen2MoeConfig(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            vocab_size=128,
        )
    return Qwen2MoeConfig(
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_experts=16,
        num_experts_per_tok=2,
        vocab_size=32000,
        tie_word_embeddings=False,
    )


def _build(layers: int, small: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    from modelpatch.recipes import get_recipe

    torch.manual_seed(0)
    with get_recipe(RECIPE).apply():
        return AutoModelForCausalLM.from_config(_config(layers, small)).eval()


def child(layers: int, folder: str) -> None:
    import torch
    from safetensors.torch import load_file

    from modelpatch import iter_original_state_dict

    torch.set_num_threads(1)
    warm = _build(1, small=True)  # first-call costs (imports, caches) are not the stream's memory
    for _ in iter_original_state_dict(warm):
        pass
    warm.save_pretrained(os.path.join(folder, "warm"))
    del warm
    model = _build(layers)
    params = dict(model.named_parameters())
    stream = iter_original_state_dict(model)
    names = {name: tensor.data_ptr() for name, tensor in stream}
    converted = [p for n, p in params.items() if n not in names or names[n] != p.data_ptr()]
    largest = max(p.numel() * p.element_size() for p in converted)
    staging = torch.zeros(max(p.numel() for p in params.values()))  # the engine side: allocated, touched up front
    result: dict = {
        "params": sum(p.numel() for p in params.values()),
        "groups": stream.groups,
        "largest_group_mb": largest / 2**20,
        "tensors": len(names),
    }
    del names

    before = status_mb("VmRSS")
    result["peak_reset"] = reset_peak()
    start = time.perf_counter()
    for _, tensor in iter_original_state_dict(model):
        staging[: tensor.numel()].copy_(tensor.reshape(-1))
        del tensor
    result["stream_s"] = time.perf_counter() - start
    result["stream_extra_mb"] = status_mb("VmHWM") - before

    before = status_mb("VmRSS")
    reset_peak()
    start = time.perf_counter()
    whole = dict(iter_original_state_dict(model))
    result["dict_s"] = time.perf_counter() - start
    result["dict_extra_mb"] = status_mb("VmHWM") - before
    del whole

    target = os.path.join(folder, "saved")
    before = status_mb("VmRSS")
    reset_peak()
    start = time.perf_counter()
    model.save_pretrained(target)
    result["save_s"] = time.perf_counter() - start
    result["save_extra_mb"] = status_mb("VmHWM") - before

    saved = load_file(os.path.join(target, "model.safetensors"))
    same = True
    for name, tensor in iter_original_state_dict(model):
        same = same and name in saved and torch.equal(saved.pop(name), tensor)
    result["identical"] = same and not saved
    print(json.dumps(result))


def _env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    # every tensor over 64 KiB in its own mapping, unmapped when freed: the RSS follows live tensors exactly
    return dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONPATH=path, MALLOC_MMAP_THRESHOLD_="65536")


def _run(layers: int, folder: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(layers), folder]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env()).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh-process runs")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1])
        return
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(dir=base) as folder:
            runs.append(_run(args.layers, folder))
    first = runs[0]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    largest = first["largest_group_mb"]
    print(
        f"model: qwen2_moe, {first['params'] / 1e6:.1f}M parameters, fp32, recipe {RECIPE}; {first['tensors']} "
        f"tensors in the original layout, {first['groups']} conversion groups, largest {largest:.1f} MB"
        f"; save folder on {'tmpfs (/dev/shm)' if base else 'the temp dir'}; {args.repeats} fresh processes"
    )
    print(
        f"stream (copy each tensor to a staging buffer, drop it): {med('stream_s'):.3f}s, extra memory "
        f"{med('stream_extra_mb'):.1f} MB"
        + ("" if first["peak_reset"] else " (VmHWM could not be reset: extra is an upper bound)")
    )
    print(f"whole dict at once: {med('dict_s'):.3f}s, extra memory {med('dict_extra_mb'):.1f} MB")
    print(f"save_pretrained: {med('save_s'):.3f}s, extra memory {med('save_extra_mb'):.1f} MB")
    print(f"streamed tensors equal the saved file bit for bit: {all(r['identical'] for r in runs)}")
    print(
        f"ratio: stream extra memory / largest group {med('stream_extra_mb') / largest:.3f}x; whole dict extra "
        f"memory / largest group {med('dict_extra_mb') / largest:.3f}x; stream time / save_pretrained time "
        f"{med('stream_s') / med('save_s'):.3f}x"
    )


if __name__ == "__main__":
    main()
