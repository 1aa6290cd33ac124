"""``modelpatch.undo.UndoStack``: every temporary change is undone, in reverse order, on every exit path."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from modelpatch.undo import ABSENT, UndoStack


def test_undo_restores_in_reverse_order_and_deletes_what_was_absent():
    module = nn.Linear(2, 2)
    weight, forward = module.weight, module.forward
    table = {"a": 1}
    undo = UndoStack()
    undo.setattr(module, "forward", lambda x: x)  # inherited method: undo must delete, not copy the bound method
    undo.setattr(module, "weight", nn.Parameter(torch.zeros(2, 2)))
    undo.setattr(module, "weight", nn.Parameter(torch.ones(2, 2)))
    undo.setitem(table, "a", 2)
    undo.setitem(table, "b", 3)
    undo.delitem(table, "a")
    assert len(undo) == 6
    undo.undo()
    assert "forward" not in vars(module) and module.forward.__func__ is forward.__func__
    assert module.weight is weight
    assert table == {"a": 1}
    assert len(undo) == 0


def test_undo_raw_class_attributes_and_on_exception():
    class Target:
        def __init__(self):
            self.x = 1

    own_init = vars(Target)["__init__"]
    with pytest.raises(KeyError):
        with UndoStack() as undo:
            undo.setattr(Target, "__init__", lambda self: None, raw=True)
            undo.setattr(Target, "added", 5, raw=True)
            raise KeyError("boom")
    assert vars(Target)["__init__"] is own_init and "added" not in vars(Target)


def test_undo_keeps_going_when_one_restore_fails_and_raises_the_first_error():
    class Frozen:
        locked = False

        def __setattr__(self, name, value):
            if Frozen.locked:
                raise AttributeError("frozen")
            object.__setattr__(self, name, value)

        def __delattr__(self, name):
            if Frozen.locked:
                raise AttributeError("frozen")
            object.__delattr__(self, name)

    obj = Frozen()
    table = {}
    undo = UndoStack()
    undo.setitem(table, "k", 1)
    undo.setattr(obj, "y", 2)
    Frozen.locked = True
    with pytest.raises(AttributeError, match="frozen"):
        undo.undo()
    assert table == {}  # restored although the attribute restore raised first
    assert repr(ABSENT) == "ABSENT"
