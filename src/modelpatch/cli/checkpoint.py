"""Checkpoint folders for the command line: validation, the model class to load, the built-in example.

The built-in example (used by ``modelpatch verify`` with no arguments) is a tiny Qwen2-MoE checkpoint (hidden 64,
2 layers, 4 experts, grouped-query attention with 4 query / 2 key-value heads, q/k/v biases) whose every tensor is
drawn from a seeded generator, so it is bit-identical on every machine. It is written once, atomically, under
``$MODELPATCH_CACHE`` (default ``~/.cache/modelpatch``) in ``qwen2_moe-tiny-v1/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from ..undo import context_set
from .errors import CliError

__all__ = [
    "add_trust_remote_code",
    "remote_code_kwargs",
    "trusting_remote_code",
    "checkpoint_dir",
    "checkpoint_files",
    "checkpoint_keys",
    "model_class",
    "cache_dir",
    "example_checkpoint",
    "EXAMPLE_NAME",
]

EXAMPLE_NAME = "qwen2_moe-tiny-v1"


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint folder (single file or sharded index), in index order, each checked to
    exist and to have a readable safetensors header (only the header is read).

    Raises:
        CliError: the folder holds no safetensors checkpoint; its index cannot be read, has no ``weight_map``, names a
            shard that is not there or has no ``metadata`` (Transformers requires it); a file is not a readable
            safetensors file (e.g. truncated). One line, naming the file at fault.
    """
    from ..conversion import ConversionError
    from ..conversion.io import SAFE_WEIGHTS_INDEX_NAME
    from ..conversion.io import checkpoint_files as _files

    index = os.path.join(path, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        _check_index(path, index)
    try:
        files = _files(path)
    except ConversionError:
        raise CliError(f"'{path}' is not a checkpoint: no model.safetensors or model.safetensors.index.json") from None
    for file in files:
        _check_header(file)
    return files


def _check_index(folder: str, index: str) -> None:
    try:
        with open(index) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read '{index}': {_first_line(exc)}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CliError(f"'{index}' has no \"weight_map\" dict of parameter name -> shard file")
    missing = [name for name in dict.fromkeys(weight_map.values()) if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        more = f" (and {len(missing) - 1} other missing shard(s))" if len(missing) > 1 else ""
        raise CliError(f"'{index}' names shard '{missing[0]}', which is not in '{folder}'{more}")
    if not isinstance(data.get("metadata"), dict):
        raise CliError(
            f"'{index}' has no \"metadata\" dict, which Transformers needs to load it "
            '(add "metadata": {} beside "weight_map")'
        )


def _check_header(file: str) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt", device="cpu"):  # parses and checks the header only
            pass
    except (SafetensorError, OSError) as exc:
        raise CliError(
            f"'{file}' is not a readable safetensors file (truncated or corrupt?): {_first_line(exc)}"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def checkpoint_keys(path: str) -> list[str]:
    """Every tensor name of a checkpoint folder, read from the safetensors headers (no tensor is read).

    Raises:
        CliError: as :func:`checkpoint_files`.
    """
    from safetensors import safe_open

    keys = []
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as handle:
            keys.extend(handle.keys())
    return keys


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


_TRUST_REMOTE_CODE: ContextVar[bool] = ContextVar("modelpatch_cli_trust_remote_code", default=False)


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """The ``--trust-remote-code`` option of every subcommand that loads a checkpoint."""
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the checkpoint's own modeling code (config.json auto_map), as from_pretrained(trust_remote_code=True)",
    )


@contextlib.contextmanager
def trusting_remote_code(enabled: bool) -> Iterator[None]:
    """While the block runs (this context only), the command's loads pass ``trust_remote_code=enabled``."""
    with context_set(_TRUST_REMOTE_CODE, enabled):
        yield


def remote_code_kwargs() -> dict:
    """``{"trust_remote_code": ...}`` for the command's ``from_pretrained`` calls: always explicit, so Transformers
    never prompts on stdin."""
    return {"trust_remote_code": _TRUST_REMOTE_CODE.get()}


def _refuse_untrusted_remote_code(path: str | os.PathLike) -> None:
    try:
        with open(os.path.join(os.fspath(path), "config.json")) as fh:
            auto_map = json.load(fh).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return  # AutoConfig reports an unreadable config.json
    if auto_map and not _TRUST_REMOTE_CODE.get():
        raise CliError(
            f"'{os.fspath(path)}' needs its own modeling code (config.json auto_map: "
            f"{', '.join(sorted(auto_map))}): pass --trust-remote-code to run it"
        )


def read_config(path: str | os.PathLike):
    """``AutoConfig.from_pretrained(path)`` for a folder already checked to hold ``config.json``.

    Raises:
        CliError: the config cannot be read (invalid JSON, unknown ``model_type``, ...), or it needs remote code
            and ``--trust-remote-code`` was not given, as one line.
    """
    from transformers import AutoConfig

    _refuse_untrusted_remote_code(path)
    try:
        return AutoConfig.from_pretrained(path, **remote_code_kwargs())
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


def _usable_cache_dir() -> str:
    """:func:`cache_dir`, created if needed and checked to be a writable folder.

    Raises:
        CliError: it cannot be created, is not a folder or is not writable (one line naming it and the variable).
    """
    path = cache_dir()
    where = (
        "MODELPATCH_CACHE" if os.environ.get("MODELPATCH_CACHE") else "the default cache folder; MODELPATCH_CACHE unset"
    )
    fix = "set MODELPATCH_CACHE to a writable folder"
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError(f"cache folder '{path}' ({where}) is not usable: it is a file, not a folder; {fix}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cache folder '{path}' ({where}) cannot be created: {exc.strerror or exc}; {fix}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CliError(f"cache folder '{path}' ({where}) is not writable; {fix}")
    return path


def example_config():
    """Config of the built-in example (a tiny Qwen2-MoE with GQA and q/k/v biases)."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=64,
        qkv_bias=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
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

    Raises:
        CliError: the cache folder (``$MODELPATCH_CACHE``) is a file, cannot be created or is not writable.
    """
    import contextvars

    target = os.path.join(cache_dir(), EXAMPLE_NAME)
    if not rebuild and os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    cache = _usable_cache_dir()
    try:
        staging = tempfile.mkdtemp(prefix=f".{EXAMPLE_NAME}-", dir=cache)
    except OSError as exc:
        raise CliError(
            f"cannot write in the cache folder '{cache}': {exc.strerror or exc}; set MODELPATCH_CACHE to a "
            "writable folder"
        ) from None
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
