"""Per-model conversion state: the rules a model was loaded/built with, kept on the model for saving and reports."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ConversionState",
    "STATE_ATTR",
    "get_state",
    "set_state",
    "add_state_listener",
    "owner_by_rule",
    "owner_by_id",
]

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

    # ``owner`` is keyed by id(rule), which a copy.deepcopy or pickle of the model does not keep: the state travels
    # with (rule, name) pairs and takes the new ids on arrival
    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "owner": owner_by_rule(self.owner, [*self.rules, *self.also_loads])}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update({**state, "owner": owner_by_id(state["owner"])})


def owner_by_rule(owner: dict[int, Any], rules: Iterable) -> list[tuple[Any, Any]]:
    """``[(rule, name)]`` for each rule of ``rules`` that ``owner`` (``{id(rule): name}``) names: a form that a
    ``copy.deepcopy`` or ``pickle`` carrying the rules along keeps valid (ids are not). See :func:`owner_by_id`."""
    seen: set[int] = set()
    pairs = []
    for rule in rules:
        if id(rule) in owner and id(rule) not in seen:
            seen.add(id(rule))
            pairs.append((rule, owner[id(rule)]))
    return pairs


def owner_by_id(pairs: list[tuple[Any, Any]]) -> dict[int, Any]:
    """The ``{id(rule): name}`` table back from :func:`owner_by_rule`'s pairs."""
    return {id(rule): name for rule, name in pairs}


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
