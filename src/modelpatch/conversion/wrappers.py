"""Seeing through the wrapper modules of other libraries (PEFT's LoRA layers) when a model is saved.

A library such as PEFT trains a model by replacing some of its modules with wrappers that hold the original module
(``qkv_proj`` becomes a LoRA layer whose ``base_layer`` is the original ``nn.Linear``) next to adapter weights
(``lora_A``, ``lora_B``). The model's state dict then names ``...qkv_proj.base_layer.weight`` and
``...qkv_proj.lora_A.default.weight``: neither is a key of the model's own layout, so conversion rules written for
``...qkv_proj.weight`` cannot reverse them.

A *wrapper view*, registered by :mod:`modelpatch.integrations` for a library it knows, maps a model to
``{wrapper module path: path of the wrapped base module relative to the wrapper}`` (``{"model.layers.0.self_attn.
qkv_proj": "base_layer"}``). :func:`unwrapped_state_dict` then gives the state dict of the model without its
wrappers: keys under a base module lose the relative path, every other key under a wrapper (adapter weights, the
trained copies of ``modules_to_save``) is left out. Only the outermost wrapper of a nested chain counts (its base
path already points through the inner ones).

A view may come with a *merge view* (``model -> paths of the wrappers whose adapters are not all merged into their
base module``): :func:`unmerged_wrappers` then tells the outermost wrappers whose saved base weights lack adapter
weights the model computes with from those whose base weights already include them (PEFT's ``merge_adapter()``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

import torch.nn as nn

from ..undo import UndoStack

__all__ = [
    "WrapperView",
    "register_wrapper_view",
    "wrapper_bases",
    "unmerged_wrappers",
    "wrapper_of",
    "unwrap_key",
    "unwrapped_names",
    "unwrapped_state_dict",
]

WrapperView = Callable[[nn.Module], Mapping[str, str]]
"""``model -> {wrapper module path: base module path relative to the wrapper}`` (paths as in ``named_modules``)."""

MergeView = Callable[[nn.Module], Collection[str]]
"""``model -> paths of its wrappers (any depth) holding adapter weights that are not merged into their base module``."""

_VIEWS: dict[str, WrapperView] = {}
_MERGE_VIEWS: dict[str, MergeView] = {}


def register_wrapper_view(name: str, view: WrapperView, undo: UndoStack, *, unmerged: MergeView | None = None) -> None:
    """Register ``view`` under ``name`` (one per library), and its merge view ``unmerged`` if given (a library
    without one has every wrapper counted as unmerged); ``undo.undo()`` removes both again."""
    undo.setitem(_VIEWS, name, view)
    if unmerged is not None:
        undo.setitem(_MERGE_VIEWS, name, unmerged)


def wrapper_bases(model: nn.Module) -> dict[str, str]:
    """The outermost wrappers in ``model`` seen by every registered view: ``{wrapper path: base path}``; ``{}`` when
    no view is registered or the model holds no wrapper."""
    found: dict[str, str] = {}
    for view in list(_VIEWS.values()):
        found.update(view(model))
    outer: dict[str, str] = {}
    for path in sorted(found, key=lambda p: p.count(".") if p else -1):
        if any(path == o or o == "" or path.startswith(o + ".") for o in outer):
            continue
        outer[path] = found[path]
    return outer


def unmerged_wrappers(model: nn.Module, bases: Mapping[str, str]) -> list[str]:
    """The paths among ``bases`` (outermost wrappers, :func:`wrapper_bases`) whose base weights lack adapter weights:
    a wrapper that is, or holds, a wrapper its library reports as unmerged, or any wrapper of a library without a
    merge view. Keeps the order of ``bases``."""
    unmerged: set[str] = set()
    for name, view in list(_VIEWS.items()):
        merge_view = _MERGE_VIEWS.get(name)
        unmerged.update(view(model) if merge_view is None else merge_view(model))
    return [path for path in bases if any(u == path or path == "" or u.startswith(path + ".") for u in unmerged)]


def wrapper_of(key: str, bases: Mapping[str, str]) -> str | None:
    """The path among ``bases`` of the wrapper holding state-dict ``key`` (the longest matching prefix), else ``None``."""
    parts = key.split(".")
    for i in range(len(parts) - 1, -1, -1):
        wrapper = ".".join(parts[:i])
        if wrapper in bases:
            return wrapper
    return None


def unwrap_key(key: str, bases: Mapping[str, str]) -> str | None:
    """``key`` of the wrapped model as a key of the unwrapped one (``...qkv_proj.base_layer.weight`` ->
    ``...qkv_proj.weight``), ``key`` itself when no wrapper holds it, ``None`` for an adapter key."""
    if not bases:
        return key
    parts = key.split(".")
    for i in range(len(parts) - 1, -1, -1):
        wrapper = ".".join(parts[:i])
        base = bases.get(wrapper)
        if base is None:
            continue
        rest = ".".join(parts[i:])
        if base == "":
            return key
        if rest.startswith(base + "."):
            return ".".join(p for p in (wrapper, rest[len(base) + 1 :]) if p)
        return None
    return key


def unwrapped_state_dict(state_dict: Mapping[str, object], bases: Mapping[str, str]) -> tuple[dict, list[str]]:
    """``(state dict without the wrappers, keys left out)``; see the module docstring. Keys keep their order."""
    kept: dict = {}
    dropped: list[str] = []
    for key, value in state_dict.items():
        new = unwrap_key(key, bases)
        if new is None:
            dropped.append(key)
        else:
            kept[new] = value
    return kept, dropped


def unwrapped_names(names: Iterable[str], bases: Mapping[str, str]) -> list[str]:
    """The keys among ``names`` as keys of the unwrapped model (adapter keys left out)."""
    return [new for new in (unwrap_key(name, bases) for name in names) if new is not None]
