"""Which conversion rules fired on which keys."""

from __future__ import annotations

from ..patching.report import add_conversion_reader
from .plan import ConversionRow
from .state import get_state

__all__ = ["conversion_report"]


def conversion_report(model) -> list[ConversionRow]:
    """Rows of the last conversion-aware load (``from_pretrained`` or :func:`load_converted_state_dict`) and the last
    ``save_pretrained`` of ``model``: one :class:`ConversionRow` per converted group (e.g. one layer's q/k/v → qkv) and
    per renamed key. Empty for a model loaded without user rules."""
    state = get_state(model)
    if state is None:
        return []
    return list(state.load_rows) + list(state.save_rows)


add_conversion_reader(conversion_report)  # patch_report(model).conversion lists these rows
