"""The shared mechanisms under every feature: the undo stack, the error base class, the installer, clean-up in
either order, and one code path for ``apply_patches(conversion_rules=..., overwrite=...)`` and ``Recipe.apply``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel, Qwen2MoeForCausalLM
from transformers import modeling_utils as _mu
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.utils import output_capturing as _capturing

import modelpatch
from helpers import INPUT_IDS, save_tiny, tiny_llama_config, tiny_qwen2_moe_config
from modelpatch import (
    Concatenate,
    ModelpatchError,
    WeightConverter,
    apply_patches,
    clear_patch_mapping,
    get_checkpoint_conversion_mapping,
    get_patch_mapping,
    register_checkpoint_conversion_mapping,
    register_patch_mapping,
    replacement_of,
    unregister_checkpoint_conversion_mapping,
    unregister_patch_mapping,
)
from modelpatch.integrations import loaders as loaders_integration
from modelpatch.integrations import transformers as integration
from modelpatch.recipes import get_recipe
from modelpatch.undo import ABSENT, UndoStack

_SRC = Path(modelpatch.__file__).resolve().parents[1]
FusedQKVAttention = get_recipe("llama-fused-qkv").patch_mapping["LlamaAttention"]
QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])


# -- UndoStack ------------------------------------------------------------------------------------------------


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


# -- errors ---------------------------------------------------------------------------------------------------


def test_every_error_has_the_modelpatch_base_and_keeps_its_builtin_base():
    with pytest.raises(ModelpatchError) as caught:
        register_patch_mapping({"[": LlamaAttention})
    assert isinstance(caught.value, ValueError)
    with pytest.raises(ModelpatchError) as caught:
        register_patch_mapping({"LlamaAttention": object})
    assert isinstance(caught.value, TypeError)
    with pytest.raises(ModelpatchError) as caught:
        unregister_checkpoint_conversion_mapping("never_registered")
    assert isinstance(caught.value, KeyError) and "never_registered" in str(caught.value)
    for name in ("UnmatchedPatchKeyError", "ConversionError", "ConversionShapeError", "StateDictLayoutError"):
        assert issubclass(getattr(modelpatch, name), ModelpatchError)
    from modelpatch.routing import RoutingReplayError, RoutingTraceError

    assert issubclass(RoutingTraceError, ModelpatchError) and issubclass(RoutingTraceError, ValueError)
    assert issubclass(RoutingReplayError, ModelpatchError) and issubclass(RoutingReplayError, RuntimeError)


def _package_exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in a modelpatch module (all submodules imported)."""
    import importlib
    import inspect
    import pkgutil

    for info in pkgutil.walk_packages(modelpatch.__path__, prefix="modelpatch."):
        importlib.import_module(info.name)
    found: dict[str, type[BaseException]] = {}
    pending = [BaseException]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            pending.append(sub)
            module = inspect.getmodule(sub)
            if module is not None and module.__name__.split(".")[0] == "modelpatch":
                found[f"{sub.__module__}.{sub.__qualname__}"] = sub
    return [found[name] for name in sorted(found)]


def test_every_exception_class_of_the_package_derives_from_modelpatch_error():
    classes = _package_exception_classes()
    names = {cls.__name__ for cls in classes}
    # the walk reaches the CLI's, the routing's, the recipes' and the conversion's own errors
    assert {
        "CliError",
        "RoutingTraceError",
        "UnsupportedExpertsError",
        "ConversionError",
        "QuantizedSaveError",
    } <= names
    outside = [f"{cls.__module__}.{cls.__qualname__}" for cls in classes if not issubclass(cls, ModelpatchError)]
    assert outside == []


def test_cli_error_is_a_modelpatch_error():
    from modelpatch.cli import CliError

    assert CliError.__mro__[1] is ModelpatchError and issubclass(CliError, Exception)


# -- clean-up in either order (defect 10) ---------------------------------------------------------------------


