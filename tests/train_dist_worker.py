"""Worker of tests/test_distributed_training.py: one of 2 CPU processes (gloo) training tiny models under
``DistributedDataParallel(find_unused_parameters=False)`` and FSDP2 ``fully_shard``, each rank on its half of a
global batch, against one process on the whole batch; then routing record / replay under both wrappers.

Each scenario writes ``OUT/<scenario>.rank<r>.pt`` as soon as it is done, so a collective that hangs in a later
scenario (the test kills the workers after its timeout) still leaves the earlier figures to report.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FAMILIES = {"qwen2_moe": "qwen2_moe-linear-experts", "llama": "llama-fused-qkv"}
"""``{checkpoint folder name: layout-changing recipe}`` of the training scenarios."""

OPTIMIZER_NAMES = ("sgd", "adamw")
STEPS = 3
SEQ_LEN = 3  # per rank one sequence of 3 tokens: 6 top-2 slots over 4 experts, so ranks leave experts idle


def make_checkpoints(folder: Path) -> dict[str, str]:
    """Tiny qwen2_moe (4 experts of distinct random weights, top-2, routers spread) and llama checkpoints saved
    under ``folder``: ``{name: path}``."""
    from transformers import LlamaForCausalLM, Qwen2MoeForCausalLM

    import linear_experts_support as les
    from helpers import tiny_llama_config, tiny_qwen2_moe_config
    from routing_models import router_weight

    paths = {}
    torch.manual_seed(0)
    moe = Qwen2MoeForCausalLM(tiny_qwen2_moe_config())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, experts in les._decorated(moe):
            les._randomize(experts, generator)
        for module in moe.modules():
            if type(module).__name__.endswith("Router"):
                router_weight(module).normal_(0, 0.5, generator=generator)
    paths["qwen2_moe"] = str(folder / "qwen2_moe")
    moe.save_pretrained(paths["qwen2_moe"])
    torch.manual_seed(0)
    llama = LlamaForCausalLM(tiny_llama_config())
    paths["llama"] = str(folder / "llama")
    llama.save_pretrained(paths["llama"])
    return paths


@functools.cache
def load(path: str, recipe: str | None) -> torch.nn.Module:
    """The checkpoint at ``path`` loaded (with ``recipe``), once per process: callers train copies."""
    from transformers import AutoModelForCausalLM

    from modelpatch.recipes import get_recipe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if recipe is None:
            return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        with get_recipe(recipe).apply():
            return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")


def wrap(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    """``model`` under ``wrapper``: ``"single"`` (itself), ``"ddp"`` (``find_unused_parameters=False``) or
    ``"fsdp2"`` (``fully_shard`` on every per-expert module, every decoder layer, then the root)."""
    if wrapper == "single":
        return model
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, find_unused_parameters=False)
    from torch.distributed.fsdp import fully_shard

    from modelpatch.recipes.linear_experts import ExpertMLP

    for module in model.modules():
        if isinstance(module, ExpertMLP):
            fully_shard(module)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def original_weights(model: torch.nn.Module, wrapper: str) -> dict[str, torch.Tensor]:
    """The weights in the checkpoint layout (``iter_original_state_dict``), full fp32 copies; under FSDP2 the
    shards are gathered first (a collective: every rank calls it)."""
    from modelpatch import iter_original_state_dict

    state = None
    if wrapper == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in iter_original_state_dict(model, state_dict=state)}


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    import training_parity as tp

    return tp.OPTIMIZERS[name](params, tp.LEARNING_RATES[name])


def _hit_mask(seen, num_experts: int) -> torch.Tensor:
    """``(layers, E)`` bool: the experts each MoE layer routed a token to in the observed forward."""
    rows = []
    for layer in sorted(seen.calls):
        idx = seen.calls[layer][-1][0]
        rows.append(torch.bincount(idx.flatten(), minlength=num_experts + 1)[:num_experts] > 0)
    return torch.stack(rows) if rows else torch.zeros(0, num_experts, dtype=torch.bool)


def _idle_counts(local_hit: torch.Tensor) -> tuple[int, int]:
    """``local_hit`` (any shape, bool): this rank's (expert, layer, step) entries that routed a token. Returns
    ``(idle here, idle here but hit on another rank)`` (a collective: every rank calls it)."""
    total = local_hit.to(torch.int64)
    dist.all_reduce(total)
    return int((~local_hit).sum()), int(((~local_hit) & (total > 0)).sum())


def _trace_hits(trace, num_experts: int) -> torch.Tensor:
    """``(layers, E)`` bool: the experts a trace routes a token to, per MoE layer."""
    rows = [torch.bincount(torch.cat(trace[layer]).flatten(), minlength=num_experts) > 0 for layer in trace.layers]
    return torch.stack(rows)


def _sharded_experts(model: torch.nn.Module) -> int:
    """How many per-expert modules FSDP2 shards on their own."""
    from torch.distributed.fsdp import FSDPModule

    from modelpatch.recipes.linear_experts import ExpertMLP

    return sum(1 for m in model.modules() if isinstance(m, ExpertMLP) and isinstance(m, FSDPModule))


def _grads_missing(model: torch.nn.Module) -> int:
    return sum(1 for p in model.parameters() if p.requires_grad and p.grad is None)


def train_run(
    base: torch.nn.Module, wrapper: str, optimizer: str, batches: list[torch.Tensor], rank: int, world: int
) -> dict:
    """``STEPS`` steps of ``optimizer`` on a copy of ``base`` under ``wrapper`` (``single``: the whole global
    batch; else this rank's row). Returns the final checkpoint-layout weights and what the run observed."""
    from routing_models import ExpertsObserver

    model = copy.deepcopy(base).train()
    wrapped = wrap(model, wrapper)
    opt = _optimizer(optimizer, list(wrapped.parameters()))
    num_experts = getattr(model.config, "num_experts", 0) or 0
    hits, missing, losses = [], 0, []
    for ids in batches:
        mine = ids if wrapper == "single" else ids[rank : rank + 1]
        opt.zero_grad(set_to_none=True)
        with ExpertsObserver(model) as seen:
            loss = wrapped(input_ids=mine, labels=mine).loss
        loss.backward()
        missing += _grads_missing(model)
        if num_experts:
            hits.append(_hit_mask(seen, num_experts))
        opt.step()
        losses.append(float(loss.detach()))
    out = {"weights": original_weights(model, wrapper), "missing_grads": missing, "losses": losses}
    out["find_unused_parameters"] = getattr(wrapped, "find_unused_parameters", None)
    out["sharded_experts"] = _sharded_experts(model)
    if num_experts and wrapper != "single":
        out["idle_here"], out["idle_here_hit_elsewhere"] = _idle_counts(torch.stack(hits))  # (steps, layers, E)
    return out


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    if sorted(got) != sorted(want):
        return float("inf"), f"keys differ: {sorted(set(got) ^ set(want))[:4]}"
    key = max(want, key=lambda k: (got[k] - want[k]).abs().max().item())
    return (got[key] - want[key]).abs().max().item(), key


def _batches(seed: int, vocab: int = 100) -> list[torch.Tensor]:
    """The global batch of every step: ``(2, SEQ_LEN)`` token ids, row ``r`` for rank ``r``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (2, SEQ_LEN), generator=g) for _ in range(STEPS)]


_SINGLE: dict[tuple[str, str, str], dict] = {}  # one-process runs, shared by the wrappers' scenarios


def _single(path: str, recipe: str | None, optimizer: str, rank: int, world: int) -> dict:
    key = (path, str(recipe), optimizer)
    if key not in _SINGLE:
        _SINGLE[key] = train_run(load(path, recipe), "single", optimizer, _batches(seed=1), rank, world)
    return copy.copy(_SINGLE[key])


def training_scenario(wrapper: str, folders: dict[str, str], rank: int, world: int) -> dict:
    """Per family and optimizer: the unpatched model in one process on the whole batch (the reference) against
    the patched model in one process, and the unpatched and the patched model under ``wrapper``."""
    results = {}
    for family, recipe in FAMILIES.items():
        path = folders[family]
        unpatched, patched = load(path, None), load(path, recipe)
        start = original_weights(unpatched, "single")
        batches = _batches(seed=1)
        for name in OPTIMIZER_NAMES:
            reference = _single(path, None, name, rank, world)
            moved = max((reference["weights"][k] - start[k]).abs().max().item() for k in start)
            runs = {
                "patched-single": _single(path, recipe, name, rank, world),
                f"unpatched-{wrapper}": train_run(unpatched, wrapper, name, batches, rank, world),
                f"patched-{wrapper}": train_run(patched, wrapper, name, batches, rank, world),
            }
            same = runs[f"unpatched-{wrapper}"]["weights"]
            for run, got in runs.items():
                weights = got.pop("weights")
                diff, worst = _diff(weights, reference["weights"])
                # against the unpatched model under the same wrapper: the same reduction of the same gradients
                same_diff = _diff(weights, same)[0] if run == f"patched-{wrapper}" else None
                results[(family, name, run)] = dict(got, diff=diff, worst=worst, moved=moved, same_wrapper=same_diff)
    return results


def replay_scenario(wrapper: str, folders: dict[str, str], rank: int, world: int) -> dict:
    """Routing recorded under ``wrapper`` (each rank its row) against one process recording the whole batch; the
    recorded trace replayed (unchanged routers: outputs equal the recorded ones); then ``STEPS`` SGD steps with
    perturbed routers replaying it, against one process replaying the whole batch's trace."""
    from modelpatch.routing import record_routing, replay_routing
    from routing_models import ExpertsObserver, perturb_routers

    base = load(folders["qwen2_moe"], FAMILIES["qwen2_moe"])
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 100, (2, SEQ_LEN), generator=g)
    mine = ids[rank : rank + 1]

    ref = copy.deepcopy(base)
    with torch.no_grad(), record_routing(ref) as full_trace:
        ref_logits = ref(ids).logits
    perturbed = copy.deepcopy(base)
    perturb_routers(perturbed)
    with torch.no_grad(), record_routing(perturbed) as natural:
        perturbed(ids)
    natural_differs = sum(
        int((a != b).any(-1).sum()) for layer in full_trace.layers for a, b in zip(natural[layer], full_trace[layer])
    )

    local = wrap(copy.deepcopy(base), wrapper)
    with torch.no_grad(), record_routing(local) as trace:
        rec_logits = local(mine).logits
    with torch.no_grad(), ExpertsObserver(local) as seen, replay_routing(local, trace):
        rep_logits = local(mine).logits
    out = {
        "recorded_equal": trace == full_trace.select([rank]),
        "record_logits_diff": (rec_logits - ref_logits[rank : rank + 1]).abs().max().item(),
        "replay_logits_diff": (rep_logits - rec_logits).abs().max().item(),
        "replay_indices_equal": all(torch.equal(seen.indices(layer), trace[layer][0]) for layer in trace.layers),
        "natural_differs": natural_differs,
    }
    out["idle_here"], out["idle_here_hit_elsewhere"] = _idle_counts(_trace_hits(trace, base.config.num_experts))

    # training with replay: perturbed routers, the recorded indices forced, weights from the live routers
    single = copy.deepcopy(perturbed).train()
    single_opt = _optimizer("sgd", list(single.parameters()))
    dist_model = copy.deepcopy(perturbed).train()
    wrapped = wrap(dist_model, wrapper)
    dist_opt = _optimizer("sgd", list(wrapped.parameters()))
    loss_diffs, logits_diffs, indices_equal = [], [], []
    for _ in range(STEPS):
        single_opt.zero_grad(set_to_none=True)
        with replay_routing(single, full_trace):
            out_single = single(ids, labels=ids)
        out_single.loss.backward()
        single_opt.step()
        dist_opt.zero_grad(set_to_none=True)
        with ExpertsObserver(dist_model) as seen, replay_routing(wrapped, trace):
            out_dist = wrapped(mine, labels=mine)
        out_dist.loss.backward()
        dist_opt.step()
        mean = out_dist.loss.detach().clone()
        dist.all_reduce(mean)
        loss_diffs.append(abs(mean.item() / world - out_single.loss.item()))
        logits_diffs.append((out_dist.logits - out_single.logits[rank : rank + 1]).abs().max().item())
        indices_equal.append(all(torch.equal(seen.indices(layer), trace[layer][0]) for layer in trace.layers))
    diff, worst = _diff(original_weights(dist_model, wrapper), original_weights(single, "single"))
    moved = _diff(original_weights(single, "single"), original_weights(perturbed, "single"))[0]
    out.update(
        train_loss_diff=max(loss_diffs),
        train_logits_diff=max(logits_diffs),
        train_indices_equal=all(indices_equal),
        weights_diff=diff,
        worst=worst,
        moved=moved,
        sharded_experts=_sharded_experts(dist_model),
    )
    return out


SCENARIOS: list[tuple[str, Callable[[dict[str, str], int, int], dict]]] = [
    ("train-ddp", lambda f, r, w: training_scenario("ddp", f, r, w)),
    ("replay-ddp", lambda f, r, w: replay_scenario("ddp", f, r, w)),
    ("train-fsdp2", lambda f, r, w: training_scenario("fsdp2", f, r, w)),
    ("replay-fsdp2", lambda f, r, w: replay_scenario("fsdp2", f, r, w)),
]
"""What the workers run, in order: ``(name, (folders, rank, world) -> result)``."""


def run(rank: int, world: int, init_file: str, folders: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, scenario in SCENARIOS:
            start = time.perf_counter()
            result = scenario(folders, rank, world)
            torch.save(
                {"result": result, "seconds": time.perf_counter() - start}, Path(out_dir) / f"{name}.rank{rank}.pt"
            )
    finally:
        dist.destroy_process_group()
