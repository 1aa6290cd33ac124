"""LoRA fine-tuning of a patched MoE model with the Trainer, interrupted and resumed, then merged and saved.

Qwen3-MoE stores each layer's experts as fused 3-D tensors, which LoRA cannot target expert by expert. Loaded
with the ``qwen3_moe-linear-experts`` recipe every expert is a set of ``nn.Linear``, so PEFT adapts each expert's
``gate_proj``/``up_proj``/``down_proj`` like any other layer. The script:

1. builds a tiny Qwen3-MoE from a config and saves it (no download; pass ``--model DIR`` for your own checkpoint),
2. loads it with the recipe and wraps it with LoRA on attention and every expert Linear,
3. trains 4 steps with the Trainer (checkpoints every 2), then trains again resuming from ``checkpoint-2`` and
   checks that the resumed adapter equals the uninterrupted one (max diff 0),
4. merges the adapter (``merge_and_unload``) and saves: the folder is in the original layout, which plain
   Transformers loads, with the same logits.

    python examples/lora_finetune_moe.py [--model DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, Trainer, TrainingArguments

from modelpatch.recipes import get_recipe

RECIPE = "qwen3_moe-linear-experts"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class RandomTokens(torch.utils.data.Dataset):
    """``n`` sequences of ``length`` random token ids (labels = inputs): stands in for a tokenized corpus."""

    def __init__(self, vocab_size: int, n: int = 16, length: int = 16, seed: int = 0):
        self.ids = torch.randint(0, vocab_size, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_checkpoint(folder: str) -> str:
    """A 2-layer Qwen3-MoE (hidden 64, 4 experts, top-2) saved to ``folder``."""
    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    return folder


def lora_model(checkpoint: str):
    with get_recipe(RECIPE).apply():
        base = AutoModelForCausalLM.from_pretrained(checkpoint)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))


def train(checkpoint: str, out: str, resume: str | None = None):
    model = lora_model(checkpoint)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        max_steps=4,
        save_steps=2,
        logging_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(model.config.vocab_size))
    trainer.train(resume_from_checkpoint=resume)
    return model


def adapter_state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a tiny Qwen3-MoE built here)")
    parser.add_argument("--out", help="output folder (default: a temporary folder, removed at the end)")
    args = parser.parse_args(argv)
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="modelpatch-lora-") as out:
            return run(args.model, out)
    return run(args.model, args.out)


def run(model: str | None, out: str) -> int:
    checkpoint = model or tiny_checkpoint(os.path.join(out, "base"))

    full = train(checkpoint, os.path.join(out, "full"))
    experts = [k for k in adapter_state(full) if ".experts." in k and "lora_A" in k]
    print(f"LoRA on {len(adapter_state(full)) // 2} Linear layers, {len(experts)} of them expert Linears")

    resumed = train(checkpoint, os.path.join(out, "resumed"), resume=os.path.join(out, "full", "checkpoint-2"))
    a, b = adapter_state(full), adapter_state(resumed)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"resumed from checkpoint-2 vs uninterrupted: max adapter diff {diff:.3g}")

    merged = full.merge_and_unload().eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = merged(ids).logits
    merged.save_pretrained(os.path.join(out, "merged"))
    plain = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged")).eval()  # no recipe: original layout
    with torch.no_grad():
        plain_diff = (plain(ids).logits - want).abs().max().item()
    print(f"merged model saved to {os.path.join(out, 'merged')}; plain Transformers logits diff {plain_diff:.3g}")
    return 0 if experts and diff == 0.0 and plain_diff < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
