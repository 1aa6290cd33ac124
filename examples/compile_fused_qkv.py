"""Compile a fused-QKV Llama with ``torch.compile(fullgraph=True)`` and check it against eager.

Runs with no arguments (CPU, a few seconds plus inductor's compile): builds a tiny Llama from a config, saves it
in the original layout, loads it with the ``llama-fused-qkv`` recipe (``q/k/v_proj`` -> one ``qkv_proj``),
compiles the whole model in one graph, and prints the number of graph breaks and the largest difference of
logits and gradients to the eager model.

    python examples/compile_fused_qkv.py [--backend inductor|aot_eager|eager]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig

from modelpatch.recipes import get_recipe

MAX_DIFF = float("nan")


def main(backend: str = "inductor") -> float:
    """Returns the largest absolute difference (logits and gradients) between the compiled and eager model."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        AutoModelForCausalLM.from_config(config).save_pretrained(path)  # original layout: q_proj, k_proj, v_proj
        with get_recipe("llama-fused-qkv").apply():
            model = AutoModelForCausalLM.from_pretrained(path)  # q/k/v fused into qkv_proj on load
    print("attention class:", type(model.model.layers[0].self_attn).__name__)
    print("qkv_proj weight:", tuple(model.model.layers[0].self_attn.qkv_proj.weight.shape))

    counters.clear()
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fails on any graph break
    ids = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10]])

    def step(fn):
        logits = fn(input_ids=ids).logits
        logits.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return logits.detach(), grads

    got_logits, got_grads = step(compiled)
    want_logits, want_grads = step(model)
    diff = max(
        (got_logits - want_logits).abs().max().item(),
        max((a - b).abs().max().item() for a, b in zip(got_grads, want_grads)),
    )
    print("graph breaks:", sum(counters["graph_break"].values()))
    print(f"max |compiled - eager| (logits and gradients): {diff:.3g}")
    return diff


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    MAX_DIFF = main(parser.parse_args().backend)
    if not MAX_DIFF < 1e-5:
        raise SystemExit(f"compiled model differs from eager by {MAX_DIFF}")
