"""Per-model conversion state: the rules a model was loaded/built with, kept on the model for saving and reports."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ConversionState", "STATE_ATTR", "get_state", "set_state"]

STATE_ATTR = "_modelpatch_conversion"


@dataclass
class ConversionState:
    """``rules``: resolved rule instances (scoped); ``owner``: ``id(rule) -> registry name``; ``recorded_shapes``:
    checkpoint key -> shape of every tensor a converter consumed (used to split back exactly); ``load_rows`` /
    ``save_rows``: report rows of the last load and save."""

    rules: list
    owner: dict
    recorded_shapes: dict = field(default_factory=dict)
    load_rows: list = field(default_factory=list)
    save_rows: list = field(default_factory=list)


def get_state(model) -> ConversionState | None:
    return getattr(model, STATE_ATTR, None)


def set_state(model, state: ConversionState) -> None:
    """Attach ``state`` to ``model``; ``save_pretrained`` reverses it through :mod:`.hooks` (installed on import)."""
    object.__setattr__(model, STATE_ATTR, state)
