"""Reference shapes used to split fused tensors back exactly (e.g. GQA ``qkv_proj`` into 64/32/32 rows)."""

from __future__ import annotations

import copy
import threading

import torch

__all__ = ["ReferenceShapes", "state_shapes", "vanilla_meta_model", "vanilla_state_shapes"]


def state_shapes(named_tensors, base_model_prefix: str = "") -> dict[str, tuple[int, ...]]:
    """``{key: shape}``, also under the key without ``base_model_prefix.`` (checkpoints of the base model)."""
    shapes = {}
    prefix = f"{base_model_prefix}." if base_model_prefix else None
    for key, shape in named_tensors:
        shapes[key] = tuple(shape)
        if prefix and key.startswith(prefix):
            shapes.setdefault(key[len(prefix) :], tuple(shape))
    return shapes


def vanilla_meta_model(model):
    """The *unpatched* model class for ``model.config``, built on the ``meta`` device (no memory, no initialisation
    cost), or ``None`` if the class cannot be built. It is built in a fresh thread, which starts with an empty
    ``contextvars`` context, so class patches scoped to the caller's context do not apply."""
    result: list = []

    def build():
        try:
            with torch.device("meta"):
                result.append(type(model)(copy.deepcopy(model.config)))
        except Exception:  # noqa: BLE001 - a missing reference only means callers fall back or refuse
            pass

    thread = threading.Thread(target=build, name="modelpatch-reference-shapes")
    thread.start()
    thread.join()
    return result[0] if result else None


def vanilla_state_shapes(model) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the *unpatched* model class for ``model.config`` (:func:`vanilla_meta_model`), also under
    the keys without ``base_model_prefix.``. Returns ``{}`` if the class cannot be built."""
    reference = vanilla_meta_model(model)
    if reference is None:
        return {}
    return state_shapes(
        ((k, v.shape) for k, v in reference.state_dict().items()), getattr(model, "base_model_prefix", "")
    )


class ReferenceShapes:
    """``get(name)``: shape recorded from the loaded checkpoint, else (built once, on demand) the vanilla model's."""

    def __init__(self, recorded: dict | None, model=None):
        self._recorded = recorded or {}
        self._model = model
        self._vanilla: dict | None = None

    def get(self, name, default=None):
        if name in self._recorded:
            return self._recorded[name]
        if self._model is None:
            return default
        if self._vanilla is None:
            self._vanilla = vanilla_state_shapes(self._model)
        return self._vanilla.get(name, default)
