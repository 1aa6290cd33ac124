"""Tiny models for tests: hidden size 64, 2 layers, saved with save_pretrained into a temp folder.

Every tiny config of the suite is defined here, once: each ``tiny_<family>_config(**overrides)`` returns a fresh
config (keyword arguments override or add fields). Decoders share :data:`TINY` (GQA: 4 query heads, 2 key/value
heads) and MoE decoders :data:`TINY_MOE` (experts of 32, top-2); only what a family needs is added.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import (
    BertConfig,
    CLIPVisionConfig,
    DeepseekV3Config,
    GPT2Config,
    GPTNeoConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    TrainerCallback,
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
"""Sizes every tiny decoder config starts from."""

TINY_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
"""Added to :data:`TINY` by MoE decoders that have a separate expert size (4 experts each, set per family)."""


def _config(config_class, *layers: dict, overrides: dict):
    kwargs: dict = {}
    for layer in (*layers, overrides):
        kwargs.update(layer)
    return config_class(**kwargs)


def tiny_llama_config(**overrides) -> LlamaConfig:
    return _config(LlamaConfig, TINY, overrides=overrides)


def tiny_mistral_config(**overrides) -> MistralConfig:
    return _config(MistralConfig, TINY, overrides=overrides)


def tiny_qwen2_config(**overrides) -> Qwen2Config:
    return _config(Qwen2Config, TINY, overrides=overrides)


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    """Qwen3's own ``head_dim`` (128) is kept: its attention is wider than ``hidden_size``, as in the real models."""
    return _config(Qwen3Config, TINY, overrides=overrides)


def tiny_qwen2_moe_config(**overrides) -> Qwen2MoeConfig:
    """Multi-head attention (4 key/value heads) unless overridden: the seed example's fused QKV assumes MHA."""
    return _config(
        Qwen2MoeConfig,
        TINY,
        TINY_MOE,
        dict(shared_expert_intermediate_size=64, num_key_value_heads=4, num_experts=4),
        overrides=overrides,
    )


def tiny_qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    return _config(Qwen3MoeConfig, TINY, TINY_MOE, dict(num_experts=4), overrides=overrides)


def tiny_mixtral_config(**overrides) -> MixtralConfig:
    """Mixtral's experts are ``intermediate_size`` wide (it has no ``moe_intermediate_size``)."""
    return _config(MixtralConfig, TINY, dict(num_local_experts=4, num_experts_per_tok=2), overrides=overrides)


def tiny_olmoe_config(**overrides) -> OlmoeConfig:
    return _config(OlmoeConfig, TINY, dict(num_experts=4, num_experts_per_tok=2), overrides=overrides)


def tiny_deepseek_v3_config(**overrides) -> DeepseekV3Config:
    """Layer 0 dense, layer 1 MoE (4 routed experts, one group); multi-head latent attention without q LoRA."""
    return _config(
        DeepseekV3Config,
        TINY,
        TINY_MOE,
        dict(
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
        overrides=overrides,
    )


def tiny_bert_config(**overrides) -> BertConfig:
    return _config(
        BertConfig,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=128,
            max_position_embeddings=64,
        ),
        overrides=overrides,
    )


def tiny_gpt2_config(**overrides) -> GPT2Config:
    return _config(
        GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64), overrides=overrides
    )


def tiny_gpt_neo_config(**overrides) -> GPTNeoConfig:
    return _config(
        GPTNeoConfig,
        dict(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            vocab_size=128,
            max_position_embeddings=64,
            window_size=8,
        ),
        overrides=overrides,
    )


def tiny_gpt_neox_config(**overrides) -> GPTNeoXConfig:
    return _config(
        GPTNeoXConfig,
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128),
        overrides=overrides,
    )


def tiny_clip_vision_config(**overrides) -> CLIPVisionConfig:
    """A vision tower for tiny Llava models: hidden size 32, 2 layers, 32x32 images in 8x8 patches."""
    return _config(
        CLIPVisionConfig,
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        overrides=overrides,
    )


def save_tiny(model_cls, config, path, seed: int = 0):
    """Build ``model_cls(config)`` with a fixed seed, save it to ``path`` and return the model."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    return model


INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7]])


class Inert(nn.Module):
    """A replacement that takes any constructor arguments and holds nothing: where a test needs a class, not a layer."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def modelpatch_records(caplog, level: int) -> list[str]:
    """The messages modelpatch's own logger emitted at exactly ``level`` (``caplog`` is pytest's fixture)."""
    return [r.getMessage() for r in caplog.records if r.name == "modelpatch" and r.levelno == level]


# ---- 2-process runs (torchrun / accelerate launch) and their Trainer setup ----

LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
"""Environment every 2-process launch of the suite adds (one thread per process: the machine has 2 cores)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``--main_process_port``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script) -> list[str]:
    """``torchrun --standalone --nproc_per_node 2 script`` as a command of this interpreter."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]


