"""FSDP2 through accelerate: ``accelerate launch --use_fsdp --fsdp_version 2`` of 2 CPU processes (gloo), the model
loaded with a recipe after accelerate switched FSDP on, sharded by ``accelerator.prepare`` / the Trainer.

Two launches of tests/fsdp2_dist_worker.py, one per loading mode:

* ``cpu_ram_efficient_loading`` on, ``FULL_STATE_DICT``: Transformers' ``is_fsdp_enabled()`` is true while loading
  (the ranks other than 0 leave missing keys on ``meta`` and skip initialisation), and accelerate moves those
  ranks' models to ``meta`` and broadcasts rank 0's ``model.state_dict()`` into the shards (rank 1 zeroes its
  weights first: what it ends with can only be rank 0's converted tensors);
* ``cpu_ram_efficient_loading`` off, ``SHARDED_STATE_DICT``: every rank keeps its own load; the Trainer's
  checkpoints are torch.distributed.checkpoint (DCP) folders.

In each: tiny qwen2_moe and llama checkpoints loaded with the linear-experts recipe, the fused-QKV recipe, the full
example, a user rule (fused QKV) and a fused-QKV patch without its rule; the full example trains 2 SGD steps
(momentum 0.9) with ``transformers.Trainer``, each rank one sequence of 3 tokens a step, checkpointing after each
step, saves with ``Trainer.save_model`` (under ``SHARDED_STATE_DICT`` after ``fsdp_plugin.set_state_dict_type(
"FULL_STATE_DICT")``, as Transformers documents: ``save_model`` writes no weights under ``SHARDED_STATE_DICT``), and
a new model and Trainer resume from ``checkpoint-1``. Checked against the same work in this process without FSDP:

* gathered weights (model layout, and the checkpoint layout through ``iter_original_state_dict``, of the gathered
  state dict and of the sharded model itself) equal a plain load exactly; patch and conversion reports equal;
* the patch without its rule is refused while loading (``ConversionError`` naming the module), as in one process;
* training equals one process on the whole batch (SGD bound 1e-5); the final ``save_model`` writes exactly the
  checkpoint's keys with the trained values, which plain Transformers loads without missing or unexpected keys;
  the resumed run ends with the uninterrupted run's weights bit for bit.

What the checkpoints hold (accelerate 1.16, Transformers 5.23): under ``FULL_STATE_DICT`` each ``checkpoint-N``
has ``model.safetensors`` (``save_model``: the original layout, checked) beside accelerate's resume files
``pytorch_model_fsdp.bin`` / ``optimizer.bin``; under ``SHARDED_STATE_DICT`` only the DCP folders
``pytorch_model_fsdp_0`` / ``optimizer_0`` (no ``model.safetensors``, no ``config.json``). Both resume files are
written from ``model.state_dict()``, i.e. in the model's own layout (``qkv_proj``; per-expert keys, which for
qwen2_moe are also the checkpoint's) and are read back by the same recipe; the unpatched model resuming from them
is refused before anything is loaded (``StateDictLayoutError`` naming ``resume_from_checkpoint``, the
``state_dict_type``, the file and the modules), where torch would fail on a bare ``KeyError`` (full) or a missing
key (DCP) after sharding.

On a machine without a GPU accelerate never switches to FSDP by itself: the workers use tests/helpers.py's
``accelerate_state_without_gpu("fsdp")`` (the comment there says why). The refusal of resume files of another layout
is also checked in this process, on both kinds of file (fast).

Measured 2026-12-05 (2 CPU processes): gathered weights max abs diff 0.0 in every case and mode; training against
one process 3.1e-07 (the steps moved weights by 0.23); resume 0.0; the same on Transformers 5.24 and 5.25
(accelerate 1.15). One launch takes 35-60 s on 2 shared cores.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import fsdp2_dist_worker as worker
import helpers
import zero3_dist_worker as z3

LAUNCH_TIMEOUT = 300  # seconds per launch (measured 35-60 s)
SGD_BOUND = 1e-5
LOADS = [
    ("qwen2_moe", "qwen2_moe-linear-experts"),
    ("llama", "llama-fused-qkv"),
    ("qwen2_moe", "qwen2_moe-full-example"),
    ("llama", "user-qkv-rule"),
]
REFUSED = ("llama", "qkv-without-rule")
TRAINED = ("qwen2_moe", "qwen2_moe-full-example")
MODES = {  # the launch options of each mode
    "ram-efficient-full": ["--fsdp_cpu_ram_efficient_loading", "true", "--fsdp_state_dict_type", "FULL_STATE_DICT"],
    "sharded": ["--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"],
}


def _launch(out: Path, mode: str) -> str:
    import train_dist_worker

    paths = train_dist_worker.make_checkpoints(out / "checkpoints")
    (out / "checkpoints.json").write_text(json.dumps(paths))
    phases = [f"load:{name}:{how}" for name, how in [*LOADS, REFUSED]]
    phases += [
        f"train:{TRAINED[0]}:{TRAINED[1]}",
        f"resume:{TRAINED[0]}:{TRAINED[1]}",
        f"crossresume:{TRAINED[0]}:none",
    ]
    options = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", *MODES[mode]]
    command = helpers.accelerate_command(*options)
    command += [str(Path(__file__).with_name("fsdp2_dist_worker.py")), str(out / "checkpoints.json"), str(out)]
    return helpers.launch([*command, ",".join(phases)], LAUNCH_TIMEOUT, log=out / "launch.log")


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp2_loads_trains_saves_and_resumes_like_one_process(tmp_path, mode):
    failed = _launch(tmp_path, mode)
    assert not failed, failed
    paths = json.loads((tmp_path / "checkpoints.json").read_text())
    _check_loads(tmp_path, paths, ram_efficient=mode == "ram-efficient-full")
    _check_training(tmp_path, paths, sharded_checkpoints=mode == "sharded")


def _max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def _check_loads(out: Path, paths: dict, ram_efficient: bool) -> None:
    from modelpatch import iter_original_state_dict

    for name, how in LOADS:
        ranks = [torch.load(out / f"load-{name}-{how}.rank{r}.pt", weights_only=False) for r in (0, 1)]
        plain = z3.load(paths[name], how)
        reports = z3.reports(plain)  # before iter_original_state_dict, which adds its save rows
        state, original = plain.state_dict(), dict(iter_original_state_dict(plain))
        for rank, got in enumerate(ranks):
            what = (name, how, rank)
            assert got["error"] is None, what + (got["error"],)
            # Transformers' switch: on with cpu_ram_efficient_loading (accelerate launch's environment) only
            assert got["is_fsdp_enabled"] is ram_efficient, what
            # every rank converted the checkpoint itself (Transformers 5.23 reads it on every rank either way)
            loaded = got["loaded"]
            assert None not in loaded.values(), what  # nothing left on meta: every parameter was in the checkpoint
            assert _max_diff(loaded, state) == 0.0, what
            assert (got["patch_report"], got["conversion_report"]) == reports, what
            assert got["sharded"] == sum(1 for _ in plain.parameters()), what  # every parameter an FSDP2 DTensor
            # the sharded model converted with DTensor operations, gathered (rank 1: its shards are rank 0's)
            assert _max_diff(got["sharded_original"], original) == 0.0, what
        assert _max_diff(ranks[0]["state"], state) == 0.0, (name, how)
        assert _max_diff(ranks[0]["original"], original) == 0.0, (name, how)
        if how != "qwen2_moe-linear-experts":
            assert ranks[0]["conversion_report"], (name, how)  # q/k/v were fused: not a comparison of plain loads
    fused = torch.load(out / "load-llama-user-qkv-rule.rank0.pt", weights_only=False)["state"]
    assert fused["model.layers.1.self_attn.qkv_proj.weight"].shape == (128, 64)  # 64 + 32 + 32 rows
    experts = torch.load(out / "load-qwen2_moe-qwen2_moe-linear-experts.rank0.pt", weights_only=False)["state"]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in experts

    for rank in (0, 1):  # refused on every rank while loading, as in one process: never __init__ values
        refused = torch.load(out / f"load-{REFUSED[0]}-{REFUSED[1]}.rank{rank}.pt", weights_only=False)["error"]
        assert refused.startswith("ConversionError"), refused
        assert "model.layers.0.self_attn (FusedQKVAttention replacing LlamaAttention): qkv_proj.weight" in refused


def _check_training(out: Path, paths: dict, sharded_checkpoints: bool) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import training_parity as tp

    name, how = TRAINED
    trained = torch.load(out / f"train-{name}-{how}.pt", weights_only=False)
    resumed = torch.load(out / f"resume-{name}-{how}.pt", weights_only=False)
    assert trained.pop("steps") == {"started_at": 0, "run": worker.STEPS, "global_step": worker.STEPS}
    assert resumed.pop("steps") == {"started_at": 1, "run": worker.STEPS - 1, "global_step": worker.STEPS}
    assert _max_diff(resumed, trained) == 0.0

    # one process, the unpatched model, the whole batch of each step (both ranks' rows), the same SGD
    reference = z3.load(paths[name], "none").train()
    start = tp.original_state(reference)
    ids = z3.Tokens().ids
    optimizer = torch.optim.SGD(reference.parameters(), lr=worker.LEARNING_RATE, momentum=worker.MOMENTUM)
    for step in range(worker.STEPS):
        batch = ids[2 * step : 2 * step + 2]
        optimizer.zero_grad()
        reference(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    assert _max_diff(trained, tp.original_state(reference)) <= SGD_BOUND
    assert _max_diff(trained, start) > 100 * SGD_BOUND  # the steps moved the weights

    saved_dir = out / f"train-{name}-{how}"
    saved = load_file(saved_dir / "model.safetensors")
    checkpoint = load_file(Path(paths[name]) / "model.safetensors")
    assert saved.keys() == checkpoint.keys()  # q/k/v and per-expert keys, not qkv_proj
    assert _max_diff(saved, trained) == 0.0
    _, info = AutoModelForCausalLM.from_pretrained(saved_dir, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()

    # the unpatched model resuming from accelerate's resume files (the patched model's own layout): refused before
    # anything is loaded, naming the option, the file and the modules (torch would fail on a bare key)
    for rank in (0, 1):
        crossed = torch.load(out / f"crossresume-{name}-none.rank{rank}.pt", weights_only=False)
        assert crossed["error"].startswith("StateDictLayoutError: resume_from_checkpoint="), crossed
        kind, file = (
            ("SHARDED_STATE_DICT", "pytorch_model_fsdp_0")
            if sharded_checkpoints
            else ("FULL_STATE_DICT", "pytorch_model_fsdp.bin")
        )
        assert f"under FSDP (state_dict_type {kind}): {file} holds 4 module(s)" in crossed["error"], crossed
        assert "model.layers.0.self_attn (Qwen2MoeAttention): the checkpoint has qkv_proj.bias" in crossed["error"]
        assert "model.layers.1.mlp.experts (Qwen2MoeExperts): the checkpoint has 0.down_proj.weight" in crossed["error"]

    first = out / f"trainer-{name}-{how}" / "checkpoint-1"
    if sharded_checkpoints:  # DCP folders only, in the model's own layout (read back by the same recipe)
        import torch.distributed.checkpoint as dcp

        assert not (first / "model.safetensors").exists()
        keys = dcp.FileSystemReader(str(first / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
        assert "model.model.layers.0.self_attn.qkv_proj.weight" in keys
    else:  # save_model's original layout beside accelerate's resume files
        assert load_file(first / "model.safetensors").keys() == checkpoint.keys()
        assert (first / "pytorch_model_fsdp.bin").exists()


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_fsdp_resume_files_of_another_layout_are_refused(tmp_path, kind):
    """accelerate's resume files as ``save_fsdp_model`` writes them from ``model.state_dict()`` (one process: the
    same keys as the sharded model's): ``torch.save`` of the full state dict, or a DCP folder of ``{"model": ...}``;
    the check runs before accelerate reads them. Same layout: nothing to refuse."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    from modelpatch.conversion.errors import StateDictLayoutError
    from modelpatch.integrations.trainer import check_fsdp_checkpoint_layout
    from modelpatch.recipes import get_recipe

    helpers.save_tiny(LlamaForCausalLM, helpers.tiny_llama_config(), tmp_path / "llama")
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    with get_recipe("llama-fused-qkv").apply():
        fused = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    checkpoint = tmp_path / "checkpoint-1"
    if kind == "FULL_STATE_DICT":
        checkpoint.mkdir()
        torch.save(fused.state_dict(), checkpoint / "pytorch_model_fsdp.bin")
    else:
        with warnings.catch_warnings():  # one process: torch.distributed is not initialised, as torch warns
            warnings.simplefilter("ignore")
            writer = dcp.FileSystemWriter(checkpoint / "pytorch_model_fsdp_0")
            dcp.save({"model": fused.state_dict()}, storage_writer=writer)
    check_fsdp_checkpoint_layout(fused, checkpoint, kind)  # its own layout: resumes
    with pytest.raises(StateDictLayoutError) as caught:
        check_fsdp_checkpoint_layout(plain, checkpoint, kind)
    message = str(caught.value)
    file = "pytorch_model_fsdp.bin" if kind == "FULL_STATE_DICT" else "pytorch_model_fsdp_0"
    assert (
        f"resume_from_checkpoint='{checkpoint}' under FSDP (state_dict_type {kind}): {file} holds 2 module(s)"
        in message
    )
    for layer in (0, 1):  # only the keys that differ (o_proj is in both layouts)
        assert (
            f"model.layers.{layer}.self_attn (LlamaAttention): the checkpoint has qkv_proj.weight, the model "
            "k_proj.weight, q_proj.weight, v_proj.weight\n" in message
        ), message
