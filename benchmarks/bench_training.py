"""Benchmark: a training step (forward + backward + AdamW step) of a patched model vs the unpatched one.

Three models of one size (hidden 256, 4 layers; MoE: 8 experts, top-2; vocab 2048), each saved once and loaded
unpatched and with its recipe: ``qwen2_moe`` with ``qwen2_moe-linear-experts`` (per-expert ``nn.Linear`` against
Transformers' fused experts), ``mixtral`` with ``mixtral-linear-experts``, ``llama`` with ``llama-fused-qkv``. A
step is ``zero_grad(set_to_none=True)``, the language-model loss of a ``(4, 64)`` batch (``labels=input_ids``),
backward and ``AdamW(lr=1e-4, weight_decay=0.1).step()``, after two warm-up steps (the optimizer state exists).

Step times: one subprocess per model holds every variant (unpatched, patched, and for linear experts the patched
model with ``skip_idle_experts = True``), each with its own AdamW, and steps them round-robin on the same batches
(one torch thread), so a change of the machine's load reaches all of them alike; the figure is the median over
``--rounds`` rounds of the per-round ratio. Memory: each variant in a fresh subprocess (glibc maps every tensor
over 64 KiB on its own, ``MALLOC_MMAP_THRESHOLD_``, so the RSS follows the live tensors), ``--repeats`` times,
medians. Printed per model:

* step time, patched / unpatched (target <= 1.10x);
* training memory: the peak RSS over 3 steps after 2 warm-up steps, minus the RSS after the imports (weights,
  AdamW state, gradients, activations), patched / unpatched (target <= 1.05x), and the whole-process peaks;
* for linear experts, the share of the step spent giving idle experts (no token in the batch) their zero
  gradients: the patched model with ``skip_idle_experts = True`` on every ``LinearExperts`` (idle experts left
  out of the graph) against the default: ``(forward + backward of the default - of skip) / default step``
  (target <= 2%; the optimizer's work on the zeros is left out, as the fused original steps the same elements),
  with the number of idle (layer, expert) pairs per step (none idle: the fill never runs, the target is met by
  construction and the figure shown is noise); and the same share on a ``(1, 4)`` batch, where most experts are
  idle (also <= 2%).

    python benchmarks/bench_training.py [--rounds 10] [--repeats 2] [--only qwen2_moe mixtral llama]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from memory import reset_peak, status_mb

BATCH = (4, 64)
SMALL_BATCH = (1, 4)
TARGETS = {"step": 1.10, "memory": 1.05, "idle": 0.02}


def _config(case: str):
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig

    common = dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if case == "qwen2_moe":
        return Qwen2MoeConfig(
            **common,
            intermediate_size=512,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=512,
            num_experts=8,
            num_experts_per_tok=2,
        )
    if case == "mixtral":
        return MixtralConfig(**common, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)
    return LlamaConfig(**common, intermediate_size=1024, attention_bias=True)


CASES = {"qwen2_moe": "qwen2_moe-linear-experts", "mixtral": "mixtral-linear-experts", "llama": "llama-fused-qkv"}


def _save(case: str, folder: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(case)).save_pretrained(folder)


def _load(case: str, variant: str, folder: str):
    from transformers import AutoModelForCausalLM

    from modelpatch.recipes import get_recipe
    from modelpatch.recipes.linear_experts import LinearExperts

    if variant == "unpatched":
        model = AutoModelForCausalLM.from_pretrained(folder)
    else:
        with get_recipe(CASES[case]).apply():
            model = AutoModelForCausalLM.from_pretrained(folder)
    experts = [m for m in model.modules() if isinstance(m, LinearExperts)]
    for module in experts:
        module.skip_idle_experts = variant in ("skip", "zeros")
    return model.train(), experts


class _Trainer:
    """One model, its AdamW, and the idle (layer, expert) pairs of each step."""

    def __init__(self, case: str, variant: str, folder: str):
        import torch

        self.model, experts = _load(case, variant, folder)
        # "zeros": idle experts left out of the graph, their gradients set to zeros by hand after backward (the
        # least any layout must do for the optimizer to step them as the fused original's zero slices)
        self.by_hand = [p for m in experts for p in m.parameters()] if variant == "zeros" else []
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        self.idle: list[int] = []
        self.experts = len(experts)
        for module in experts:
            module.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        import torch

        index = next(
            v for v in (*args[1:], *kwargs.values()) if isinstance(v, torch.Tensor) and not v.is_floating_point()
        )
        hit = set(index.unique().tolist())
        self.idle[-1] += sum(1 for e in range(module.num_experts) if e not in hit)

    def step(self, ids) -> tuple[float, float]:
        """One step; ``(seconds of the whole step, seconds of zero_grad + forward + backward)``."""
        import torch

        self.idle.append(0)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.model(input_ids=ids, labels=ids).loss.backward()
        for p in self.by_hand:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        backward = time.perf_counter()
        self.optimizer.step()
        return time.perf_counter() - start, backward - start


def _batches(count: int, batch: tuple[int, int]):
    import torch

    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 2048, batch, generator=generator) for _ in range(count)]


def time_child(case: str, folder: str, rounds: int, batch: tuple[int, int]) -> None:
    """Every variant in this process, one step each per round (round-robin, so a change of the machine's load
    reaches all of them alike); prints ``{variant: {"times": [...], "idle": [...]}}``."""
    import torch

    torch.set_num_threads(1)
    variants = ["unpatched", "patched"] + (["skip", "zeros"] if case != "llama" else [])
    trainers = {v: _Trainer(case, v, folder) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    backward: dict[str, list[float]] = {v: [] for v in variants}
    for i, ids in enumerate(_batches(rounds + 2, batch)):
        for variant, trainer in trainers.items():
            elapsed, until_backward = trainer.step(ids)
            if i >= 2:  # two warm-up rounds: the optimizer state exists, first-call costs are paid
                times[variant].append(elapsed)
                backward[variant].append(until_backward)
    params = sum(p.numel() for p in trainers["unpatched"].model.parameters())
    result = {v: {"times": times[v], "backward": backward[v], "idle": trainers[v].idle[2:]} for v in variants}
    print(json.dumps({"params": params, **result}))


def memory_child(case: str, variant: str, folder: str, steps: int, batch: tuple[int, int]) -> None:
    """One variant in a fresh process: the RSS after imports, the peak over ``steps`` steps after two warm-up
    steps, and the RSS just before them."""
    import torch
    import transformers  # noqa: F401 - the imports are the baseline, not the training memory

    import modelpatch.recipes  # noqa: F401

    torch.set_num_threads(1)
    baseline = status_mb("VmRSS")
    trainer = _Trainer(case, variant, folder)
    ids = _batches(steps + 2, batch)
    for batch_ids in ids[:2]:
        trainer.step(batch_ids)
    before = status_mb("VmRSS")
    peak_reset = reset_peak()
    for batch_ids in ids[2:]:
        trainer.step(batch_ids)
    peak = status_mb("VmHWM")
    print(json.dumps({"baseline_mb": baseline, "peak_mb": peak, "before_mb": before, "peak_reset": peak_reset}))


def _env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    return dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONPATH=path, MALLOC_MMAP_THRESHOLD_="65536")


def _run(*args: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env()).stdout
    return json.loads(out.strip().splitlines()[-1])


def _verdict(value: float, target: float) -> str:
    return "PASS" if value <= target else "MISSED"


def _fill_share(times: dict, baseline: str = "zeros") -> float:
    """Median over the rounds of ``(forward + backward of the default - of baseline) / default step``: against
    ``"zeros"`` (idle experts out of the graph, zero gradients set by hand after backward), what the fill's
    mechanism costs; against ``"skip"`` (``skip_idle_experts = True``, no gradient at all), that plus the zero
    tensors themselves, which any layout needs for an optimizer to step idle experts (the fused original's gradient
    holds them too). The optimizer's work on the zeros is left out: the fused original steps the same elements."""
    default, skip = times["patched"], times[baseline]
    return statistics.median(
        (a - b) / total for a, b, total in zip(default["backward"], skip["backward"], default["times"])
    )


