"""Checkpoint folders for the command line: validation, the model class to load, the built-in example.

The built-in example (used by ``modelpatch verify`` with no arguments) is a tiny Qwen2-MoE checkpoint (hidden 64,
2 layers, 4 experts, grouped-query attention with 4 query / 2 key-value heads, q/k/v biases) whose every tensor is
drawn from a seeded generator, so it is bit-identical on every machine. It is written once, atomically, under
``$MODELPATCH_CACHE`` (default ``~/.cache/modelpatch``) in ``qwen2_moe-tiny-v1/``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from .errors import CliError

__all__ = ["checkpoint_dir", "checkpoint_files", "model_class", "cache_dir", "example_checkpoint", "EXAMPLE_NAME"]

EXAMPLE_NAME = "qwen2_moe-tiny-v1"


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint folder (single file or sharded index), in index order.

    Raises:
        CliError: the folder holds no safetensors checkpoint.
    """
    from ..conversion import ConversionError
    from ..conversion.io import checkpoint_files as _files

    try:
        return _files(path)
    except ConversionError:
        raise CliError(f"'{path}' is not a checkpoint: no model.safetensors or model.safetensors.index.json") from None


def checkpoint_dir(path: str | os.PathLike) -> str:
    """Validate a checkpoint folder: it exists, has ``config.json`` and safetensors weights.

    Raises:
        CliError: missing folder, not a folder, or not a checkpoint (one line each).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CliError(f"model folder '{path}' does not exist")
    if not os.path.isdir(path):
        raise CliError(f"'{path}' is not a folder (give the checkpoint folder)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CliError(f"'{path}' is not a checkpoint: no config.json")
    checkpoint_files(path)
    return path


def read_config(path: str | os.PathLike):
    """``AutoConfig.from_pretrained(path)`` for a folder already checked to hold ``config.json``.

    Raises:
        CliError: the config cannot be read (invalid JSON, unknown ``model_type``, ...), as one line.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(f"cannot read '{os.path.join(os.fspath(path), 'config.json')}': {first}") from None


def model_class(config) -> type:
    """The class to load ``config`` with: ``config.architectures[0]`` when Transformers has it, else ``AutoModel``."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    return transformers.AutoModel


def cache_dir() -> str:
    """``$MODELPATCH_CACHE`` or ``~/.cache/modelpatch``."""
    return os.environ.get("MODELPATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "modelpatch")


def example_config():
    """Config of the built-in example (a tiny Qwen2-MoE with GQA and q/k/v biases)."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        vocab_size=128, max_position_embeddings=64, qkv_bias=True, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def _fill_deterministically(model: torch.nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype) * 0.2)


def example_checkpoint(*, rebuild: bool = False) -> str:
    """Folder of the built-in example checkpoint, generated on first use (a few hundred KiB).

    Built by manual construction (original classes) in a fresh context (no scoped conversion rule of the caller),
    so it holds the vanilla layout Transformers writes: one tensor per expert, separate q/k/v.
    """
    import contextvars

    target = os.path.join(cache_dir(), EXAMPLE_NAME)
    if not rebuild and os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{EXAMPLE_NAME}-", dir=cache_dir())
    try:
        contextvars.Context().run(_write_example, staging)  # no scoped patch/rule of the caller applies
        if rebuild and os.path.isdir(target):
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:  # another process won the race: theirs is identical
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _write_example(path: str) -> None:
    from transformers import Qwen2MoeForCausalLM

    model = Qwen2MoeForCausalLM(example_config())  # manual construction: original classes
    _fill_deterministically(model)
    model.save_pretrained(path)