def test_unregister_after_clear_is_a_no_op_for_both_registries():
    register_patch_mapping({"LlamaAttention": FusedQKVAttention})
    register_checkpoint_conversion_mapping("llama", [QKV])
    try:
        clear_patch_mapping()  # clears user conversion rules too
    finally:
        unregister_checkpoint_conversion_mapping("llama")  # raised KeyError before
        unregister_patch_mapping(["LlamaAttention"])
    assert get_patch_mapping() == {}
    assert get_checkpoint_conversion_mapping("llama") is None
    # never registered: still an error, unless missing_ok
    with pytest.raises(KeyError):
        unregister_checkpoint_conversion_mapping("llama")
    with pytest.raises(ValueError):
        unregister_patch_mapping(["LlamaAttention"])
    unregister_checkpoint_conversion_mapping("llama", missing_ok=True)
    unregister_patch_mapping(["LlamaAttention"], missing_ok=True)


def test_recipe_unregister_after_clear_patch_mapping():
    recipe = get_recipe("llama-fused-qkv")
    recipe.register()
    clear_patch_mapping()
    recipe.unregister()  # raised KeyError before
    assert get_patch_mapping() == {}


# -- apply_patches(conversion_rules=..., overwrite=...) ---------------------------------------------------------


def test_conversion_rules_as_a_list_is_a_type_error_naming_the_form():
    with pytest.raises(TypeError, match=r"conversion_rules=\{'llama': \[rule\]\}"):
        apply_patches({"LlamaAttention": FusedQKVAttention}, conversion_rules=[QKV])


def test_overwrite_names_must_have_rules():
    with pytest.raises(ValueError, match="mixtral"):
        apply_patches({"LlamaAttention": FusedQKVAttention}, conversion_rules={"llama": [QKV]}, overwrite=["mixtral"])
    with pytest.raises(ValueError, match="conversion_rules"):
        apply_patches({"LlamaAttention": FusedQKVAttention}, overwrite=True)


def test_apply_patches_with_overwrite_loads_like_the_recipe(tmp_path):
    """The full example recipe (per-expert experts, built-in expert fusion dropped with overwrite) and the same
    mapping and rules given to apply_patches produce identical models: one code path."""
    save_tiny(Qwen2MoeForCausalLM, tiny_qwen2_moe_config(), tmp_path)
    recipe = get_recipe("qwen2_moe-full-example")
    with recipe.apply(strict=True):
        by_recipe = AutoModelForCausalLM.from_pretrained(tmp_path)
    overwritten = [name for name, spec in recipe.conversion.items() if spec.overwrite]
    assert overwritten == ["qwen2_moe"]
    with apply_patches(
        dict(recipe.patch_mapping), strict=True, conversion_rules=recipe.build_conversion_rules(), overwrite=overwritten
    ):
        by_block = AutoModelForCausalLM.from_pretrained(tmp_path)
    a, b = by_recipe.state_dict(), by_block.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert any("experts.0." in k for k in a)  # per-expert layout, so overwrite really took effect


# -- PatchScope.start / stop, replacement_of ---------------------------------------------------------------------


def test_scope_start_stop_and_replacement_of():
    config = tiny_llama_config()
    scope = apply_patches({"LlamaAttention": FusedQKVAttention})
    scope.start()
    try:
        model = LlamaForCausalLM(config)
    finally:
        scope.stop()
    assert type(LlamaForCausalLM(config).model.layers[0].self_attn) is LlamaAttention
    found = replacement_of(model.model.layers[0].self_attn)
    assert (found.original, found.replacement, found.key) == (LlamaAttention, FusedQKVAttention, "LlamaAttention")
    assert replacement_of(model.model.layers[0].mlp) is None
    assert scope.fired == {"LlamaAttention": 2}
    with pytest.raises(RuntimeError):
        scope.stop()