def _ratio(times: dict, a: str, b: str) -> float:
    """Median over the rounds of ``a``'s step time / ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(times[a]["times"], times[b]["times"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (one step of every variant each)")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per memory figure")
    parser.add_argument("--only", nargs="+", choices=list(CASES), help="some of the models")
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        kind, case, *rest = args.child
        if kind == "time":
            folder, rounds, b, t = rest
            time_child(case, folder, int(rounds), (int(b), int(t)))
        else:
            variant, folder, steps, b, t = rest
            memory_child(case, variant, folder, int(steps), (int(b), int(t)))
        return 0
    missed = 0
    print(
        f"training step (forward + backward + AdamW), batch {BATCH[0]} x {BATCH[1]} tokens, fp32, 1 thread; step "
        f"times: median over {args.rounds} rounds of the per-round ratio (every variant in one process, one step each "
        f"per round); memory: median of {args.repeats} fresh processes per variant"
    )
    for case in args.only or list(CASES):
        moe = case != "llama"
        with tempfile.TemporaryDirectory() as folder:
            _save(case, folder)
            times = _run("time", case, folder, str(args.rounds), *map(str, BATCH))
            small = _run("time", case, folder, str(args.rounds), *map(str, SMALL_BATCH)) if moe else {}
            memory: dict[str, list[dict]] = {"unpatched": [], "patched": []}
            for _ in range(args.repeats):
                for variant in memory:
                    memory[variant].append(_run("memory", case, variant, folder, "3", *map(str, BATCH)))

        def ms(group: dict, variant: str) -> float:
            return statistics.median(group[variant]["times"]) * 1000

        def mem(variant: str, key: str, memory: dict[str, list[dict]] = memory) -> float:
            return statistics.median(r[key] for r in memory[variant])

        step_ratio = _ratio(times, "patched", "unpatched")
        train = {v: mem(v, "peak_mb") - mem(v, "baseline_mb") for v in memory}
        memory_ratio = train["patched"] / train["unpatched"]
        print(f"\n{case} ({times['params'] / 1e6:.1f}M parameters) with {CASES[case]}")
        print(
            f"  step time         unpatched {ms(times, 'unpatched'):7.1f} ms   patched {ms(times, 'patched'):7.1f} ms"
            f"   ratio {step_ratio:.3f}x (target <= {TARGETS['step']:.2f}) {_verdict(step_ratio, TARGETS['step'])}"
        )
        reset = all(r["peak_reset"] for rs in memory.values() for r in rs)
        print(
            f"  training memory   unpatched {train['unpatched']:7.1f} MB   patched {train['patched']:7.1f} MB   ratio "
            f"{memory_ratio:.3f}x (target <= {TARGETS['memory']:.2f}) {_verdict(memory_ratio, TARGETS['memory'])}"
            + ("" if reset else " (VmHWM could not be reset)")
        )
        print(
            f"    (peak RSS over the steps minus the RSS after imports: weights, AdamW state, gradients, activations;"
            f" whole-process peak {mem('unpatched', 'peak_mb'):.0f} vs {mem('patched', 'peak_mb'):.0f} MB, "
            f"ratio {mem('patched', 'peak_mb') / mem('unpatched', 'peak_mb'):.3f}x)"
        )
        missed += (step_ratio > TARGETS["step"]) + (memory_ratio > TARGETS["memory"])
        if moe:
            share = _fill_share(times)
            with_zeros = _fill_share(times, "skip")
            idle = statistics.median(times["patched"]["idle"])
            never = not any(times["patched"]["idle"])
            verdict = "PASS" if never else _verdict(share, TARGETS["idle"])
            print(
                f"  idle-expert fill  {share * 100:6.2f}% of the step (vs zero gradients set by hand; "
                f"{with_zeros * 100:.2f}% vs none at all, skip_idle_experts=True; {idle:.0f} idle (layer, expert) pairs "
                f"per step) (target <= {TARGETS['idle'] * 100:.0f}%) {verdict}"
            )
            if never:
                print(
                    "    (no expert was idle in any step: the fill never ran, both variants ran the same code, the "
                    "figure is the machine's noise)"
                )
            missed += verdict != "PASS"
            small_share = _fill_share(small)
            small_verdict = _verdict(small_share, TARGETS["idle"])
            print(
                f"    on a {SMALL_BATCH[0]} x {SMALL_BATCH[1]} batch: {small_share * 100:.1f}% of a "
                f"{ms(small, 'patched'):.1f} ms step ({_fill_share(small, 'skip') * 100:.1f}% vs no gradient), "
                f"{statistics.median(small['patched']['idle']):.0f} idle (layer, expert) pairs per step "
                f"(target <= {TARGETS['idle'] * 100:.0f}%) {small_verdict}; patched / unpatched there "
                f"{_ratio(small, 'patched', 'unpatched'):.3f}x"
            )
            missed += small_verdict != "PASS"
    print(f"\n{'every target met' if not missed else f'{missed} target(s) missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
