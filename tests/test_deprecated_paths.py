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
