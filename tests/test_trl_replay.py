"""A real TRL ``GRPOTrainer`` run with routing replay (issue 12, section 1).

A witness independent of modelpatch (forward pre-hooks on the experts modules, :class:`ExpertsObserver`) records
the experts every token was sent to during generation and during every log-probability forward of training (policy
loss, old policy, reference); each training token must be sent to exactly the experts its rollout used. The routers
are perturbed right after each rollout, so natural routing would differ (the test counts how much), and the run
uses ``num_iterations=2`` and ``gradient_accumulation_steps=2`` (TRL shuffles and splits the generation batch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig

from modelpatch.integrations.trl import RoutingReplayGRPOTrainer
from modelpatch.routing import record_routing
from routing_models import ExpertsObserver, perturb_routers, tiny_model

VOCAB = 128


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def _prompts(n: int = 8) -> Dataset:
    rng = np.random.default_rng(0)
    return Dataset.from_dict(
        {"prompt": [" ".join(f"w{t}" for t in rng.integers(2, VOCAB, size=rng.integers(3, 7))) for _ in range(n)]}
    )


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


class WitnessTrainer(RoutingReplayGRPOTrainer):
    """Records, with hooks modelpatch does not own, the experts of every rollout token and of every training-side
    token; perturbs the routers after each rollout."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout_routes: dict[tuple, dict[int, torch.Tensor]] = {}
        self.compared = self.mismatched = self.naturally_different = 0
        self.forwards = 0

    def _generate(self, prompts):
        with ExpertsObserver(self.model) as seen:
            result = super()._generate(prompts)
        prompt_ids, completion_ids = result[0], result[1]
        batch = len(prompt_ids)
        width = max(len(p) for p in prompt_ids)
        for layer, calls in seen.calls.items():
            first = calls[0][0].view(batch, width, -1)
            steps = [idx.view(batch, 1, -1) for idx, _ in calls[1:]]
            for b, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
                rows = [first[b, width - len(prompt) :]] + [step[b] for step in steps]
                key = tuple(prompt) + tuple(completion)
                self.rollout_routes.setdefault(key, {})[layer] = torch.cat(rows)[: len(key)]
        perturb_routers(self.accelerator.unwrap_model(self.model), seed=len(self.rollout_routes))
        return result

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        with ExpertsObserver(self.accelerator.unwrap_model(model)) as seen:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        with torch.no_grad(), record_routing(model) as natural:
            model(input_ids=input_ids, attention_mask=attention_mask)
        self.forwards += 1
        mask = attention_mask.bool()
        for layer, calls in seen.calls.items():
            used = torch.cat([idx for idx, _ in calls]).view(*input_ids.shape, -1)
            for b in range(input_ids.shape[0]):
                key = tuple(input_ids[b][mask[b]].tolist())
                truth = self.rollout_routes[key][layer]
                n = truth.shape[0]  # the last generated token was never routed during the rollout
                got = used[b][mask[b]][:n].sort(dim=-1).values
                want = truth.sort(dim=-1).values
                self.compared += n
                self.mismatched += int((got != want).any(dim=-1).sum())
                nat = natural[layer][b][:n].sort(dim=-1).values
                self.naturally_different += int((nat != want).any(dim=-1).sum())
        return result


def _config(tmp_path, **overrides) -> GRPOConfig:
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        num_iterations=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        beta=0.04,  # a reference model: its forwards replay too
        disable_tqdm=True,
        save_strategy="no",
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_every_training_forward_replays_the_rollout_routing(tmp_path, model_type):
    model = tiny_model(model_type)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    model.save_pretrained(tmp_path / "model")  # TRL loads the policy and the reference from the folder
    trainer = WitnessTrainer(
        model=str(tmp_path / "model"),
        reward_funcs=length_reward,
        args=_config(tmp_path),
        train_dataset=_prompts(),
        processing_class=_tokenizer(),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.forwards >= 4  # old-policy / reference / loss forwards over two generation batches
    assert trainer.compared > 200
    assert trainer.mismatched == 0
    assert trainer.naturally_different > trainer.compared // 10  # not vacuous: natural routing moved away
    logged = [entry for entry in trainer.state.log_history if "routing/router_disagreement" in entry]
    assert logged and all(0.0 < entry["routing/router_disagreement"] <= 1.0 for entry in logged)


def _engine_rollout(prompts, trainer):
    """A ``rollout_func`` standing in for vLLM with ``enable_return_routed_experts=True``: it generates and returns,
    per completion, the engine array ``(seq_len - 1, num_layers, top_k)`` int32 (built here by recording)."""
    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompt_ids])[:, None]).long()
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()  # as TRL's own generation: no activation checkpointing, so the KV cache is used
    with torch.no_grad(), record_routing(model) as trace:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True, pad_token_id=0)
    model.train()
    completion_ids = [row[width:].tolist() for row in out]
    arrays = [a.numpy().astype(np.int32) for a in trace.to_routed_experts()]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "routed_experts": arrays}


@pytest.mark.slow
def test_engine_routes_from_rollout_func_are_replayed(tmp_path):
    model = tiny_model("qwen3_moe")
    model.generation_config.eos_token_id = 1
    model.save_pretrained(tmp_path / "model")
    trainer = WitnessTrainer(
        model=str(tmp_path / "model"),
        reward_funcs=length_reward,
        args=_config(tmp_path, beta=0.0, max_steps=1),
        train_dataset=_prompts(),
        processing_class=_tokenizer(),
        rollout_func=_engine_rollout,
    )
    trainer.train()
    assert trainer.compared > 100 and trainer.mismatched == 0
    assert trainer.naturally_different > trainer.compared // 10


def test_rollout_func_without_routes_and_tools_are_refused(tmp_path):
    from modelpatch.errors import ModelpatchValueError

    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path / "model")

    def no_routes(prompts, trainer):
        result = _engine_rollout(prompts, trainer)
        del result["routed_experts"]
        return result

    trainer = RoutingReplayGRPOTrainer(
        model=str(tmp_path / "model"),
        reward_funcs=length_reward,
        args=_config(tmp_path, beta=0.0, max_steps=1),
        train_dataset=_prompts(),
        processing_class=_tokenizer(),
        rollout_func=no_routes,
    )
    with pytest.raises(ModelpatchValueError, match="return 'routed_experts'"):
        trainer.train()


@pytest.mark.slow
def test_two_processes_with_accelerate_launch(tmp_path):
    import json
    import os
    import socket
    import subprocess
    import sys

    model = tiny_model("qwen3_moe")
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    model.save_pretrained(tmp_path / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = os.path.join(os.path.dirname(__file__), "trl_dist_worker.py")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(port), worker, str(tmp_path / "model"), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 and r["steps"] == 2 for r in ranks)
    assert all(r["compared"] > 100 and r["mismatched"] == 0 for r in ranks)
    assert all(r["naturally_different"] > r["compared"] // 10 for r in ranks)
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # DDP kept the replicas equal
