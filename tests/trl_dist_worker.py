"""One process of ``accelerate launch --cpu --num_processes 2 tests/trl_dist_worker.py MODEL OUT``: a real
``RoutingReplayGRPOTrainer`` run under DDP (gloo), with the witness of tests/test_trl_replay.py; each rank writes its
counts and a checksum of its final parameters to ``OUT/rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from test_trl_replay import WitnessTrainer, _config, _prompts, _tokenizer, length_reward  # noqa: E402


def main(model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    trainer = WitnessTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=_config(os.path.join(out, "run"), per_device_train_batch_size=2, num_generations=4),
        train_dataset=_prompts(16),
        processing_class=_tokenizer(),
    )
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    rank = trainer.accelerator.process_index
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(
            {
                "world": trainer.accelerator.num_processes,
                "compared": trainer.compared,
                "mismatched": trainer.mismatched,
                "naturally_different": trainer.naturally_different,
                "checksum": checksum,
                "steps": trainer.state.global_step,
            },
            fh,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
