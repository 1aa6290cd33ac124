"""Overhead of MoE routing record / replay on a mid-size CPU MoE, all measured in the same run.

Model: Qwen3-MoE, hidden 512, 8 layers, 16 experts, top-2 (random weights), one sequence of 512 tokens.
Compares, per forward (eval, no_grad), the median time of

* the plain forward of the untouched model,
* ``modelpatch.routing.record_routing`` (a block per forward, enter/exit included),
* ``modelpatch.routing.replay_routing`` (a block per forward, enter/exit included),
* the recipe written against Transformers' own API: a ``Qwen3MoeTopKRouter`` subclass swapped in with
  ``transformers.monkey_patching`` and an ``OutputRecorder`` written into ``_CAN_RECORD_REGISTRY`` (keyed by the
  model instance, as Transformers 5.23 requires; the ``str(cls)`` key such recipes used no longer works).

Rounds are interleaved so that machine noise hits every variant alike. Prints ratios to the plain forward, of
wall-clock medians and of process-CPU-time medians (``time.process_time``; with ``--threads 1`` this is the
compute itself and much less sensitive to other processes sharing the machine).
Targets: record <= 1.03x, replay <= 1.05x of a plain forward.

    python benchmarks/bench_routing.py [--tokens 512] [--rounds 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
from transformers.utils import logging

from modelpatch.routing import record_routing, replay_routing


# --- the recipe written against Transformers' own API (its registry key fixed) ----------------------------------
class ReplayableQwen3MoeTopKRouter(Qwen3MoeTopKRouter):
    _forced_indices: torch.Tensor | None = None

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_logits = F.softmax(router_logits, dtype=torch.float, dim=-1)
        if self._forced_indices is not None:
            router_indices = self._forced_indices.to(router_logits.device).long()
            router_top_value = router_logits.gather(-1, router_indices)
        else:
            router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)
        if self.norm_topk_prob:
            router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value.to(router_logits.dtype), router_indices


@contextmanager
def replay_moe_routing(model, selected_experts_per_layer):
    routers = [m for m in model.modules() if isinstance(m, ReplayableQwen3MoeTopKRouter)]
    if len(routers) != len(selected_experts_per_layer):
        raise ValueError(f"Got {len(routers)} routers but {len(selected_experts_per_layer)} tensors")
    for r, t in zip(routers, selected_experts_per_layer):
        r._forced_indices = t
    try:
        yield
    finally:
        for r in routers:
            r._forced_indices = None


def build_recipe_model(config, state_dict):
    from transformers.monkey_patching import apply_patches, register_patch_mapping, unregister_patch_mapping
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder

    register_patch_mapping({"Qwen3MoeTopKRouter": ReplayableQwen3MoeTopKRouter}, overwrite=True)
    try:
        with apply_patches():
            model = Qwen3MoeForCausalLM(config).eval()
    finally:
        unregister_patch_mapping(["Qwen3MoeTopKRouter"])
    model.load_state_dict(state_dict)
    inner = model.model
    existing = _CAN_RECORD_REGISTRY.get(inner) or {}
    _CAN_RECORD_REGISTRY[inner] = {
        **existing,
        "selected_experts": OutputRecorder(ReplayableQwen3MoeTopKRouter, index=2),
    }
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = parser.parse_args()
    logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=2,
        vocab_size=1024,
        max_position_embeddings=4096,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    config._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    recipe = build_recipe_model(config, model.state_dict())
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))

    with torch.no_grad(), record_routing(model) as trace:
        reference = model(ids).logits
    recipe_selected = list(recipe.model(input_ids=ids, output_selected_experts=True).selected_experts)

    def plain():
        model(ids)

    def record():
        with record_routing(model):
            model(ids)

    def replay():
        with replay_routing(model, trace):
            model(ids)

    def recipe_record():
        recipe.model(input_ids=ids, output_selected_experts=True)

    def recipe_replay():
        with replay_moe_routing(recipe.model, recipe_selected):
            recipe.model(input_ids=ids)

    variants = {
        "plain forward": plain,
        "modelpatch record_routing": record,
        "modelpatch replay_routing": replay,
        "seed recipe record (output_selected_experts)": recipe_record,
        "seed recipe replay (router subclass)": recipe_replay,
    }
    times = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    with torch.no_grad():
        for fn in variants.values():  # warm-up
            fn()
            fn()
        for _ in range(args.rounds):
            for name, fn in variants.items():
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        with replay_routing(model, trace):
            replayed = model(ids).logits
    base = statistics.median(times["plain forward"])
    print(
        f"Qwen3-MoE hidden 512, 8 layers, 16 experts, top-2, {args.tokens} tokens; torch threads "
        f"{torch.get_num_threads()}; median of {args.rounds} interleaved rounds"
    )
    cpu_base = statistics.median(cpu["plain forward"])
    print(f"{'variant':48s} {'wall ms':>9s} {'ratio':>7s} {'cpu ms':>9s} {'ratio':>7s}")
    for name in variants:
        med, cmed = statistics.median(times[name]), statistics.median(cpu[name])
        print(f"{name:48s} {med * 1e3:9.2f} {med / base:7.3f}x {cmed * 1e3:9.2f} {cmed / cpu_base:7.3f}x")
    print(f"replay vs plain max |logit diff|: {float((replayed - reference).abs().max()):.2e}")
    print(f"trace: {trace}, {trace.nbytes} bytes")


if __name__ == "__main__":
    main()
