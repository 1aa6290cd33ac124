"""DeepSpeed ZeRO-3, the normal path: ``TrainingArguments(deepspeed=...)`` first, so ``from_pretrained`` builds the
model under ``deepspeed.zero.Init`` and loads it with Transformers' ZeRO-3 loader (2 CPU processes, gloo,
``DS_ACCELERATOR=cpu``; DeepSpeed 0.19.8, the ``deepspeed`` extra).

A ``torchrun --standalone --nproc_per_node 2`` launch of tests/zero3_dist_worker.py loads tiny checkpoints with
the linear-experts recipes of qwen2_moe, mixtral and dots3_note_text, the fused-QKV recipe, the full example, a
user rule (fused QKV), no patch, and a fused-QKV patch without its rule; trains the full example (fused QKV +
per-expert linear experts) with ``transformers.Trainer`` and saves it; replays routing; a second launch resumes the
Trainer run. Checked here against the same work in this process without DeepSpeed:

* the gathered weights (model layout, and checkpoint layout through ``iter_original_state_dict``) equal a plain load
  exactly, and the patch and conversion reports are the same;
* ``iter_original_state_dict`` outside ``GatheredParameters`` (partitions of shape ``(0,)``) is refused;
* ``patch_model`` of a model loaded unpatched under ZeRO-3 is refused (``InstancePatchError``);
* a patch whose parameters the checkpoint cannot fill is refused while loading (``ConversionError`` naming the
  module), as without DeepSpeed, instead of training ``__init__`` values;
* routing recorded by one process on both sequences and replayed through a DeepSpeed engine on 2 ranks (each its
  row, perturbed routers) gives the same logits, expert indices and, after 2 SGD steps, weights as one process
  replaying the whole trace;
* 2 SGD steps (each rank one sequence of 3 tokens) equal one process on the whole batch; the Trainer's save
  (``stage3_gather_16bit_weights_on_model_save``) writes exactly the checkpoint's keys, the trained values, and
  plain Transformers loads it without missing or unexpected keys; a second launch resumes from the Trainer's
  checkpoint after step 1 (DeepSpeed's engine checkpoint) to the uninterrupted run's weights, bit for bit.

Measured 2026-12-04 (2 CPU processes): gathered weights max abs diff 0.0 in every case; training max abs diff
against one process 1.6e-07 (bound 1e-5; the steps moved weights by up to 0.12); routing replay on 2 ranks against
one process: logits 3.0e-07, weights after 2 SGD steps 1.2e-07 (the perturbed routers would route all 12
token-layer expert sets otherwise); resume max abs diff 0.0. The test takes 35-80 s on 2 shared cores once
DeepSpeed's CPU op is built (tests/deepspeed_warmup.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import helpers
import zero3_dist_worker as worker

LAUNCH_TIMEOUT = 300  # seconds per launch (measured 25-40 s, the resume launch 20-30 s, once DeepSpeed's CPU op is built; building it: ~3 min on 2 cores)
SGD_BOUND = 1e-5
LOADS = [
    ("qwen2_moe", "qwen2_moe-linear-experts"),
    ("mixtral", "mixtral-linear-experts"),
    ("dots3_note_text", "dots3_note_text-linear-experts"),  # was refused: a built-in fusion took its expert keys
    ("llama", "llama-fused-qkv"),
    ("qwen2_moe", "qwen2_moe-full-example"),
    ("llama", "user-qkv-rule"),
    ("qwen2_moe", "none"),
]
REFUSED = ("llama", "qkv-without-rule")
TRAINED = ("qwen2_moe", "qwen2_moe-full-example")
REPLAYED = ("qwen2_moe", "qwen2_moe-linear-experts")


def _launch(out: Path) -> str:
    """The torchrun launch, its results written under ``out``; returns what went wrong (empty when nothing did)."""
    # required, never skipped (the test extra installs it); not imported here: the workers import it
    assert importlib.util.find_spec("deepspeed") is not None, (
        "DeepSpeed is not installed: pip install -e '.[deepspeed]'"
    )

    from modelpatch.routing import record_routing

    paths = worker.make_checkpoints(out / "checkpoints")
    (out / "checkpoints.json").write_text(json.dumps(paths))
    model = worker.load(paths[REPLAYED[0]], REPLAYED[1])
    with torch.no_grad(), record_routing(model) as trace:  # one process, both sequences
        model(worker.replay_ids())
    trace.save(out / "trace.pt")
    phases = [f"load:{name}:{how}" for name, how in [*LOADS, REFUSED]] + [f"train:{TRAINED[0]}:{TRAINED[1]}"]
    phases.append(f"replay:{REPLAYED[0]}:{REPLAYED[1]}")
    # a second launch resumes the Trainer run (accelerate allows one DeepSpeed Accelerator per process)
    return _torchrun(out, phases) or _torchrun(out, [f"resume:{TRAINED[0]}:{TRAINED[1]}"])


def _torchrun(out: Path, phases: list[str]) -> str:
    command = helpers.torchrun_command(Path(__file__).with_name("zero3_dist_worker.py"))
    command += [str(out / "checkpoints.json"), str(out), ",".join(phases)]
    return helpers.launch(command, LAUNCH_TIMEOUT, env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.slow
def test_zero3_loads_trains_saves_resumes_and_replays_like_one_process(tmp_path):
    """One test, so that under pytest-xdist one worker runs the launches while the other goes on with other tests."""
    failed = _launch(tmp_path)
    assert not failed, failed
    zero3 = tmp_path, json.loads((tmp_path / "checkpoints.json").read_text())
    _check_loads(zero3)
    _check_training(zero3)
    _check_replay(zero3)


def _max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def _check_loads(zero3) -> None:
    """Loads equal a plain load; what cannot be filled, exported or sharded is refused."""
    from modelpatch import iter_original_state_dict

    out, paths = zero3
    for name, how in LOADS:
        got = torch.load(out / f"load-{name}-{how}.pt", weights_only=False)
        assert got["error"] is None, (name, how, got["error"])
        plain = worker.load(paths[name], how)
        assert _max_diff(got["state"], plain.state_dict()) == 0.0, (name, how)
        assert _max_diff(got["original"], dict(iter_original_state_dict(plain))) == 0.0, (name, how)
        assert (got["patch_report"], got["conversion_report"]) == worker.reports(plain), (name, how)
        if how != "none":
            assert got["conversion_report"] or "linear-experts" in how, (name, how)  # the user rule converted
        # outside GatheredParameters the parameters are partitions: exporting them is refused, not empty tensors
        assert got["ungathered"].startswith("ConversionError") and "ZeRO-3 partitions" in got["ungathered"], got
    # patch_model on a partitioned model would move (0,)-shaped partitions: refused, naming a parameter
    unpatched = torch.load(out / "load-qwen2_moe-none.pt", weights_only=False)["patch_model"]
    assert unpatched.startswith("InstancePatchError") and "ZeRO-3 partitions ('model.embed_tokens.weight'" in unpatched
    # the experts recipe and the user rule changed the layout: the comparison is not of two unpatched models
    experts = torch.load(out / "load-qwen2_moe-qwen2_moe-linear-experts.pt", weights_only=False)["state"]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in experts
    fused = torch.load(out / "load-llama-user-qkv-rule.pt", weights_only=False)["state"]
    assert fused["model.layers.1.self_attn.qkv_proj.weight"].shape == (128, 64)  # 64 + 32 + 32 rows

    refused = torch.load(out / f"load-{REFUSED[0]}-{REFUSED[1]}.pt", weights_only=False)
    assert refused["error"].startswith("ConversionError"), refused["error"]
    assert "model.layers.0.self_attn (FusedQKVAttention replacing LlamaAttention): qkv_proj.weight" in refused["error"]


def _check_training(zero3) -> None:
    """The Trainer trains like one process, saves the checkpoint layout and resumes exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import training_parity as tp

    out, paths = zero3
    name, how = TRAINED
    trained = torch.load(out / f"train-{name}-{how}.pt", weights_only=False)
    resumed = torch.load(out / f"resume-{name}-{how}.pt", weights_only=False)
    assert trained.pop("steps") == {"started_at": 0, "run": worker.STEPS, "global_step": worker.STEPS}
    # resumed from checkpoint-1 (DeepSpeed's engine checkpoint) in new processes: the uninterrupted run, bit for bit
    assert resumed.pop("steps") == {"started_at": 1, "run": worker.STEPS - 1, "global_step": worker.STEPS}
    assert _max_diff(resumed, trained) == 0.0

    # one process, the unpatched model, the whole batch of each step (both ranks' rows), the same SGD
    torch.manual_seed(0)
    reference = worker.load(paths[name], "none").train()
    start = tp.original_state(reference)
    ids = worker.Tokens().ids
    optimizer = torch.optim.SGD(reference.parameters(), lr=worker.LEARNING_RATE)
    for step in range(worker.STEPS):
        batch = ids[2 * step : 2 * step + 2]
        optimizer.zero_grad()
        reference(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    want = tp.original_state(reference)
    assert _max_diff(trained, want) <= SGD_BOUND
    assert _max_diff(trained, start) > 100 * SGD_BOUND  # the steps moved the weights

    saved_dir = out / f"train-{name}-{how}"
    saved = load_file(saved_dir / "model.safetensors")
    checkpoint = load_file(Path(paths[name]) / "model.safetensors")
    assert saved.keys() == checkpoint.keys()  # q/k/v and per-expert keys, not qkv_proj or fused experts
    assert _max_diff(saved, trained) == 0.0
    assert load_file(out / "trainer" / "checkpoint-1" / "model.safetensors").keys() == checkpoint.keys()
    _, info = AutoModelForCausalLM.from_pretrained(saved_dir, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()


def _check_replay(zero3) -> None:
    """Routing recorded in one process, replayed on 2 ranks under ZeRO-3, equals one process replaying it."""
    import training_parity as tp
    from modelpatch.routing import RoutingTrace, record_routing
    from routing_models import perturb_routers

    out, paths = zero3
    name, how = REPLAYED
    ranks = [torch.load(out / f"replay-{name}-{how}.rank{r}.pt", weights_only=False) for r in (0, 1)]
    trace = RoutingTrace.load(out / "trace.pt")  # recorded by one process on both rows, unperturbed routers

    # one process: the perturbed model replaying the whole trace on both rows, the same SGD steps
    model = worker.load(paths[name], how).train()
    perturb_routers(model)
    ids = worker.replay_ids()
    with torch.no_grad(), record_routing(model) as natural:
        model(ids)
    # the perturbed routers route otherwise: replay is what makes the runs agree
    assert sum(int((a != b).any(-1).sum()) for layer in trace.layers for a, b in zip(natural[layer], trace[layer]))
    start = tp.original_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=worker.LEARNING_RATE)

    def step(loss):
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    single = worker.replay_steps(model, step, trace, ids)
    for rank, got in enumerate(ranks):
        for mine, whole in zip(got["steps"], single):
            assert mine["indices_equal"], rank  # the experts were called with this rank's row of the trace
            assert (mine["logits"] - whole["logits"][rank : rank + 1]).abs().max().item() <= 1e-5, rank
        assert abs(sum(r["steps"][-1]["loss"] for r in ranks) / 2 - single[-1]["loss"]) <= 1e-5
        assert _max_diff(got["weights"], tp.original_state(model)) <= SGD_BOUND, rank
    assert _max_diff(ranks[0]["weights"], start) > 100 * SGD_BOUND  # the steps moved the weights
