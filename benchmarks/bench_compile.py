"""torch.compile of patched models: fused QKV vs vanilla attention, record/replay vs a plain forward.

All measured in the same run, with inductor (the default backend), ``fullgraph=True`` and the median of
interleaved rounds after warm-up (the compile itself is not timed):

* Llama (hidden 256, 4 layers, GQA 8/4 heads), batch 4 x ``--tokens``: forward + backward of the compiled
  ``llama-fused-qkv`` model vs the compiled vanilla model (same weights). Target <= 1.0x (one matmul for q, k, v).
* Qwen3-MoE (hidden 256, 4 layers, 8 experts, top-2), batch 4 x ``--tokens``, no grad: the compiled model inside
  ``record_routing`` and inside ``replay_routing`` (a block per forward, enter/exit included) vs the compiled
  plain forward. Targets: record <= 1.05x, replay <= 1.02x. Both blocks reuse one graph compiled on the first block (recompiles printed).

Each variant runs once per round, rounds interleaved with the order rotated. Prints wall-clock and process-CPU-time
medians and, against the compiled baseline of the same round, the median of the per-round ratios ("paired") with
their quartiles: the CPU ratio is the least sensitive to other processes on the machine (use ``--threads 1``); the
quartiles show how noisy the run was. An A/A control row (the baseline again, as its own variant) shows the noise
floor and would show a bias of the method (its median should be 1.000). Then graph breaks and recompiles.

    python benchmarks/bench_compile.py [--tokens 128] [--rounds 41] [--threads N] [--only qkv|routing]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig
from transformers.utils import logging

from modelpatch.recipes import get_recipe
from modelpatch.routing import record_routing, replay_routing


class _Counting:
    """Inductor, noting each compile id (``frame_compile_id > 0``: a recompilation)."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend

        self.inductor = lookup_backend("inductor")
        self.ids: set[tuple[int, int]] = set()

    def __call__(self, gm, example_inputs):
        cid = torch._guards.CompileContext.current_compile_id()
        self.ids.add((cid.frame_id, cid.frame_compile_id))
        return self.inductor(gm, example_inputs)

    @property
    def recompiles(self) -> int:
        return sum(1 for _, n in self.ids if n)


