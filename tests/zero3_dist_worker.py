"""One process of ``torchrun --standalone --nproc_per_node 2 tests/zero3_dist_worker.py CHECKPOINTS OUT PHASES``
(``DS_ACCELERATOR=cpu``, gloo): DeepSpeed ZeRO-3 switched on by ``TrainingArguments(deepspeed=...)`` *before* the
model is loaded, so ``from_pretrained`` builds it under ``deepspeed.zero.Init`` and loads it with Transformers'
ZeRO-3 loader (the normal path of a Trainer run).

``CHECKPOINTS`` is a JSON file ``{name: checkpoint folder}`` (:func:`make_checkpoints`). ``PHASES``
(comma-separated) ``<kind>:<checkpoint>:<how>``, where ``how`` is a recipe name or one of :data:`USER_CASES`:

* ``load``: rank 0 writes ``OUT/load-<checkpoint>-<how>.pt``: ``{"state": the gathered model state dict,
  "original": the gathered checkpoint layout (``iter_original_state_dict`` under ``GatheredParameters``),
  "patch_report"/"conversion_report": the reports, "ungathered": what ``iter_original_state_dict`` raised outside
  ``GatheredParameters``, "patch_model": what the linear-experts recipe's ``patch`` raised on the unpatched
  qwen2_moe, "error": what the load raised, or None}``;
* ``train`` (at most one per process: accelerate allows one DeepSpeed ``Accelerator`` per process): the loaded model
  trains ``STEPS`` steps of SGD with ``transformers.Trainer`` (rows in order, each rank one sequence of ``TOKENS``
  tokens a step) and saves with ``stage3_gather_16bit_weights_on_model_save`` into ``OUT/train-<checkpoint>-<how>/``;
  rank 0 writes ``OUT/train-<checkpoint>-<how>.pt``: the final weights in the checkpoint layout (gathered), and
  under ``"steps"`` the step it started at, the steps it ran and the final global step;
  the Trainer checkpoints after each step into ``OUT/trainer/checkpoint-<step>``;
* ``resume`` (in another launch, after ``train``): the same run resumed from ``OUT/trainer/checkpoint-1`` (a new
  model loaded under ZeRO-3, DeepSpeed's own checkpoint of the engine); rank 0 writes ``OUT/resume-<checkpoint>-<how>.pt``;
* ``replay``: routing replay through a DeepSpeed engine (:func:`phase_replay`);
* ``sgd`` / ``sgd-offload``: SGD steps through a DeepSpeed engine, without / with ZeRO-3 ``offload_param`` to
  the CPU (:func:`phase_sgd`).

:func:`load` (the same code in one process without DeepSpeed) is the reference the test compares with.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS, TOKENS, ROWS = 2, 3, 4
LEARNING_RATE = 0.05


def ds_config() -> dict:
    """ZeRO-3 in fp32 (no mixed precision: the comparison with one process is exact up to reduction order)."""
    return {
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


def training_arguments(output_dir: str, **kwargs):
    """``TrainingArguments`` with ZeRO-3 switched on (this is what makes ``from_pretrained`` build under
    ``deepspeed.zero.Init``), after tests/helpers.py's accelerate workaround for a machine without a GPU."""
    import helpers

    helpers.accelerate_state_without_gpu("deepspeed")
    return helpers.distributed_training_arguments(output_dir, deepspeed=ds_config(), **kwargs)


USER_CASES = ("none", "user-qkv-rule", "qkv-without-rule")
"""Loads other than a recipe: unpatched; tests/conversion_models.py's fused-QKV attention with the user rule
``QKV_RULE``; the same attention without a rule (its ``qkv_proj`` cannot come from the checkpoint: refused)."""


def make_checkpoints(folder) -> dict[str, str]:
    """tests/train_dist_worker.py's qwen2_moe and llama checkpoints, a tiny mixtral (experts named
    ``block_sparse_moe.experts.{e}.w1/w2/w3`` in the checkpoint) and a tiny dots3_note_text, with distinct random
    experts."""
    from pathlib import Path

    from transformers import MixtralForCausalLM

    import linear_experts_support as les
    import train_dist_worker
    from helpers import tiny_mixtral_config
    from routing_models import tiny_config

    paths = train_dist_worker.make_checkpoints(Path(folder))
    torch.manual_seed(0)
    mixtral = MixtralForCausalLM(tiny_mixtral_config())
    with torch.no_grad():
        for _, experts in les._decorated(mixtral):
            les._randomize(experts, torch.Generator().manual_seed(1))
    paths["mixtral"] = str(Path(folder) / "mixtral")
    mixtral.save_pretrained(paths["mixtral"])
    # per-expert checkpoint keys that also are the per-expert model's keys, and a built-in expert fusion that no
    # rule of the recipe replaces (Transformers' ZeRO-3 loader would send them to the fused target)
    torch.manual_seed(0)
    dots = les._build(tiny_config("dots3_note_text", **les._four_experts("dots3_note_text")))
    for _, experts in les._decorated(dots):
        les._randomize(experts, torch.Generator().manual_seed(1))
    paths["dots3_note_text"] = str(Path(folder) / "dots3_note_text")
    dots.save_pretrained(paths["dots3_note_text"])
    return paths


