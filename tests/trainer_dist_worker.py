"""One process of ``accelerate launch --multi_gpu --num_processes 2 tests/trainer_dist_worker.py MODEL OUT PHASES``
(``TrainingArguments(use_cpu=True)``: accelerate's multi-CPU mode, gloo; ``--cpu`` alone would start one process
without mpirun): a real ``transformers.Trainer`` run of a patched tiny qwen2_moe (``qwen2_moe-full-example``: fused
QKV + per-expert linear experts) under ``DistributedDataParallel(find_unused_parameters=False)``, one sequence of 3
tokens per rank and step, so a rank leaves experts idle.

``PHASES`` (comma-separated), each in its own output folder ``OUT/<phase>``:

* ``full``: 4 steps, checkpoints at steps 2 and 4;
* ``resume``: the same run resumed from ``OUT/full/checkpoint-2`` (a new model loaded from MODEL, then the
  Trainer's ``resume_from_checkpoint``);
* ``unpatched``: the ``full`` run on the unpatched model.

Rank 0 writes ``OUT/<phase>.pt``: the final weights in the checkpoint layout, and per rank ``OUT/<phase>.rank<r>.json``
what it observed (steps run in this process, the step it started at, idle experts, a checksum of its weights).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

RECIPE = "qwen2_moe-full-example"
ROWS, TOKENS = 8, 3


class Tokens(torch.utils.data.Dataset):
    """``ROWS`` sequences of ``TOKENS`` token ids, labels the ids (causal LM loss)."""

    def __init__(self) -> None:
        self.ids = torch.randint(3, 100, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _load(path: str, patched: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from modelpatch.recipes import get_recipe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not patched:
            return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        with get_recipe(RECIPE).apply():
            return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")


def _phase(model_dir: str, out: str, phase: str) -> None:
    from transformers import Trainer, TrainingArguments

    import helpers
    import training_parity as tp
    from routing_models import ExpertsObserver

    model = _load(model_dir, phase != "unpatched").train()
    args = TrainingArguments(
        output_dir=os.path.join(out, phase),
        per_device_train_batch_size=1,
        learning_rate=1e-2,
        max_steps=4,
        save_steps=2,
        save_strategy="steps",
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    steps = helpers.StepCounter()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[steps])
    num_experts = model.config.num_experts
    with ExpertsObserver(model) as seen:
        resume = os.path.join(out, "full", "checkpoint-2") if phase == "resume" else None
        trainer.train(resume_from_checkpoint=resume)
    idle = sum(
        int((torch.bincount(idx.flatten(), minlength=num_experts + 1)[:num_experts] == 0).sum())
        for calls in seen.calls.values()
        for idx, _ in calls
    )
    rank = trainer.accelerator.process_index
    weights = tp.original_state(trainer.model)
    if rank == 0:
        torch.save(weights, os.path.join(out, f"{phase}.pt"))
    with open(os.path.join(out, f"{phase}.rank{rank}.json"), "w") as fh:
        json.dump(
            {
                "world": trainer.accelerator.num_processes,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "wrapper": type(trainer.model_wrapped).__name__,
                "find_unused_parameters": getattr(trainer.model_wrapped, "find_unused_parameters", None),
                "started_at": steps.started_at,
                "steps_run": steps.run,
                "global_step": trainer.state.global_step,
                "idle_expert_calls": idle,
                "checksum": float(sum(v.double().sum() for v in weights.values())),
            },
            fh,
        )


def main(model_dir: str, out: str, phases: str) -> None:
    torch.set_num_threads(1)
    for phase in phases.split(","):
        _phase(model_dir, out, phase)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