def _time(variants: dict, rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per variant: the wall time and the process-CPU time of each round. The variants run once per round, in an
    order rotated each round, so that load changes and the slot after another variant hit every variant alike."""
    walls: dict[str, list[float]] = {k: [] for k in variants}
    cpus: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            w, c = time.perf_counter(), time.process_time()
            variants[name]()
            walls[name].append(time.perf_counter() - w)
            cpus[name].append(time.process_time() - c)
    return {k: (walls[k], cpus[k]) for k in variants}


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def _table(title: str, results: dict[str, tuple[list[float], list[float]]], base: str) -> None:
    """Per variant: wall and CPU medians, and the median of the per-round ratios to ``base`` ("paired": each round's
    variant against the same round's base, which cancels load that changes between rounds) with their quartiles
    (the spread). A variant that runs exactly what ``base`` runs (an A/A control) shows the noise floor and any
    bias of the method: its paired ratios should centre on 1.000."""
    print(title)
    print(
        f"{'variant':40s} {'wall ms':>8s} {'cpu ms':>8s} {'paired cpu ratio [q1, q3]':>27s} "
        f"{'paired wall ratio [q1, q3]':>27s}"
    )
    bw, bc = results[base]
    for name, (ws, cs) in results.items():
        cols = []
        for xs, bs in ((cs, bc), (ws, bw)):
            q1, q2, q3 = _quartiles([x / b for x, b in zip(xs, bs)])
            cols.append(f"{q2:7.3f}x [{q1:.3f}, {q3:.3f}]")
        print(
            f"{name:40s} {statistics.median(ws) * 1e3:8.2f} {statistics.median(cs) * 1e3:8.2f} "
            f"{cols[0]:>27s} {cols[1]:>27s}"
        )
    print(f"load average (1 min) after: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


def bench_qkv(tokens: int, rounds: int) -> None:
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=max(512, tokens),
    )
    torch.manual_seed(0)
    vanilla = AutoModelForCausalLM.from_config(config)
    with get_recipe("llama-fused-qkv").apply():
        fused = AutoModelForCausalLM.from_config(config)
    state = vanilla.state_dict()
    with torch.no_grad():  # same weights: q, k, v rows concatenated
        for i, layer in enumerate(fused.model.layers):
            p = f"model.layers.{i}.self_attn."
            qkv = torch.cat([state[p + "q_proj.weight"], state[p + "k_proj.weight"], state[p + "v_proj.weight"]])
            layer.self_attn.qkv_proj.weight.copy_(qkv)
        fused.load_state_dict(
            {k: v for k, v in state.items() if "_proj.weight" not in k or "o_proj" in k or "mlp" in k}, strict=False
        )
    ids = torch.randint(0, config.vocab_size, (4, tokens), generator=torch.Generator().manual_seed(0))
    counters.clear()
    backends = {"vanilla": _Counting(), "fused": _Counting()}
    compiled = {
        "vanilla": torch.compile(vanilla, backend=backends["vanilla"], fullgraph=True),
        "fused": torch.compile(fused, backend=backends["fused"], fullgraph=True),
    }

    def step(name):
        def run():
            model = compiled[name]
            model(input_ids=ids).logits.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        return run

    variants = {
        "compiled vanilla fwd+bwd": step("vanilla"),
        "compiled vanilla fwd+bwd (A/A control)": step("vanilla"),
        "compiled llama-fused-qkv fwd+bwd": step("fused"),
    }
    for fn in variants.values():  # compile + warm-up
        fn()
        fn()
    with torch.no_grad():
        diff = (compiled["fused"](input_ids=ids).logits - compiled["vanilla"](input_ids=ids).logits).abs().max()
    results = _time(variants, rounds)
    _table(f"fused QKV, Llama hidden 256 x 4 layers, batch 4 x {tokens} tokens", results, "compiled vanilla fwd+bwd")
    print(
        f"graph breaks: {sum(counters['graph_break'].values())}; recompiles: "
        f"{sum(b.recompiles for b in backends.values())}; max |logit diff| fused vs vanilla: {float(diff):.2e}"
    )


def bench_routing(tokens: int, rounds: int) -> None:
    config = Qwen3MoeConfig(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=1024,
        max_position_embeddings=max(512, tokens),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (4, tokens), generator=torch.Generator().manual_seed(1))
    counters.clear()
    backend = _Counting()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad(), record_routing(model) as trace:
        reference = model(input_ids=ids).logits

    def plain():
        with torch.no_grad():
            return compiled(input_ids=ids).logits

    def record():
        with torch.no_grad(), record_routing(model):
            return compiled(input_ids=ids).logits

    def replay():
        with torch.no_grad(), replay_routing(model, trace):
            return compiled(input_ids=ids).logits

    variants = {
        "compiled plain forward": plain,
        "compiled plain forward (A/A control)": plain,
        "compiled + record_routing": record,
        "compiled + replay_routing": replay,
    }
    for fn in variants.values():
        fn()
        fn()
    with torch.no_grad(), record_routing(model) as recorded:
        compiled(input_ids=ids)
    same = all(torch.equal(a, b) for a, b in zip(recorded.layer_routes(1), trace.layer_routes(1)))
    diff = (replay() - reference).abs().max()
    results = _time(variants, rounds)
    _table(
        f"routing, Qwen3-MoE hidden 256 x 4 layers, 8 experts top-2, batch 4 x {tokens}",
        results,
        "compiled plain forward",
    )
    print(
        f"graph breaks: {sum(counters['graph_break'].values())}; recompiles: {backend.recompiles}; recorded "
        f"indices equal eager: {same}; replay vs eager max |logit diff|: {float(diff):.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--only", choices=("qkv", "routing"), help="run one of the two benchmarks")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.set_verbosity_error()
    if args.only != "routing":
        bench_qkv(args.tokens, args.rounds)
    if args.only is None:
        print()
    if args.only != "qkv":
        bench_routing(args.tokens, args.rounds)


if __name__ == "__main__":
    main()