def load(path: str, how: str):
    """The checkpoint at ``path`` loaded with the recipe (or user case) ``how``."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from conversion_models import QKV_RULE, FusedQKVAttention, patched
    from modelpatch import apply_conversion_rules
    from modelpatch.recipes import get_recipe

    if how == "none":
        block: contextlib.AbstractContextManager = contextlib.nullcontext()
    elif how == "user-qkv-rule":
        block = contextlib.ExitStack()
        block.enter_context(patched({"LlamaAttention": FusedQKVAttention}))
        block.enter_context(apply_conversion_rules({"llama": [QKV_RULE]}))
    elif how == "qkv-without-rule":
        block = patched({"LlamaAttention": FusedQKVAttention})
    else:
        block = get_recipe(how).apply()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with block:
            return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")


def reports(model) -> tuple[str, list]:
    from modelpatch import conversion_report, patch_report

    return str(patch_report(model)), [row.as_dict() for row in conversion_report(model)]


def gathered(model) -> tuple[dict, dict]:
    """The model's state dict and its checkpoint layout (``iter_original_state_dict``), gathered."""
    import deepspeed

    from modelpatch import iter_original_state_dict

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        original = {k: v.detach().clone() for k, v in iter_original_state_dict(model)}
    return state, original


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(3, 100, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def phase_load(paths: dict, out: str, name: str, recipe: str, args) -> None:
    from modelpatch import iter_original_state_dict

    result: dict = {"error": None}
    try:
        model = load(paths[name], recipe)
        result["state"], result["original"] = gathered(model)
        result["patch_report"], result["conversion_report"] = reports(model)
        result["ungathered"] = result["patch_model"] = None
        if recipe == "none" and name == "qwen2_moe":  # patching the partitioned model in place: refused
            from modelpatch.recipes import get_recipe

            try:
                get_recipe("qwen2_moe-linear-experts").patch(model)
            except Exception as e:  # noqa: BLE001 - reported to the test
                result["patch_model"] = f"{type(e).__name__}: {e}"
        try:  # outside GatheredParameters: partitions, refused
            dict(iter_original_state_dict(model))
        except Exception as e:  # noqa: BLE001 - reported to the test
            result["ungathered"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out, f"load-{name}-{recipe}.pt"))


def phase_train(paths: dict, out: str, name: str, recipe: str, args, resume: bool = False) -> None:
    import deepspeed

    import helpers
    from modelpatch import iter_original_state_dict

    model = load(paths[name], recipe).train()
    steps = helpers.StepCounter()
    trainer = helpers.in_order_trainer(model, args, Tokens(), callbacks=[steps])
    trainer.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-1") if resume else None)
    kind = "resume" if resume else "train"
    if not resume:
        trainer.save_model(os.path.join(out, f"train-{name}-{recipe}"))
    engine = trainer.model_wrapped
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        weights = {k: v.detach().float().clone() for k, v in iter_original_state_dict(engine.module)}
    if dist.get_rank() == 0:
        weights["steps"] = steps.as_dict(trainer)
        torch.save(weights, os.path.join(out, f"{kind}-{name}-{recipe}.pt"))


def replay_ids() -> torch.Tensor:
    """The batch of the replay phase: 2 sequences of ``TOKENS`` tokens, rank r's is row r."""
    return torch.randint(3, 100, (2, TOKENS), generator=torch.Generator().manual_seed(2))


def replay_steps(model, step, trace, ids, observer=None) -> list[dict]:
    """``STEPS`` SGD steps of ``model`` replaying ``trace`` on ``ids``; ``step(loss)`` does backward and the step.
    Returns per step the loss, the logits and whether the experts were called with the trace's indices."""
    from modelpatch.routing import replay_routing
    from routing_models import ExpertsObserver

    steps = []
    for _ in range(STEPS):
        with ExpertsObserver(observer or model) as seen, replay_routing(observer or model, trace):
            output = model(input_ids=ids, labels=ids)
        step(output.loss)
        steps.append(
            {
                "loss": output.loss.item(),
                "logits": output.logits.detach().clone(),
                "indices_equal": all(torch.equal(seen.indices(layer), trace[layer][0]) for layer in trace.layers)
                if trace.num_sequences == 1
                else None,
            }
        )
    return steps


