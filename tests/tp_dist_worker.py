"""The 2-process half of tests/test_tensor_parallel.py: ``torchrun --standalone --nproc_per_node 2
tests/tp_dist_worker.py CHECKPOINTS.json OUT`` (CPU, gloo; Transformers starts the process group itself).

Loads with ``from_pretrained(..., tp_plan=...)`` and writes, from rank 0, ``OUT/tp.pt``:

* ``"experts"``: qwen2_moe (grouped-query attention) with ``qwen2_moe-linear-experts``; ``"full"``: qwen2_moe with
  multi-head attention and ``qwen2_moe-full-example`` (fused QKV + linear experts); ``"gqa"``: llama
  (grouped-query attention) with ``llama-fused-qkv``. Each: ``logits`` of
  :data:`IDS`, ``local``: ``{parameter: this rank's shape}`` of layer 0's sharded parameters, ``state``: the model's
  state dict gathered (``full_tensor()``), ``generated``: 4 greedy tokens; for :data:`TRAINED` also ``trained``: the
  gathered state and ``trained_logits`` after one SGD step (lr :data:`LR`) on :data:`IDS`. Each model is saved
  with ``save_pretrained`` into ``OUT/saved-<name>`` before that step.
* ``"idle"``: the gathered state of ``"experts"`` after :func:`idle_steps` (idle experts' zero gradients).
* ``"refused"``: ``{case: "<ErrorClass>: <message>"}`` (or ``None`` when nothing was raised) for loads that must be
  refused: ``heads`` (``llama-fused-qkv`` on a llama with one key/value head: 2 ranks cannot split it),
  ``removed`` (a user ``tp_plan`` entry for ``q_proj``, which the fused-QKV recipe removed), ``split`` (a user
  ``colwise`` entry for the fused ``qkv_proj``), ``split_config`` (the same passed as
  ``distributed_config=DistributedConfig(tp_plan=...)``).

:func:`load` (the same load in one process) is the reference the test compares with.
"""

from __future__ import annotations

import json
import os
import sys

import torch

IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7]])
LR = 0.1
LOADS = {
    "experts": ("qwen2_moe", "qwen2_moe-linear-experts"),
    "full": ("qwen2_moe_mha", "qwen2_moe-full-example"),
    "gqa": ("llama", "llama-fused-qkv"),
}
TRAINED = ("full", "gqa")
REFUSED = {
    "heads": ("llama_mqa", "llama-fused-qkv", "auto"),
    "removed": ("qwen2_moe_mha", "qwen2_moe-fused-qkv", {"model.layers.*.self_attn.q_proj": "colwise"}),
    "split": ("qwen2_moe_mha", "qwen2_moe-fused-qkv", {"model.layers.*.self_attn.qkv_proj": "colwise"}),
    # the same through Transformers' newer argument, distributed_config=DistributedConfig(tp_plan=...)
    "split_config": ("qwen2_moe_mha", "qwen2_moe-fused-qkv", {"model.layers.*.self_attn.qkv_proj": "colwise"}),
}


def make_checkpoints(folder) -> dict[str, str]:
    """Tiny checkpoints: ``llama`` and ``qwen2_moe`` with grouped-query attention (4 query heads, 2 key/value heads),
    ``qwen2_moe_mha`` with 4 of each."""
    from transformers import LlamaForCausalLM, Qwen2MoeForCausalLM

    from helpers import save_tiny, tiny_llama_config, tiny_qwen2_moe_config

    paths = {name: os.path.join(folder, name) for name in ("llama", "llama_mqa", "qwen2_moe", "qwen2_moe_mha")}
    save_tiny(LlamaForCausalLM, tiny_llama_config(), paths["llama"])
    save_tiny(LlamaForCausalLM, tiny_llama_config(num_key_value_heads=1), paths["llama_mqa"])
    save_tiny(Qwen2MoeForCausalLM, tiny_qwen2_moe_config(num_key_value_heads=2), paths["qwen2_moe"])
    save_tiny(Qwen2MoeForCausalLM, tiny_qwen2_moe_config(), paths["qwen2_moe_mha"])
    return paths


def load(path: str, recipe: str, **kwargs):
    """``from_pretrained`` with the recipe applied (eager attention: the same kernel on 1 and 2 processes)."""
    from transformers import AutoModelForCausalLM

    from modelpatch.recipes import get_recipe

    with get_recipe(recipe).apply():
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs)


def gathered(model) -> dict[str, torch.Tensor]:
    """The state dict as full tensors (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def sgd_step(model) -> None:
    """One SGD step on :data:`IDS` (the same on 1 and 2 processes)."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model(IDS, labels=IDS).loss.backward()
    optimizer.step()
    model.eval()


def idle_steps(model) -> None:
    """2 steps of SGD with momentum on one token: top-2 of 4 experts, so 2 idle experts get zero gradients."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for _ in range(2):
        model(IDS[:, :1], labels=IDS[:, 1:2]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def check_load(paths: dict, out: str, name: str) -> dict:
    from torch.distributed.tensor import DTensor

    checkpoint, recipe = LOADS[name]
    model = load(paths[checkpoint], recipe, tp_plan="auto")
    local = {
        k: tuple(v.to_local().shape)
        for k, v in model.named_parameters()
        if isinstance(v, DTensor) and ".layers.0." in k and ("self_attn" in k or "experts.0." in k)
    }
    with torch.no_grad():
        logits = model(IDS).logits
    result = {"logits": logits, "local": local, "state": gathered(model)}
    result["generated"] = model.generate(IDS, max_new_tokens=4, do_sample=False)
    model.save_pretrained(os.path.join(out, f"saved-{name}"))
    if name in TRAINED:
        sgd_step(model)
        with torch.no_grad():
            result["trained_logits"] = model(IDS).logits
        result["trained"] = gathered(model)
    return result


def refused(paths: dict, case: str) -> str | None:
    from transformers.distributed import DistributedConfig

    checkpoint, recipe, plan = REFUSED[case]
    kwargs = {"distributed_config": DistributedConfig(tp_plan=plan)} if case.endswith("_config") else {"tp_plan": plan}
    try:
        load(paths[checkpoint], recipe, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return None


def main(checkpoints: str, out: str) -> None:
    torch.set_num_threads(1)
    with open(checkpoints) as fh:
        paths = json.load(fh)
    results: dict = {name: check_load(paths, out, name) for name in LOADS}
    model = load(paths[LOADS["experts"][0]], LOADS["experts"][1], tp_plan="auto")
    idle_steps(model)
    results["idle"] = gathered(model)
    results["refused"] = {case: refused(paths, case) for case in REFUSED}
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, "tp.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
