"""``modelpatch.undo.UndoStack``: every temporary change is undone, in reverse order, on every exit path."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch
import torch.nn as nn

from modelpatch.undo import ABSENT, UndoStack, context_set


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


# -- callback ---------------------------------------------------------------------------------------------------


def test_callbacks_run_in_reverse_order_among_the_other_changes():
    calls: list[object] = []
    table = {"a": 1}
    undo = UndoStack()
    append = calls.append
    assert undo.callback(append, "first") is append  # returns the callable, as ExitStack.callback does
    undo.setitem(table, "a", 2)
    undo.callback(lambda *args, **kwargs: calls.append((args, kwargs, dict(table))), 1, 2, key="v")
    undo.setitem(table, "b", 3)
    assert len(undo) == 4
    undo.undo()
    # LIFO: "b" removed before the second callback runs, "a" restored before the first
    assert calls == [((1, 2), {"key": "v"}, {"a": 2}), "first"]
    assert table == {"a": 1} and len(undo) == 0
    undo.undo()  # empty: nothing runs twice
    assert len(calls) == 2


def test_a_failing_callback_does_not_stop_the_undo_and_the_first_error_is_raised():
    calls: list[str] = []
    table = {"a": 1}

    def fail(message):
        calls.append(message)
        raise RuntimeError(message)

    undo = UndoStack()
    undo.callback(calls.append, "bottom")
    undo.callback(fail, "second to run")
    undo.setitem(table, "a", 2)
    undo.callback(fail, "first to run")
    with pytest.raises(RuntimeError, match="first to run"):
        undo.undo()
    assert calls == ["first to run", "second to run", "bottom"]
    assert table == {"a": 1}


# -- wrap: installed, taken off only while still ours -----------------------------------------------------------


class _Library:
    """Stands for another library's namespace: a module-level function and a classmethod in a class dict."""

    @staticmethod
    def double(x):
        return 2 * x

    @classmethod
    def build(cls, x):
        return (cls.__name__, x)


def test_wrap_calls_the_factory_with_the_original_and_undo_restores_it():
    own_double, own_build = vars(_Library)["double"], vars(_Library)["build"]
    undo = UndoStack()
    original = undo.wrap(_Library, "double", factory=lambda original: lambda x: original(x) + 1)
    assert original(5) == 10 and _Library.double(5) == 11

    def build(cls, x):
        return ("wrapped", own_build.__func__(cls, x))

    assert undo.wrap(_Library, "build", classmethod(build), raw=True) is own_build  # the stored classmethod
    assert _Library.build(3) == ("wrapped", ("_Library", 3))
    undo.undo()
    assert vars(_Library)["double"] is own_double and vars(_Library)["build"] is own_build
    assert (_Library.double(5), _Library.build(3)) == (10, ("_Library", 3))


def test_wrap_leaves_a_wrapper_installed_on_top_of_ours_and_its_chain_still_works():
    own_double = vars(_Library)["double"]
    undo = UndoStack()
    ours_original = undo.wrap(_Library, "double", factory=lambda original: staticmethod(lambda x: original(x) + 1))
    ours = vars(_Library)["double"]
    theirs_original = _Library.double  # another library wraps what it finds: ours
    _Library.double = staticmethod(lambda x: theirs_original(x) * 100)
    try:
        assert _Library.double(5) == 1100
        undo.undo()  # not ours any more: left as it is, nothing clobbered
        assert vars(_Library)["double"] is not ours and _Library.double(5) == 1100  # theirs -> ours -> original
        assert ours_original(5) == 10
    finally:
        _Library.double = own_double
    # the same with theirs taken off before our undo: ours is on top again, so undo restores the original
    undo.wrap(_Library, "double", factory=lambda original: staticmethod(lambda x: original(x) + 1))
    ours = vars(_Library)["double"]
    _Library.double = staticmethod(lambda x: 0)
    _Library.double = ours
    undo.undo()
    assert vars(_Library)["double"] is own_double


def test_wrap_of_an_inherited_method_is_undone_by_deleting_the_own_attribute():
    module = nn.Linear(2, 2)
    undo = UndoStack()
    original = undo.wrap(module, "forward", factory=lambda original: lambda x: original(x) * 0)
    assert original.__self__ is module and "forward" in vars(module)
    assert module(torch.ones(1, 2)).abs().sum() == 0
    undo.undo()
    assert "forward" not in vars(module) and module.forward.__func__ is nn.Linear.forward


def test_wrap_refuses_bad_arguments_and_changes_nothing():
    from modelpatch.errors import ModelpatchTypeError

    undo = UndoStack()
    with pytest.raises(ModelpatchTypeError, match="exactly one of wrapper= and factory="):
        undo.wrap(_Library, "double")
    with pytest.raises(ModelpatchTypeError, match="exactly one"):
        undo.wrap(_Library, "double", lambda x: x, factory=lambda original: original)
    with pytest.raises(AttributeError, match="class _Library has no attribute 'missing' to wrap"):
        undo.wrap(_Library, "missing", lambda x: x)
    with pytest.raises(AttributeError, match="'build'"):
        undo.wrap(type("Sub", (_Library,), {}), "build", lambda x: x, raw=True)  # inherited: not in the class dict
    assert len(undo) == 0 and "missing" not in vars(_Library)


