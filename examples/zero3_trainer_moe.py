"""Fine-tune a patched Mixture-of-Experts model with DeepSpeed ZeRO-3 through ``transformers.Trainer``.

The normal ZeRO-3 path: ``TrainingArguments(deepspeed=...)`` comes first, so ``from_pretrained`` builds the model
under ``deepspeed.zero.Init`` (each parameter partitioned across the processes as soon as it is built) and loads it
with Transformers' ZeRO-3 loader; the ``qwen2_moe-full-example`` recipe (fused QKV + per-expert ``nn.Linear``
experts) is applied while it is built and modelpatch converts the checkpoint before that loader reads it. The
script:

1. builds a tiny Qwen2-MoE checkpoint (no download; ``--model DIR`` takes your own checkpoint of that type),
2. starts itself on 2 processes with ``torchrun`` (``DS_ACCELERATOR=cpu`` and gloo when there is no GPU),
3. loads the checkpoint patched under ZeRO-3, checks that the gathered weights equal the checkpoint,
4. trains 2 steps with the Trainer and saves with ``stage3_gather_16bit_weights_on_model_save``; back in this
   process: the file has exactly the checkpoint's keys (q/k/v and per-expert tensors), which plain Transformers
   loads.

    python examples/zero3_trainer_moe.py [--model DIR] [--out DIR]

Needs ``pip install -e ".[deepspeed]"``. On a machine without a GPU DeepSpeed compiles one CPU op the first time
(a few minutes; ``python tests/deepspeed_warmup.py`` does it up front).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings

import torch

RECIPE = "qwen2_moe-full-example"


def tiny_checkpoint(folder: str) -> str:
    """A tiny random Qwen2-MoE (4 experts, top-2) saved under ``folder``."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(config).save_pretrained(folder)
    return folder


def train(model_dir: str, out: str) -> None:
    """One of the 2 processes: ZeRO-3 on, load patched, check, train, save."""
    import deepspeed
    from accelerate import PartialState
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from modelpatch import iter_original_state_dict
    from modelpatch.recipes import get_recipe

    if not torch.cuda.is_available():
        # accelerate 1.15/1.16 without a GPU counts 1 process under DeepSpeed: give it the distributed state first
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    ds_config = {
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
    }
    args = TrainingArguments(  # first: from_pretrained below builds under deepspeed.zero.Init
        output_dir=os.path.join(out, "run"),
        deepspeed=ds_config,
        accelerator_config={"use_configured_state": not torch.cuda.is_available()},
        per_device_train_batch_size=1,
        max_steps=2,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    with warnings.catch_warnings(), get_recipe(RECIPE).apply():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir)

    checkpoint = load_file(os.path.join(model_dir, "model.safetensors"))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        gathered = dict(iter_original_state_dict(model))  # the checkpoint layout of the patched, partitioned model
        assert type(model.model.layers[0].self_attn).__name__ != "Qwen2MoeAttention"  # patched: fused QKV
        assert all(torch.equal(gathered[k], v) for k, v in checkpoint.items()), "the load differs from the checkpoint"

    ids = torch.randint(3, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    if trainer.accelerator.is_main_process:
        print(
            f"trained {trainer.state.global_step} steps under ZeRO-3 on {trainer.accelerator.num_processes} processes"
        )


def check_saved(model_dir: str, out: str) -> None:
    """In this process (no DeepSpeed): the Trainer's save has exactly the checkpoint's keys, plain Transformers loads
    it, and the training moved the weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    checkpoint = load_file(os.path.join(model_dir, "model.safetensors"))
    saved = load_file(os.path.join(out, "final", "model.safetensors"))
    assert saved.keys() == checkpoint.keys(), sorted(set(saved) ^ set(checkpoint))[:4]
    _, info = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    moved = max((saved[k].float() - checkpoint[k].float()).abs().max().item() for k in saved)
    assert moved > 0, "the training did not move the weights"
    print(
        f"saved {len(saved)} tensors in the checkpoint's layout (max change {moved:.2e}); plain Transformers loads them"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Qwen2-MoE checkpoint folder (default: a tiny random one)")
    parser.add_argument("--out", help="output folder (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_checkpoint(os.path.join(tmp, "checkpoint"))
        out = args.out or os.path.join(tmp, "out")
        env = dict(os.environ)
        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        command += [os.path.abspath(__file__), "--worker", model_dir, out]
        status = subprocess.run(command, env=env, timeout=600).returncode
        if status == 0:
            check_saved(model_dir, out)
        return status


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        train(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