def accelerate_command(*options: str) -> list[str]:
    """``accelerate launch --num_processes 2 --num_machines 1 *options`` (no mixed precision, no dynamo, a free
    port) as a command of this interpreter; the script and its arguments follow."""
    import sys

    command = [sys.executable, "-m", "accelerate.commands.launch", *options, "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return command + ["--main_process_port", str(free_port())]


def launch(command: list[str], timeout: float, env: dict | None = None, log=None) -> str:
    """Run a 2-process launch ``command`` (its own session) with :data:`LAUNCH_ENV` and ``env`` added, the
    modelpatch this process imported first on ``PYTHONPATH``; the whole process group (launcher and workers) is killed
    after ``timeout`` seconds. Returns what went wrong (exit code or timeout, with the end of the output), empty
    when nothing did; ``log`` (a path): where to write the whole output (the workers' tracebacks of errors they
    report to the test)."""
    import os
    import signal
    import subprocess
    from pathlib import Path

    import modelpatch

    full_env = {**os.environ, **LAUNCH_ENV, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(modelpatch.__file__).parents[1]), full_env.get("PYTHONPATH", "")]
    )
    proc = subprocess.Popen(
        command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return f"{command[2:]} killed after {timeout} s:\n{stderr.decode()[-5000:]}"
    if log is not None:
        Path(log).write_bytes(stdout + b"\n" + stderr)
    if proc.returncode != 0:
        return f"{command[2:]} exit code {proc.returncode}:\n{stdout.decode()[-2000:]}{stderr.decode()[-6000:]}"
    return ""


def accelerate_state_without_gpu(engine: str) -> None:
    """The accelerate workaround of the suite's 2-process Trainer runs on a machine without a GPU (accelerate 1.15
    and 1.16), in one place; call it in each worker process before ``TrainingArguments`` (which must then get
    ``accelerator_config={"use_configured_state": True}``: :func:`distributed_training_arguments`).

    * ``"deepspeed"``: ``AcceleratorState`` falls back to its CPU branch and reports a world size of 1 under
      DeepSpeed, so the Trainer's ``train_batch_size`` check fails against DeepSpeed's own count of 2. Building the
      distributed ``PartialState`` with gloo first, with ``ACCELERATE_USE_DEEPSPEED=true``, works around it.
    * ``"fsdp"``: ``AcceleratorState`` switches to ``DistributedType.FSDP`` (and builds the FSDP plugin from
      ``accelerate launch``'s environment) only from a multi-accelerator type (``MULTI_GPU``, ``MULTI_XPU``, ...),
      never from ``MULTI_CPU``, and without ``cpu=True`` a ``PartialState`` on a machine without an accelerator is
      ``DistributedType.NO`` even with 2 processes: the Trainer would train unsharded, each rank on its own. The
      ``PartialState`` is built on the CPU with gloo and its shared type set to ``MULTI_GPU`` (its device stays
      the CPU), so ``AcceleratorState`` takes its FSDP branch as on a GPU machine.
    """
    import os

    from accelerate import PartialState
    from accelerate.utils import DistributedType

    if engine == "deepspeed":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    elif engine == "fsdp":
        assert os.environ.get("ACCELERATE_USE_FSDP") == "true", "launch with accelerate launch --use_fsdp"
        state = PartialState(cpu=True, backend="gloo")
        assert state.distributed_type == DistributedType.MULTI_CPU and state.num_processes == 2, state
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    else:
        raise ValueError(f"engine {engine!r}: 'deepspeed' or 'fsdp'")


def distributed_training_arguments(output_dir: str, **kwargs):
    """``TrainingArguments`` of the suite's 2-process Trainer runs (after :func:`accelerate_state_without_gpu`):
    one sequence per rank and step, SGD at a constant learning rate without gradient clipping, a checkpoint after
    every step, seeds 0, no reporting; ``kwargs`` override or add."""
    from transformers import TrainingArguments

    defaults = dict(
        per_device_train_batch_size=1,
        optim="sgd",
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=1,
        logging_steps=100,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        max_grad_norm=0.0,
        report_to=[],
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True},
    )
    return TrainingArguments(output_dir=output_dir, **{**defaults, **kwargs})


def in_order_trainer(model, args, train_dataset, **kwargs):
    """A ``transformers.Trainer`` that takes the rows in order: step ``s`` of a 2-process run is rows ``2s`` (rank
    0) and ``2s + 1`` (rank 1), as one process's batch of 2."""
    from transformers import Trainer

    class InOrder(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder(model=model, args=args, train_dataset=train_dataset, **kwargs)


class StepCounter(TrainerCallback):
    """A Trainer callback counting the steps run in this process and recording the step a run started at (after a
    resume: the checkpoint's)."""

    def __init__(self) -> None:
        self.started_at: int | None = None
        self.run = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started_at = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.run += 1

    def as_dict(self, trainer) -> dict:
        return {"started_at": self.started_at, "run": self.run, "global_step": trainer.state.global_step}


def one_line_error(capsys, argv) -> str:
    """Run ``argv``, which must fail with exit status 2 and one line on stderr; returns that line."""
    from modelpatch.cli import main  # the CLI imports heavy modules: only the tests that run it pay for them

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("modelpatch: error: ") and "Traceback" not in err, err
    return err.strip()