def test_enter_context_exits_the_manager_in_its_place_among_the_other_entries():
    import contextlib

    events: list[str] = []

    @contextlib.contextmanager
    def managed(label):
        events.append(f"enter {label}")
        try:
            yield label.upper()
        finally:
            events.append(f"exit {label}")

    undo = UndoStack()
    assert undo.enter_context(managed("a")) == "A"
    undo.callback(events.append, "callback")
    undo.enter_context(managed("b"))
    undo.undo()
    assert events == ["enter a", "enter b", "exit b", "callback", "exit a"]


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


class _WithProperty:
    def __init__(self) -> None:
        self._x = 1

    @property
    def x(self) -> int:
        return self._x

    @x.setter
    def x(self, value: int) -> None:
        self._x = value


def test_setattr_of_a_property_with_a_setter_is_undone_through_the_setter():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    holder = _WithProperty()
    with UndoStack() as undo:  # num_labels, name_or_path: properties with setters and no deleter
        undo.setattr(config, "num_labels", 5)
        undo.setattr(config, "name_or_path", "x")
        undo.setattr(holder, "x", 7)
        assert (config.num_labels, config.name_or_path, holder.x) == (5, "x", 7)
    assert (config.num_labels, config.name_or_path, holder.x) == (2, "", 1)
    assert config.id2label == {0: "LABEL_0", 1: "LABEL_1"}


def test_raw_delattr_of_a_missing_name_is_a_clear_attribute_error():
    undo = UndoStack()
    with pytest.raises(AttributeError, match="'nope'"):
        undo.delattr(_WithProperty, "nope", raw=True)
    assert len(undo) == 0


_LEVEL: contextvars.ContextVar[int] = contextvars.ContextVar("_LEVEL", default=0)


def test_context_set_resets_on_any_exit_and_nests():
    with context_set(_LEVEL, 1) as value:
        assert value == 1 and _LEVEL.get() == 1
        with pytest.raises(KeyError), context_set(_LEVEL, 2):
            assert _LEVEL.get() == 2
            raise KeyError("inner")
        assert _LEVEL.get() == 1
    assert _LEVEL.get() == 0


def test_context_set_is_per_thread():
    seen = []
    with context_set(_LEVEL, 5):
        thread = threading.Thread(target=lambda: seen.append(_LEVEL.get()))
        thread.start()
        thread.join()
    assert seen == [0]


def test_set_context_is_reset_in_its_place_among_the_other_entries():
    log = []
    with UndoStack() as undo:
        undo.callback(lambda: log.append(("first pushed", _LEVEL.get())))
        undo.set_context(_LEVEL, 3)
        undo.callback(lambda: log.append(("last pushed", _LEVEL.get())))
        assert _LEVEL.get() == 3
    assert log == [("last pushed", 3), ("first pushed", 0)]
    assert _LEVEL.get() == 0


# -- nn.Module: the kind of attribute and the order of its tables -------------------------------------------------


def _tables(module):
    """Where each name lives, in order: what parameters() / buffers() / children() / state_dict() follow."""
    return (
        list(module._parameters),
        list(module._buffers),
        sorted(module._non_persistent_buffers_set),
        list(module._modules),
    )


@pytest.mark.parametrize(
    "before, after",
    [
        ("plain", "module"),
        ("plain", "parameter"),
        ("buffer", "parameter"),
        ("persistent buffer", "module"),
        ("module", "parameter"),
        ("parameter", "absent"),
        ("buffer", "absent"),
        ("module", "absent"),
        ("absent", "parameter"),
        ("absent", "module"),
    ],
)
def test_undo_of_a_module_attribute_that_changes_kind_puts_it_back_in_its_table_at_its_place(before, after):
    module = nn.Module()
    module.first = nn.Parameter(torch.zeros(1))
    module.register_buffer("b0", torch.zeros(1))
    module.child0 = nn.Linear(1, 1)
    values = {
        "plain": 3,
        "parameter": nn.Parameter(torch.ones(2)),
        "buffer": torch.full((2,), 5.0),
        "persistent buffer": torch.full((2,), 6.0),
        "module": nn.Linear(2, 2),
    }
    if before == "buffer":
        module.register_buffer("x", values[before], persistent=False)
    elif before == "persistent buffer":
        module.register_buffer("x", values[before])
    elif before != "absent":
        module.x = values[before]
    module.last = nn.Parameter(torch.zeros(1))  # after x: x's position must come back, not the end
    module.register_buffer("b1", torch.zeros(1))
    module.child1 = nn.Linear(1, 1)
    tables, state = _tables(module), list(module.state_dict())
    undo = UndoStack()
    if after == "absent":
        undo.delattr(module, "x")
    else:
        undo.setattr(module, "x", values[after] if after != "parameter" else nn.Parameter(torch.ones(3)))
    assert _tables(module) != tables
    undo.undo()
    assert _tables(module) == tables and list(module.state_dict()) == state
    if before == "absent":
        assert not hasattr(module, "x") and "x" not in vars(module)
    else:
        assert module.x is values[before]
        assert ("x" in vars(module)) == (before == "plain")
    assert len(undo) == 0


