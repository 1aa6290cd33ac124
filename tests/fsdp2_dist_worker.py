"""One process of ``accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 tests/fsdp2_dist_worker.py
CHECKPOINTS OUT PHASES`` (2 CPU processes, gloo): FSDP2 switched on by ``accelerate launch`` (its environment:
``ACCELERATE_USE_FSDP``, ``FSDP_CPU_RAM_EFFICIENT_LOADING``, ``FSDP_STATE_DICT_TYPE``, ...) *before* the model is
loaded, as a user's training script runs.

With ``--fsdp_cpu_ram_efficient_loading true`` Transformers' ``is_fsdp_enabled()`` is true while the model loads, so
the ranks other than local rank 0 leave missing keys on ``meta`` and skip their initialisation, and accelerate's
``fsdp2_prepare_model`` moves those ranks' models to ``meta`` and broadcasts rank 0's ``model.state_dict()`` (the
model's own, converted layout) into the shards.

``CHECKPOINTS`` is a JSON file ``{name: checkpoint folder}`` (tests/train_dist_worker.py's qwen2_moe and llama).
``PHASES`` (comma-separated) ``<kind>:<checkpoint>:<how>``, ``how`` a recipe name or one of
tests/zero3_dist_worker.py's ``USER_CASES``:

* ``load``: each rank writes ``OUT/load-<checkpoint>-<how>.rank<r>.pt``: ``{"is_fsdp_enabled": Transformers'
  switch while loading, "loaded": the model state dict as loaded on this rank, before sharding (``meta`` tensors
  as None), "patch_report"/"conversion_report": the reports, "sharded": how many parameters are FSDP2
  ``DTensor``s after ``accelerator.prepare(model, optimizer)``, "state" (rank 0): the full state dict gathered
  after that (``accelerator.get_state_dict``), "original" (rank 0): its checkpoint layout
  (``iter_original_state_dict(model, state_dict=...)``), "sharded_original": ``iter_original_state_dict`` of the
  sharded model itself (``DTensor`` operations), gathered, "error": what the load raised, or None}``. With
  ``cpu_ram_efficient_loading`` rank 1 zeroes its parameters before ``prepare``: its shards must then come from
  rank 0's broadcast;
* ``train``: the loaded model trains ``STEPS`` steps of SGD with ``transformers.Trainer`` (rows in order, each rank
  one sequence a step), checkpointing after each step into ``OUT/trainer-<checkpoint>-<how>/checkpoint-<step>``,
  then saves with ``save_model`` into ``OUT/train-<checkpoint>-<how>/`` (under ``SHARDED_STATE_DICT`` after
  switching the plugin to ``FULL_STATE_DICT``, as Transformers' documentation says); rank 0 writes
  ``OUT/train-<checkpoint>-<how>.pt``: the final weights in the checkpoint layout, and under ``"steps"`` the step it
  started at, the steps it ran and the final global step;
* ``crossresume``: :func:`phase_crossresume`;
* ``resume``: a new model loaded from the checkpoint and a new Trainer resume the ``train`` run from its
  ``checkpoint-1``; rank 0 writes ``OUT/resume-<checkpoint>-<how>.pt`` likewise.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import helpers  # noqa: E402
import zero3_dist_worker as z3  # noqa: E402

STEPS, LEARNING_RATE = z3.STEPS, z3.LEARNING_RATE
MOMENTUM = 0.9
TRAINED_HOW = "qwen2_moe-full-example"
"""The recipe of the ``train`` run that ``crossresume`` resumes with another layout."""
"""SGD with momentum: the optimizer has a state to checkpoint and resume (torch 2.13's ``set_optimizer_state_dict``
of a full state dict fails on an optimizer without any: ``AssertionError: Expected device to be set``)."""


def _full_state(accelerator, model) -> dict:
    """The sharded model's full state dict (``accelerator.get_state_dict``: gathered, on every rank)."""
    return {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}


def fresh_wrap_policy() -> None:
    """Let accelerate's FSDP plugin choose the layers to shard for the next model: it is made for one model per
    process (``set_auto_wrap_policy`` fixes the first model's decoder layer class and policy), this worker prepares
    several models of different families in one process."""
    from accelerate.state import AcceleratorState
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    state = AcceleratorState()
    plugin = state.fsdp_plugin
    plugin.auto_wrap_policy, plugin.transformer_cls_names_to_wrap = transformer_auto_wrap_policy, None


