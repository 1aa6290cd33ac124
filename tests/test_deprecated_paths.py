"""Old public import paths keep working for one release: the same objects, with a DeprecationWarning naming the
new path (``modelpatch.deprecation``)."""

from __future__ import annotations

import importlib

import pytest

from modelpatch.deprecation import MOVED

# one public name per old module
NAMES = {
    "modelpatch.blocks": "apply_patches",
    "modelpatch.instances": "patch_model",
    "modelpatch.integrations.transformers": "install",
    "modelpatch.conversion.hooks": "installed",
    "modelpatch.recipes.attention": "FusedQKVLlamaAttention",
    "modelpatch.recipes.bert": "FusedQKVBertSelfAttention",
    "modelpatch.recipes.experts": "experts_family",
    "modelpatch.recipes.calibration": "calibrate_all_experts",
    "modelpatch.routing.session": "ReplaySession",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_same_object_and_warns_with_the_new_path(old):
    name = NAMES[old]
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated .* import {name} from modelpatch\\."):
        value = getattr(module, name)
    new = next(t for t in MOVED[old] if hasattr(importlib.import_module(t), name))
    assert value is getattr(importlib.import_module(new), name)


def test_from_import_of_an_old_path_works_and_an_unknown_name_raises():
    with pytest.warns(DeprecationWarning, match="modelpatch.apply.model_patch"):
        from modelpatch.instances import ModelPatch
    from modelpatch.apply.model_patch import ModelPatch as moved

    assert ModelPatch is moved
    with pytest.warns(DeprecationWarning, match="modelpatch.recipes.linear_experts"):
        from modelpatch.recipes.experts import FAMILIES, LinearExperts
    from modelpatch.recipes.linear_experts import LinearExperts as layer

    assert LinearExperts is layer and len(FAMILIES) > 10
    missing = "nothing_here"
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        getattr(importlib.import_module("modelpatch.recipes.attention"), missing)


def _target_names(old):
    names = [name for target in MOVED[old] for name in importlib.import_module(target).__all__]
    return list(dict.fromkeys(names))


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_star_import_of_an_old_path_gives_every_name_of_its_new_modules_with_a_warning_each(old):
    names = _target_names(old)
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning) as caught:
        exec(f"from {old} import *", namespace)
    namespace = {key: value for key, value in namespace.items() if not key.startswith("__")}  # builtins, registry
    assert sorted(namespace) == sorted(names) and "alias" not in namespace
    messages = [str(warning.message) for warning in caught if warning.category is DeprecationWarning]
    assert len(messages) == len(names)
    for name in names:  # the same object as its new home, which lists it in its __all__
        (message,) = [m for m in messages if f" import {name} from " in m]
        home = message.rsplit(" from ", 1)[1]
        assert message.startswith(f"{old} is deprecated") and home in MOVED[old]
        assert name in importlib.import_module(home).__all__
        assert namespace[name] is getattr(importlib.import_module(home), name)
    module = importlib.import_module(old)
    assert module.__all__ == names
    assert [name for name in dir(module) if not name.startswith("__")] == sorted(names)


def test_the_warning_names_the_module_a_name_lives_in_not_the_first_that_imports_it():
    module = importlib.import_module("modelpatch.routing.session")
    for name, home in [
        ("GenerateGuard", "modelpatch.routing.generate"),
        ("RoutingReplayError", "modelpatch.routing.replay"),
        ("ReplaySession", "modelpatch.routing.replay"),
        ("record_routing", "modelpatch.routing.record"),
    ]:
        with pytest.warns(DeprecationWarning, match=f"; import {name} from {home.replace('.', '[.]')}$"):
            value = getattr(module, name)
        assert value is getattr(importlib.import_module(home), name)


def test_a_name_in_no_all_points_to_the_target_that_defines_it(monkeypatch):
    import sys
    import types

    from modelpatch.deprecation import alias

    first, second = types.ModuleType("old_first"), types.ModuleType("old_second")
    first.__all__, second.__all__ = ["listed"], []
    defined = type("Defined", (), {"__module__": "old_second"})
    first.Defined = second.Defined = defined  # imported by the first target, defined in the second
    first.plain = second.plain = 3  # no __module__: the first target that has it
    first.listed = "first"
    for module in (first, second):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(MOVED, "old_alias", ("old_first", "old_second"))
    getattr_, dir_ = alias("old_alias")
    old = types.ModuleType("old_alias")
    monkeypatch.setitem(sys.modules, "old_alias", old)
    for name, home, value in [
        ("Defined", "old_second", defined),
        ("plain", "old_first", 3),
        ("listed", "old_first", "first"),
    ]:
        with pytest.warns(DeprecationWarning, match=f"import {name} from {home}$"):
            assert getattr_(name) is value
    with pytest.raises(AttributeError, match="module 'old_alias' has no attribute 'absent'"):
        getattr_("absent")
    assert getattr_("__all__") == ["listed"] and old.__all__ == ["listed"] and "listed" in dir_()
