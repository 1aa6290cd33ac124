"""Benchmark: ``model.load_state_dict`` of an original-layout state dict vs one in the model's own layout.

A ~100M-parameter llama (GQA) with fused QKV (``llama-fused-qkv``) is saved with ``save_pretrained`` (original
layout: ``q_proj``/``k_proj``/``v_proj``) and read back into memory; ``load_state_dict`` of that dict (converted by
modelpatch's hook: one ``Concatenate`` per layer) and of ``model.state_dict()`` cloned (no conversion) are timed,
interleaved, in one process, and the medians compared. Target: original/own ≤ 1.2.

    python benchmarks/bench_state_dict.py [--repeats 9] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args(argv)

    import safetensors.torch as st
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from modelpatch.recipes import get_recipe

    torch.set_num_threads(1)
    config = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        with get_recipe("llama-fused-qkv").apply():
            model = AutoModelForCausalLM.from_pretrained(folder)
        original = st.load_file(f"{folder}/model.safetensors")
    own = {k: v.clone() for k, v in model.state_dict().items()}
    parameters = sum(p.numel() for p in model.parameters())

    def timed(state_dict) -> float:
        start = time.perf_counter()
        result = model.load_state_dict(state_dict, strict=True)
        elapsed = time.perf_counter() - start
        assert not result.missing_keys and not result.unexpected_keys
        return elapsed

    for state_dict in (own, original):  # warm-up
        timed(state_dict)
    times: dict[str, list[float]] = {"own layout": [], "original layout": []}
    for _ in range(args.repeats):
        times["own layout"].append(timed(own))
        times["original layout"].append(timed(original))
    medians = {mode: statistics.median(ts) for mode, ts in times.items()}
    print(f"llama fused-QKV, {parameters / 1e6:.0f}M parameters, {args.layers} layers, median of {args.repeats}")
    for mode, seconds in medians.items():
        print(f"  load_state_dict, {mode:<16} {seconds * 1000:8.1f} ms")
    ratio = medians["original layout"] / medians["own layout"]
    print(f"  ratio original/own: {ratio:.2f}x (target <= 1.20)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
