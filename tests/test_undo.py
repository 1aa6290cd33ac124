"""modelpatch.undo.UndoStack: batched raw attribute changes (what every record / replay block does per module)."""

from __future__ import annotations

import pytest
import torch

from modelpatch.undo import UndoStack


def test_setattrs_raw_sets_in_order_and_undo_restores_own_values():
    module = torch.nn.Linear(2, 2)
    module.__dict__["_mine"] = "before"
    forward = module.forward
    undo = UndoStack()
    undo.setattrs_raw(module, {"_mine": 1, "forward": "driven", "_new": 2})
    assert (module._mine, module.forward, module._new) == (1, "driven", 2)
    assert len(undo) == 3
    undo.undo()
    assert module.__dict__["_mine"] == "before"
    assert "forward" not in module.__dict__ and "_new" not in module.__dict__  # inherited again, not copied on
    assert module.forward == forward


def test_setattrs_raw_keeps_what_it_set_before_a_failure_for_undo():
    class Slotted:
        __slots__ = ("__dict__", "fixed")

        @property
        def locked(self):
            return 0

    target = Slotted()
    undo = UndoStack()
    with pytest.raises(AttributeError):
        undo.setattrs_raw(target, {"a": 1, "locked": 2, "b": 3})  # a property without a setter
    assert target.a == 1 and not hasattr(target, "b")
    undo.undo()
    assert not hasattr(target, "a")
    with pytest.raises(TypeError, match="is a class"):
        undo.setattrs_raw(Slotted, {"a": 1})
