"""Per-model conversion state: the rules a model was loaded/built with, kept on the model for saving and reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConversionState", "STATE_ATTR", "get_state", "set_state", "add_state_listener"]

STATE_ATTR = "_modelpatch_conversion"


@dataclass
class ConversionState:
    """``rules``: resolved rule instances (scoped); ``owner``: ``id(rule) -> registry name``; ``recorded_shapes``:
    checkpoint key -> shape of every tensor a converter consumed (used to split back exactly); ``load_rows`` /
    ``save_rows``: report rows of the last load and save; ``also_loads``: the rules of the alternative layouts
    (:class:`~.rules.Layout`) the checkpoint was not in, which ``model.load_state_dict`` accepts too (never used on
    save: the model saves the layout it was loaded from)."""

    rules: list
    owner: dict
    recorded_shapes: dict = field(default_factory=dict)
    load_rows: list = field(default_factory=list)
    save_rows: list = field(default_factory=list)
    also_loads: list = field(default_factory=list)


def get_state(model) -> ConversionState | None:
    return getattr(model, STATE_ATTR, None)


_listeners: list[Callable[[Any, ConversionState | None], None]] = []


def add_state_listener(listener: Callable[[Any, ConversionState | None], None]) -> None:
    """Call ``listener(model, state)`` whenever :func:`set_state` runs (modules above this one plug in here, e.g.
    :mod:`.statedict` installs its ``load_state_dict`` hooks on the model)."""
    if listener not in _listeners:
        _listeners.append(listener)


def set_state(model, state: ConversionState | None) -> None:
    """Attach ``state`` to ``model`` (``None``: detach it); ``save_pretrained`` reverses it through :mod:`modelpatch.apply.transformers`
    (installed on import)."""
    if state is None:
        model.__dict__.pop(STATE_ATTR, None)
    else:
        object.__setattr__(model, STATE_ATTR, state)
    for listener in _listeners:
        listener(model, state)