def phase_load(paths: dict, out: str, name: str, how: str, args) -> None:
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor
    from transformers.modeling_utils import is_fsdp_enabled

    from modelpatch import iter_original_state_dict

    result: dict = {"error": None}
    try:
        model = z3.load(paths[name], how)
        result["is_fsdp_enabled"] = is_fsdp_enabled()  # Transformers' cpu_ram_efficient_loading switch
        result["loaded"] = {
            k: None if v.device.type == "meta" else v.detach().clone() for k, v in model.state_dict().items()
        }
        result["patch_report"], result["conversion_report"] = z3.reports(model)
        accelerator = Accelerator()
        fresh_wrap_policy()
        if accelerator.state.fsdp_plugin.cpu_ram_efficient_loading and dist.get_rank() != 0:
            with torch.no_grad():  # a witness: the shards must come from rank 0's model, not this one's
                for parameter in model.parameters():
                    parameter.zero_()
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        model, optimizer = accelerator.prepare(model, optimizer)
        result["sharded"] = sum(isinstance(p, DTensor) for p in model.parameters())
        state = _full_state(accelerator, model)  # rank 0 only (accelerate gathers to rank 0)
        if dist.get_rank() == 0:
            result["state"] = state
            result["original"] = dict(iter_original_state_dict(model, state_dict=state))
        # the sharded model converted as it is (DTensor operations), gathered
        result["sharded_original"] = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in iter_original_state_dict(model)
        }
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    torch.save(result, os.path.join(out, f"load-{name}-{how}.rank{dist.get_rank()}.pt"))


def phase_train(paths: dict, out: str, name: str, how: str, args, resume: bool = False) -> None:
    from accelerate.state import AcceleratorState

    from modelpatch import iter_original_state_dict

    model = z3.load(paths[name], how).train()
    if AcceleratorState._shared_state.get("fsdp_plugin") is not None:
        fresh_wrap_policy()
    steps = helpers.StepCounter()
    trainer = helpers.in_order_trainer(model, args, z3.Tokens(), callbacks=[steps])
    trainer.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-1") if resume else None)
    kind = "resume" if resume else "train"
    if not resume:
        plugin = trainer.accelerator.state.fsdp_plugin
        kept = plugin.state_dict_type
        plugin.set_state_dict_type("FULL_STATE_DICT")  # Trainer.save_model writes nothing under SHARDED_STATE_DICT
        trainer.save_model(os.path.join(out, f"train-{name}-{how}"))
        plugin.set_state_dict_type(kept)  # for the next phase of this process
    full = _full_state(trainer.accelerator, trainer.model_wrapped)
    weights = {k: v.detach().float().clone() for k, v in iter_original_state_dict(trainer.model, state_dict=full)}
    if dist.get_rank() == 0:
        weights["steps"] = steps.as_dict(trainer)
        torch.save(weights, os.path.join(out, f"{kind}-{name}-{how}.pt"))


def phase_crossresume(paths: dict, out: str, name: str, how: str, args) -> None:
    """The checkpoint loaded with ``how`` (another layout than :data:`TRAINED_HOW`'s) resuming the ``train`` run
    of :data:`TRAINED_HOW` from its ``checkpoint-1`` (accelerate's resume files: the trained model's own layout);
    each rank writes ``OUT/crossresume-<checkpoint>-<how>.rank<r>.pt``: ``{"error": what it raised, or None,
    "steps": what ran}``."""
    result: dict = {"error": None}
    try:
        model = z3.load(paths[name], how).train()
        fresh_wrap_policy()
        steps = helpers.StepCounter()
        trainer = helpers.in_order_trainer(model, args, z3.Tokens(), callbacks=[steps])
        trainer.train(resume_from_checkpoint=os.path.join(out, f"trainer-{name}-{TRAINED_HOW}", "checkpoint-1"))
        result["steps"] = steps.as_dict(trainer)
    except BaseException as e:  # noqa: BLE001 - reported to the test (torch's CheckpointException is a BaseException)
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    torch.save(result, os.path.join(out, f"crossresume-{name}-{how}.rank{dist.get_rank()}.pt"))


def main(checkpoints: str, out: str, phases: str) -> None:
    torch.set_num_threads(1)
    with open(checkpoints) as fh:
        paths = json.load(fh)
    helpers.accelerate_state_without_gpu("fsdp")
    for phase in phases.split(","):
        kind, name, how = phase.split(":")
        args = helpers.distributed_training_arguments(
            os.path.join(out, f"trainer-{name}-{how}"),
            learning_rate=LEARNING_RATE,
            optim_args=f"momentum={MOMENTUM}",
            max_steps=STEPS,
        )
        if kind == "resume":
            phase_train(paths, out, name, how, args, resume=True)
        elif kind == "crossresume":
            phase_crossresume(paths, out, name, how, args)
        else:
            {"load": phase_load, "train": phase_train}[kind](paths, out, name, how, args)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
