"""GRPO of a Mixture-of-Experts policy with routing replay (R3): training forwards use the rollout's experts.

In RL of a MoE model, the tokens a rollout generated are later scored by training forwards (policy loss, old
policy, reference). If those forwards route a token to other experts than the rollout did, the gradient belongs to
a different network (R3, arXiv 2510.11370). ``RoutingReplayGRPOTrainer`` is TRL's ``GRPOTrainer`` with each
completion's rollout routes recorded and replayed in every log-probability forward. The script:

1. builds a tiny Qwen3-MoE and a word-level tokenizer from scratch (no download; ``--model DIR`` takes a saved
   causal-LM MoE checkpoint, ``--tokenizer DIR`` its tokenizer),
2. trains 2 GRPO steps (``num_iterations=2``, ``beta=0.04`` so the reference model's forwards replay too) with a
   toy reward (longer completions score higher),
3. checks that the trainer logged R3's drift measures (``routing/router_disagreement``,
   ``routing/token_flip_rate``, ``routing/topk_overlap``, each in [0, 1]) for every logged step: how far the
   policy's natural routing of the training tokens had moved from the rollout's, measured inside the replayed
   forwards: 0 at step 1 (no update yet), above 0 at step 2 (the same rollout after one update), where replay
   is what keeps the rollout's experts.

    python examples/grpo_routing_replay.py [--model DIR --tokenizer DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
from trl import GRPOConfig

from modelpatch.integrations.trl import RoutingReplayGRPOTrainer

VOCAB = 128
MEASURES = ("routing/router_disagreement", "routing/token_flip_rate", "routing/topk_overlap")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Words ``w2`` .. ``w127``, ``<pad>`` = 0, ``<eos>`` = 1: stands in for a real tokenizer."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def tiny_moe(path: str) -> None:
    """A Qwen3-MoE of 4 experts (top-2), hidden size 64, 2 layers, saved to ``path``."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)


def prompts(n: int = 8) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 7, (1,), generator=generator))
        rows.append(" ".join(f"w{t}" for t in torch.randint(2, VOCAB, (length,), generator=generator).tolist()))
    return Dataset.from_dict({"prompt": rows})


def length_reward(completions, **kwargs) -> list[float]:
    """Toy reward: the length of each completion."""
    return [float(len(c)) for c in completions]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a saved MoE causal-LM checkpoint (default: a tiny Qwen3-MoE built here)")
    parser.add_argument("--tokenizer", help="its tokenizer (default: a word-level tokenizer built here)")
    parser.add_argument("--out", help="output folder (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or os.path.join(scratch, "policy")
        if args.model is None:
            tiny_moe(model)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else word_tokenizer()
        config = GRPOConfig(
            output_dir=args.out or os.path.join(scratch, "run"),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=6,
            num_iterations=2,  # the second iteration replays the same rollout routes after an update
            max_steps=2,
            learning_rate=1e-3,
            logging_steps=1,
            beta=0.04,  # a reference model, whose forwards replay too
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            save_strategy="no",
        )
        trainer = RoutingReplayGRPOTrainer(
            model=model, reward_funcs=length_reward, args=config, train_dataset=prompts(), processing_class=tokenizer
        )
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if MEASURES[0] in entry]
    for entry in logged:
        print(f"step {entry['step']}: " + ", ".join(f"{m.split('/')[1]} {entry[m]:.3f}" for m in MEASURES))
    ok = trainer.state.global_step == 2 and len(logged) == 2
    ok = ok and all(0.0 <= entry[m] <= 1.0 for entry in logged for m in MEASURES)
    # step 1 scores a fresh rollout (no update yet: natural routing is the rollout's); step 2 reuses it after one
    # update (num_iterations=2), when natural routing has moved and only replay keeps the rollout's experts
    ok = ok and logged[0][MEASURES[0]] == 0.0 and logged[1][MEASURES[0]] > 0.0
    print("routing replay: 2 GRPO steps, drift logged at each" if ok else "FAILED: drift measures missing")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