def phase_replay(paths: dict, out: str, name: str, recipe: str, args) -> None:
    """Routing replay under ZeRO-3: the trace one process recorded on :func:`replay_ids` (``OUT/trace.pt``, written
    by the test), each rank replaying its row through a DeepSpeed engine (perturbed routers: natural routing would
    differ) for ``STEPS`` SGD steps; rank r writes ``OUT/replay-<checkpoint>-<how>.rank<r>.pt`` (steps, and the final
    weights in the checkpoint layout, gathered)."""
    import deepspeed

    from modelpatch import iter_original_state_dict
    from modelpatch.routing import RoutingTrace
    from routing_models import perturb_routers

    rank = dist.get_rank()
    model = load(paths[name], recipe).train()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        perturb_routers(model)  # the same perturbation on every rank; rank 0's is kept
    trace = RoutingTrace.load(os.path.join(out, "trace.pt")).select([rank])
    config = {**ds_config(), "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    config.update(train_batch_size=dist.get_world_size(), gradient_clipping=0.0, zero_allow_untested_optimizer=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(loss):
        engine.backward(loss)
        engine.step()

    steps = replay_steps(engine, step, trace, replay_ids()[rank : rank + 1], observer=model)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        weights = {k: v.detach().float().clone() for k, v in iter_original_state_dict(model)}
    torch.save({"steps": steps, "weights": weights}, os.path.join(out, f"replay-{name}-{recipe}.rank{rank}.pt"))


def sgd_rows(step: int) -> torch.Tensor:
    """The global batch of SGD step ``step`` of the ``sgd`` phases: rows ``2 step`` (rank 0) and ``2 step + 1``
    (rank 1) of :class:`Tokens`."""
    return Tokens().ids[2 * step : 2 * step + 2]


def phase_sgd(paths: dict, out: str, name: str, recipe: str, args, offload: bool = False) -> None:
    """``STEPS`` SGD steps through a DeepSpeed engine (``deepspeed.initialize``; the Trainer's accelerate allows one
    DeepSpeed run per process), each rank its row of :func:`sgd_rows`; rank 0 writes ``OUT/sgd-<checkpoint>-<how>.pt``
    (``sgd-offload-...`` with ``offload``): ``{"loaded": the gathered checkpoint layout after the load, "trained":
    after the steps, "error": what raised, or None}``.

    ``offload``: the load and the engine under ``offload_param`` to the CPU (ZeRO-3 parameter offload): a fresh
    ``HfDeepSpeedConfig`` for the load, the Trainer's restored afterwards."""
    import deepspeed
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, set_hf_deepspeed_config

    from modelpatch import iter_original_state_dict

    rank = dist.get_rank()
    config = {**ds_config(), "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    config.update(train_batch_size=dist.get_world_size(), gradient_clipping=0.0, zero_allow_untested_optimizer=True)
    if offload:
        config["zero_optimization"] = {**config["zero_optimization"], "offload_param": {"device": "cpu"}}
    result: dict = {"error": None}
    hf_config = HfDeepSpeedConfig(config) if offload else None  # switched on for this load (kept alive)
    try:
        model = load(paths[name], recipe).train()

        def checkpoint_layout() -> dict:
            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
                return {k: v.detach().float().clone() for k, v in iter_original_state_dict(model)}

        result["loaded"] = checkpoint_layout()
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        for step in range(STEPS):
            ids = sgd_rows(step)[rank : rank + 1]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        result["trained"] = checkpoint_layout()
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        if hf_config is not None:
            set_hf_deepspeed_config(args.hf_deepspeed_config)
    if rank == 0:
        torch.save(result, os.path.join(out, f"sgd{'-offload' if offload else ''}-{name}-{recipe}.pt"))


def main(checkpoints: str, out: str, phases: str) -> None:
    torch.set_num_threads(1)
    with open(checkpoints) as fh:
        paths = json.load(fh)
    args = training_arguments(os.path.join(out, "trainer"), learning_rate=LEARNING_RATE, max_steps=STEPS)
    for phase in phases.split(","):
        kind, name, recipe = phase.split(":")
        if kind == "resume":
            phase_train(paths, out, name, recipe, args, resume=True)
            continue
        if kind == "sgd-offload":
            phase_sgd(paths, out, name, recipe, args, offload=True)
            continue
        phases_by_kind = {"load": phase_load, "train": phase_train, "replay": phase_replay, "sgd": phase_sgd}
        phases_by_kind[kind](paths, out, name, recipe, args)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    # Every result the test reads is on disk now. At interpreter exit a DeepSpeed/gloo C++ thread is sometimes
    # still joinable, and std::terminate aborts the process ("terminate called without an active exception", a
    # SIGABRT seen once in a full suite): leave without running the finalizers. An error in main() still raises
    # above, with its exit status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
