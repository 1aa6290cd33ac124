"""Benchmark: routing replay inside TRL's GRPO, and ``routing_drift`` against one plain forward.

1. A small Qwen3-MoE (hidden 256, 4 layers, 8 experts, top-2) trained with TRL's ``GRPOTrainer`` and with
   ``RoutingReplayGRPOTrainer`` (rollouts recorded, every log-prob forward replayed, drift measured), the same
   seeds, steps and data, alternated; the median wall time of a training step (generation included, as TRL
   counts a step) is compared. Targets (issue 12): recording + replay add <= 3% + 5%.
   Also the time of the loss forward+backward alone, replayed vs plain, on the same batch (the part replay touches).
2. ``routing_drift`` on a 4,096-token sequence vs one plain forward of it (target <= 1.1x).

    python benchmarks/bench_trl.py [--steps 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=8192,
    )


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 512)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _train(cls, model_dir: str, out: str, steps: int) -> float:
    """Median seconds per training step (after the first) of a fresh trainer."""
    import numpy as np
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    rng = np.random.default_rng(0)
    prompts = [" ".join(f"w{t}" for t in rng.integers(2, 512, size=32)) for _ in range(64)]
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=32,
        max_steps=steps + 1,
        learning_rate=1e-4,
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = cls(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=_tokenizer(),
        callbacks=[Clock()],
    )
    trainer.train()
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen3MoeForCausalLM
    from trl import GRPOTrainer

    from modelpatch.integrations.trl import RoutingReplayGRPOTrainer
    from modelpatch.routing import RoutingDriftMeter, record_routing, replay_routing, routing_drift

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config())
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        step = {"GRPOTrainer": [], "RoutingReplayGRPOTrainer": []}
        for _ in range(args.repeats):
            step["GRPOTrainer"].append(_train(GRPOTrainer, folder, os.path.join(folder, "a"), args.steps))
            step["RoutingReplayGRPOTrainer"].append(
                _train(RoutingReplayGRPOTrainer, folder, os.path.join(folder, "b"), args.steps)
            )
    plain, replay = (statistics.median(v) for v in step.values())
    print(
        f"GRPO training step (generation included), Qwen3-MoE {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"
    )
    print(f"  GRPOTrainer                {plain * 1000:8.1f} ms")
    print(f"  RoutingReplayGRPOTrainer   {replay * 1000:8.1f} ms   ratio {replay / plain:.3f}x (target <= 1.08)")

    ids = torch.randint(2, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    model.train()
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)

    def loss_step(replayed: bool) -> float:
        start = time.perf_counter()
        if replayed:
            with replay_routing(model, trace, drift=RoutingDriftMeter()):
                model(ids, labels=ids).loss.backward()
        else:
            model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for mode in (False, True):
        loss_step(mode)
    fb = {False: [], True: []}
    for _ in range(7):
        for mode in (False, True):
            fb[mode].append(loss_step(mode))
    a, b = statistics.median(fb[False]), statistics.median(fb[True])
    print(
        f"  loss forward+backward (8 x 64 tokens): plain {a * 1000:.1f} ms, replayed + drift {b * 1000:.1f} ms, "
        f"ratio {b / a:.3f}x (target <= 1.05)"
    )

    model.eval()
    long_ids = torch.randint(2, 512, (1, 4096), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), record_routing(model) as long_trace:
        model(long_ids)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    with torch.no_grad():
        forward = [timed(lambda: model(long_ids)) for _ in range(3)]
        drift = [timed(lambda: routing_drift(model, long_trace, long_ids)) for _ in range(3)]
    f, d = statistics.median(forward), statistics.median(drift)
    print(
        f"  routing_drift on 4,096 tokens: {d * 1000:.0f} ms vs one forward {f * 1000:.0f} ms, ratio {d / f:.3f}x "
        "(target <= 1.10)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