# -- the Transformers installer ------------------------------------------------------------------------------------


def test_uninstall_restores_transformers_exactly_and_install_puts_it_back(tmp_path):
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    wrapped = {
        name: vars(PreTrainedModel)[name] for name in ("from_pretrained", "_from_config", "__init__", "post_init")
    }
    integration.uninstall()
    try:
        assert not integration.installed()
        assert not loaders_integration.installed()  # load_sharded_checkpoint, load_model, accelerate's loader
        originals = {name: vars(PreTrainedModel)[name] for name in wrapped}
        assert all(originals[n] is not wrapped[n] for n in wrapped)
        assert type(_capturing._CAN_RECORD_REGISTRY) is _capturing._CanRecordRegistry
        assert "modelpatch" not in _mu.convert_and_load_state_dict_in_model.__module__
        register_patch_mapping({"LlamaAttention": FusedQKVAttention})
        plain = AutoModelForCausalLM.from_pretrained(tmp_path)  # nothing applies the registry now
        assert type(plain.model.layers[0].self_attn) is LlamaAttention
        with pytest.raises(RuntimeError, match="install"):  # rules would be ignored: refuse, do not drop them
            register_checkpoint_conversion_mapping("llama", [QKV])
    finally:
        integration.install()
    assert integration.installed()
    assert all(vars(PreTrainedModel)[n] is not originals[n] for n in wrapped)
    with apply_patches({"LlamaAttention": FusedQKVAttention}, conversion_rules={"llama": [QKV]}):
        fused = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(fused.model.layers[0].self_attn) is FusedQKVAttention
    with torch.no_grad():
        assert (fused(INPUT_IDS).logits - plain(INPUT_IDS).logits).abs().max() < 1e-5


# -- import cost: Transformers' heavy modules are wrapped when imported, not imported by modelpatch --------------

_HEAVY = ("transformers.modeling_utils", "transformers.trainer_utils", "torchao", "bitsandbytes", "peft")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(_SRC), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def test_import_modelpatch_is_silent_and_imports_no_heavy_transformers_module():
    done = _python(f"import sys, modelpatch; print(sorted(set({_HEAVY!r}) & set(sys.modules)))")
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "[]\n")


def test_cli_help_prints_only_help():
    done = _python("import sys; from modelpatch.cli import main; sys.exit(main(sys.argv[1:]))", "--help")
    assert done.returncode == 0
    assert done.stderr == ""
    assert done.stdout.startswith("usage: modelpatch ")
    assert "routing-check" in done.stdout


_FRESH_PROCESS_LOAD = """
import sys
import modelpatch
from modelpatch.integrations import loaders, trainer as trainer_integration
from modelpatch.recipes import get_recipe

recipe = get_recipe("llama-fused-qkv")
recipe.register()  # the registry: every later build, no call at load time
assert "transformers.modeling_utils" not in sys.modules  # the wrappers wait for it
import transformers
from safetensors.torch import load_file
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
attn = model.model.layers[0].self_attn
saved = load_file(sys.argv[1] + "/model.safetensors")
expected = [saved["model.layers.0.self_attn." + n + "_proj.weight"] for n in "qkv"]
import torch
import transformers.trainer  # the Trainer's optimizer wrappers and its load_sharded_checkpoint, at its import
print(type(attn).__name__, type(attn) is recipe.patch_mapping["LlamaAttention"],
      torch.equal(attn.qkv_proj.weight, torch.cat(expected)),
      transformers.trainer.load_sharded_checkpoint is loaders._wrappers["load_sharded_checkpoint"],
      trainer_integration.installed() and "_save_optimizer_and_scheduler" in vars(transformers.trainer.Trainer))
"""


@pytest.mark.slow
def test_models_built_after_a_fresh_import_are_patched(tmp_path):
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    done = _python(_FRESH_PROCESS_LOAD, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["FusedQKVLlamaAttention", "True", "True", "True", "True"]
