"""Opening checkpoints lazily (safetensors slices via ``safetensors.safe_open``; never parsed by hand)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from safetensors import safe_open

from .errors import ConversionError

__all__ = ["checkpoint_files", "open_checkpoint", "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """Safetensors files of a checkpoint: a ``.safetensors`` file, or a folder with ``model.safetensors`` or a
    sharded ``model.safetensors.index.json`` (shards in index order).

    Raises:
        ConversionError: no safetensors checkpoint found at ``path``.
    """
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return [path]
    index = os.path.join(path, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        return [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
    single = os.path.join(path, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        return [single]
    raise ConversionError(f"No safetensors checkpoint ({SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}) at '{path}'")


@contextmanager
def open_checkpoint(source) -> Iterator[dict]:
    """Yield ``{key: tensor_like}`` for a state dict (returned as is) or a checkpoint path (lazy safetensors slices,
    valid inside the block)."""
    if isinstance(source, dict):
        yield source
        return
    with ExitStack() as stack:
        items = {}
        for file in checkpoint_files(source):
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for key in handle.keys():
                items[key] = handle.get_slice(key)
        yield items
