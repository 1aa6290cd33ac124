"""Quantize a Mixture-of-Experts model expert by expert: calibrate every expert, load quantized, save, reload.

Transformers 5 stores each MoE layer's experts as two fused 3-D parameters, which weight quantizers (they walk
``nn.Linear`` modules) skip without a word: an unpatched Qwen3-MoE loaded with ``quantization_config`` keeps every
expert in full precision. Loaded with the ``qwen3_moe-linear-experts`` recipe, every expert is a set of
``nn.Linear``, so the quantizer quantizes every expert. The script:

1. builds a tiny Qwen3-MoE (8 experts, top-2) and saves it (no download; ``--model DIR`` takes your own
   checkpoint of that type),
2. collects calibration statistics (the per-input-channel absolute maximum of each expert Linear's input, what
   AWQ and SmoothQuant collect) inside ``modelpatch.calibrate_all_experts``: every expert sees every calibration
   token, also the experts no token is routed to, and the model's outputs do not change,
3. loads the checkpoint quantized inside the recipe (``--quantization torchao-int8`` (default), ``quanto-int8``,
   ``bnb-8bit``, ``bnb-4bit``), counts the quantized expert Linears (all of them) against an unpatched
   quantized load (none) and measures the logit error against full precision,
4. saves the quantized model and reloads it pre-quantized inside the recipe: the same logits, bit for bit (where
   the checkpoint's own layout cannot hold the quantized format, modelpatch refuses that save before writing and
   the patched layout is saved instead, ``save_original_format=False``, which the same recipe reloads).

    python examples/quantize_moe.py [--quantization NAME] [--model DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, QuantoConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

import modelpatch
from modelpatch.recipes import get_recipe

RECIPE = get_recipe("qwen3_moe-linear-experts")


def quantization_config(name: str):
    """The ``quantization_config`` of ``from_pretrained`` for ``name``."""
    if name == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    if name == "quanto-int8":
        return QuantoConfig(weights="int8")
    if name in ("bnb-8bit", "bnb-4bit"):
        return BitsAndBytesConfig(**{f"load_in_{name[4]}bit": True})
    raise SystemExit(f"unknown --quantization {name!r}: torchao-int8, quanto-int8, bnb-8bit, bnb-4bit")


def tiny_moe(path: str) -> None:
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)


def is_quantized(module: torch.nn.Module) -> bool:
    """A weight held by a quantizer: a tensor subclass (torchao, quanto), a bitsandbytes parameter class, or integers."""
    weight = getattr(module, "weight", None)
    return weight is not None and (
        type(weight) not in (torch.Tensor, torch.nn.Parameter) or not weight.is_floating_point()
    )


def expert_linears(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if ".experts." in name and hasattr(m, "weight")}


def calibrate(model, calibration_ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """Per-input-channel absmax of every expert Linear's input over ``calibration_ids`` (calibration mode), and how
    many expert Linears a plain forward would have left without any data."""
    stats: dict[str, torch.Tensor] = {}

    def observe(name):
        def hook(module, args, output):
            x = args[0].detach().abs().amax(dim=0)
            stats[name] = torch.maximum(stats[name], x) if name in stats else x

        return hook

    handles = [m.register_forward_hook(observe(n)) for n, m in expert_linears(model).items()]
    with torch.no_grad():
        plain = model(calibration_ids).logits
        starved = len(expert_linears(model)) - len(stats)
        stats.clear()
        with modelpatch.calibrate_all_experts(model):
            calibrated = model(calibration_ids).logits
    for handle in handles:
        handle.remove()
    assert (calibrated - plain).abs().max() <= 1e-6, "calibration changed the outputs"
    return stats, starved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="torchao-int8")
    parser.add_argument("--model", help="a Qwen3-MoE checkpoint (default: a tiny one built here)")
    parser.add_argument("--out", help="where the quantized model is saved (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = args.model or os.path.join(scratch, "model")
        if args.model is None:
            tiny_moe(path)
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
        # a deliberately small calibration batch: 3 tokens x top-2 cannot reach all 8 experts of a layer
        calibration_ids = ids[:1, :3]

        with RECIPE.apply():
            full = AutoModelForCausalLM.from_pretrained(path).eval()
        stats, starved = calibrate(full, calibration_ids)
        print(
            f"calibration: {len(stats)} expert Linears observed on every token ({starved} get none in a plain forward)"
        )

        unpatched = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quantization_config(args.quantization)
        )
        with RECIPE.apply():
            quantized = AutoModelForCausalLM.from_pretrained(
                path, quantization_config=quantization_config(args.quantization)
            ).eval()
        experts = expert_linears(quantized)
        done = sum(is_quantized(m) for m in experts.values())
        unpatched_done = sum(is_quantized(m) for m in expert_linears(unpatched).values())
        with torch.no_grad():
            error = (quantized(ids).logits - full(ids).logits).abs().max().item()
        print(
            f"{args.quantization}: {done}/{len(experts)} expert Linears quantized (unpatched load: {unpatched_done});"
            f" max logit error vs full precision {error:.4f}"
        )

        out = args.out or os.path.join(scratch, "quantized")
        same = True
        if not quantized.hf_quantizer.is_serializable():  # optimum-quanto: Transformers cannot save it
            print(f"{args.quantization}: Transformers does not save this format; nothing saved")
        else:
            same = save_and_reload(quantized, out, ids)
    ok = len(stats) == len(experts) and starved > 0 and done == len(experts) and unpatched_done == 0 and same
    return 0 if ok else 1


def save_and_reload(quantized, out: str, ids: torch.Tensor) -> bool:
    """Save in the checkpoint's layout (else the patched one), reload pre-quantized: are the logits identical?"""
    try:
        quantized.save_pretrained(out)
        layout = "checkpoint layout"
    except modelpatch.QuantizedSaveError as refused:
        print(f"original layout refused: {refused}")
        quantized.save_pretrained(out, save_original_format=False)
        layout = "patched layout"
    with RECIPE.apply():
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        same = torch.equal(reloaded(ids).logits, quantized(ids).logits)
    print(f"saved in the {layout}, reloaded pre-quantized: logits {'identical' if same else 'DIFFERENT'}")
    return same


if __name__ == "__main__":
    raise SystemExit(main())