def test_undo_of_delattr_keeps_the_order_of_parameters_and_children():
    linear = nn.Linear(2, 2)
    sequential = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    children = list(sequential.children())
    with UndoStack() as undo:
        undo.delattr(linear, "weight")
        undo.delattr(sequential, "0")
        undo.delattr(sequential, "1")
        assert list(dict(linear.named_parameters())) == ["bias"] and list(sequential._modules) == ["2"]
    assert list(dict(linear.named_parameters())) == ["weight", "bias"]
    assert list(sequential.children()) == children and list(sequential.state_dict()) == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]


def test_undo_of_delitem_and_of_a_readded_key_keeps_the_dict_order():
    table = {"a": 1, "b": 2, "c": 3}
    with UndoStack() as undo:
        undo.delitem(table, "a")
        undo.setitem(table, "a", 10)  # re-added at the end: undo deletes it, then puts "a" back first
        undo.delitem(table, "b")
        undo.setitem(table, "c", 30)
        assert list(table.items()) == [("c", 30), ("a", 10)]
    assert list(table.items()) == [("a", 1), ("b", 2), ("c", 3)]
    with UndoStack() as undo:
        undo.setitem(table, "b", 20)
        del table["b"]  # deleted behind the stack's back: undo puts the old value back at its position
    assert list(table.items()) == [("a", 1), ("b", 2), ("c", 3)]


def test_undo_of_an_attribute_the_user_deleted_already_is_a_no_op():
    class Holder:
        inherited = 0

    holder = Holder()
    module = nn.Linear(2, 2)
    undo = UndoStack()
    undo.setattr(holder, "inherited", 1)  # previous: ABSENT (only the class's)
    undo.setattr(holder, "added", 2)
    undo.setattr(module, "extra", nn.Parameter(torch.ones(1)))
    del holder.inherited, holder.added, module.extra
    undo.undo()
    assert holder.inherited == 0 and "inherited" not in vars(holder) and not hasattr(holder, "added")
    assert list(module._parameters) == ["weight", "bias"] and len(undo) == 0


# -- undo runs what callbacks push while it runs ------------------------------------------------------------------


def test_a_change_pushed_by_a_callback_during_undo_is_undone_too():
    class Holder:
        x = 0

    holder = Holder()
    undo = UndoStack()
    undo.callback(lambda: undo.setattr(holder, "x", 7))
    undo.callback(lambda: undo.callback(lambda: undo.setitem(vars(holder), "y", 8)))  # two rounds deep
    undo.undo()
    assert holder.x == 0 and "x" not in vars(holder) and "y" not in vars(holder) and len(undo) == 0


def test_a_callback_that_pushes_at_every_undo_round_is_stopped_with_a_clear_error():
    from modelpatch.errors import ModelpatchRuntimeError
    from modelpatch.undo import MAX_UNDO_ROUNDS

    rounds = []
    undo = UndoStack()

    def again():
        rounds.append(1)
        undo.callback(again)

    undo.callback(again)
    with pytest.raises(ModelpatchRuntimeError, match=r"after 100 rounds of undo .*1 entries are left on the stack"):
        undo.undo()
    assert MAX_UNDO_ROUNDS == 100 and len(rounds) == 100 and len(undo) == 1


# -- set_context from another thread ------------------------------------------------------------------------------


def test_set_context_undone_in_another_thread_names_the_variable_and_the_rest_is_undone():
    from modelpatch.errors import ModelpatchRuntimeError

    table = {"a": 1}
    undo = UndoStack()
    undo.setitem(table, "a", 2)
    undo.set_context(_LEVEL, 4)
    undo.setitem(table, "b", 3)
    errors: list[BaseException] = []

    def run():
        try:
            undo.undo()
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    try:
        assert len(errors) == 1 and type(errors[0]) is ModelpatchRuntimeError
        message = str(errors[0])
        assert "context variable '_LEVEL'" in message and "must be reset (undone) in the context that set it" in message
        assert isinstance(errors[0].__cause__, ValueError)
        assert table == {"a": 1} and len(undo) == 0  # every other entry undone
        assert _LEVEL.get() == 4  # still set here: only this context can reset it
    finally:
        _LEVEL.set(0)
    holder: list[int] = []
    manager = context_set(_LEVEL, 9)
    manager.__enter__()
    thread = threading.Thread(target=lambda: holder.append(_try_exit(manager)))
    thread.start()
    thread.join()
    _LEVEL.set(0)
    assert holder == ["ModelpatchRuntimeError: '_LEVEL'"]


def _try_exit(manager) -> str:
    try:
        manager.__exit__(None, None, None)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"{type(error).__name__}: {str(error).split()[5]}"
    return "ok"
