"""PEFT 0.21.2 on patched MoE models (qwen2_moe full example, qwen3_moe and mixtral linear experts).

Without :mod:`modelpatch.integrations.peft`, PEFT asks Transformers' global table (by ``model_type``) whether the
experts are fused: ``get_peft_model`` rewrote per-expert targets into fused ``target_parameters`` (qwen3_moe,
mixtral: ``NoMatchingPeftModuleError`` when only experts are targeted) and ``PeftModel.from_pretrained`` fused every
per-expert LoRA tensor of the adapter into keys the patched model does not have (all 48 expert tensors dropped).
Saving the base model with the LoRA layers in place failed in the reverse conversion (``...base_layer.bias``).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers import tiny_mixtral_config, tiny_qwen2_moe_config, tiny_qwen3_moe_config
from modelpatch import ModelpatchError
from modelpatch.conversion import wrappers
from modelpatch.integrations import peft as peft_integration
from modelpatch.recipes import get_recipe

IDS = torch.arange(16).view(1, 16)

# family: (config factory, recipe, LoRA targets, gate/up/down names)
FAMILIES = {
    "qwen2_moe": (tiny_qwen2_moe_config, "qwen2_moe-full-example", ["gate_proj", "up_proj", "down_proj", "qkv_proj"]),
    "qwen3_moe": (tiny_qwen3_moe_config, "qwen3_moe-linear-experts", ["gate_proj", "up_proj", "down_proj", "q_proj"]),
    "mixtral": (tiny_mixtral_config, "mixtral-linear-experts", ["w1", "w2", "w3", "q_proj"]),
}
# LoRA tensors (lora_A + lora_B) of those targets on the 2-layer, 4-expert models: 48 on the experts (2 layers x 4
# experts x 3 linears x 2) + attention (2 x 2) + qwen2_moe's shared expert (2 layers x 3 linears x 2)
EXPERT_TENSORS = 48
ADAPTER_TENSORS = {"qwen2_moe": 64, "qwen3_moe": 52, "mixtral": 52}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One original-layout checkpoint per family (written by plain Transformers)."""
    paths = {}
    for family, (config, _, _) in FAMILIES.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(family)
        AutoModelForCausalLM.from_config(config()).save_pretrained(path)
        paths[family] = path
    return paths


def _patched(checkpoints, family, recipe=None):
    with get_recipe(recipe or FAMILIES[family][1]).apply():
        return AutoModelForCausalLM.from_pretrained(checkpoints[family])


def _lora(model, family, **kwargs):
    torch.manual_seed(1)
    config = LoraConfig(r=4, target_modules=FAMILIES[family][2], init_lora_weights=False, **kwargs)
    return get_peft_model(model, config).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _lora_tensors(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


@pytest.fixture(scope="module")
def trained(checkpoints, tmp_path_factory):
    """Per family: the LoRA model on the patched base, its logits and its saved adapter folder."""
    result = {}
    for family in FAMILIES:
        model = _lora(_patched(checkpoints, family), family)
        folder = tmp_path_factory.mktemp(f"{family}-adapter")
        model.save_pretrained(folder)
        result[family] = (model, _logits(model), folder)
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_get_peft_model_targets_the_per_expert_linears(trained, family):
    model, _, _ = trained[family]
    gate = FAMILIES[family][2][0]
    expert = model.get_base_model().model.layers[0].mlp.experts[3]
    assert type(getattr(expert, gate)) is LoraLinear
    assert type(getattr(expert, gate).base_layer) is nn.Linear
    config = model.peft_config["default"]
    assert config.target_parameters is None  # not rewritten into the fused gate_up_proj/down_proj
    assert sorted(config.target_modules) == sorted(FAMILIES[family][2])
    tensors = _lora_tensors(model)
    assert len(tensors) == ADAPTER_TENSORS[family]
    assert sum(".experts." in k for k in tensors) == EXPERT_TENSORS


def test_qwen3_moe_experts_alone_can_be_targeted(checkpoints):
    # the reported NoMatchingPeftModuleError: PEFT rewrote the targets to parameters the patched model lacks
    config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(_patched(checkpoints, "qwen3_moe"), config)
    assert len(_lora_tensors(model)) == EXPERT_TENSORS


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_round_trip_restores_every_tensor(checkpoints, trained, family):
    model, before, folder = trained[family]
    saved = load_file(folder / "adapter_model.safetensors")
    assert len(saved) == ADAPTER_TENSORS[family]
    gate = FAMILIES[family][2][0]
    assert f"base_model.model.model.layers.1.mlp.experts.3.{gate}.lora_A.weight" in saved

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = PeftModel.from_pretrained(_patched(checkpoints, family), folder).eval()
    assert [str(w.message) for w in caught if "adapter keys" in str(w.message)] == []
    restored, original = _lora_tensors(reloaded), _lora_tensors(model)
    assert sorted(restored) == sorted(original)
    assert all(torch.equal(restored[k], original[k]) for k in original)
    assert (_logits(reloaded) - before).abs().max().item() == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_model_saves_the_original_layout(checkpoints, family, tmp_path):
    model = _lora(_patched(checkpoints, family), family)
    adapted = _logits(model)
    merged = model.merge_and_unload()
    merged_logits = _logits(merged)
    assert (merged_logits - adapted).abs().max().item() < 1e-5
    merged.save_pretrained(tmp_path)
    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(
        load_file(checkpoints[family] / "model.safetensors")
    )
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)  # no recipe: Transformers' own layout
    assert type(plain.model.layers[0].mlp.experts).__name__.endswith("Experts")
    assert not type(plain.model.layers[0].mlp.experts).__name__.startswith("Linear")
    assert (_logits(plain) - merged_logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_base_model_with_lora_layers_saves_the_original_base_layout(checkpoints, family, tmp_path, caplog):
    model = _lora(_patched(checkpoints, family), family)
    with caplog.at_level(logging.WARNING, logger="modelpatch.conversion"):
        model.get_base_model().save_pretrained(tmp_path)
    assert f"without the {ADAPTER_TENSORS[family]} adapter tensor(s)" in caplog.text
    written = load_file(tmp_path / "model.safetensors")
    original = load_file(checkpoints[family] / "model.safetensors")
    assert sorted(written) == sorted(original)  # no lora_*, no base_layer.
    assert all(torch.equal(written[k], original[k]) for k in original)
    # the model still holds its adapters and goes on training
    assert len(_lora_tensors(model)) == ADAPTER_TENSORS[family]


def test_fused_parameters_of_a_patched_model_round_trip(checkpoints, tmp_path):
    # fused QKV patched, experts left fused by Transformers: PEFT's own handling of fused experts stays in force
    base = _patched(checkpoints, "qwen2_moe", "qwen2_moe-fused-qkv")
    config = LoraConfig(
        r=4,
        target_modules=["qkv_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    torch.manual_seed(1)
    model = get_peft_model(base, config).eval()
    assert len(_lora_tensors(model)) == 12  # 2 layers x (qkv_proj + gate_up_proj + down_proj) x 2
    before = _logits(model)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(
        _patched(checkpoints, "qwen2_moe", "qwen2_moe-fused-qkv"), tmp_path / "adapter"
    )
    restored, original = _lora_tensors(reloaded.eval()), _lora_tensors(model)
    assert sorted(restored) == sorted(original)
    assert all(torch.equal(restored[k], original[k]) for k in original)
    assert (_logits(reloaded) - before).abs().max().item() == 0.0
    model.get_base_model().save_pretrained(tmp_path / "base")
    written = load_file(tmp_path / "base" / "model.safetensors")
    original_ckpt = load_file(checkpoints["qwen2_moe"] / "model.safetensors")
    assert sorted(written) == sorted(original_ckpt)
    assert all(torch.equal(written[k], original_ckpt[k]) for k in original_ckpt)


def test_transformers_4_mixtral_adapter_loads_on_the_patched_model(checkpoints, trained, tmp_path):
    # Transformers 4 named Mixtral's MoE block `block_sparse_moe`; the built-in renaming stays in force
    model, before, folder = trained["mixtral"]
    saved = load_file(folder / "adapter_model.safetensors")
    save_file(
        {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in saved.items()}, tmp_path / "adapter_model.safetensors"
    )
    (tmp_path / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    assert sum(".block_sparse_moe.experts." in k for k in load_file(tmp_path / "adapter_model.safetensors")) == 48
    reloaded = PeftModel.from_pretrained(_patched(checkpoints, "mixtral"), tmp_path).eval()
    restored, original = _lora_tensors(reloaded), _lora_tensors(model)
    assert all(torch.equal(restored[k], original[k]) for k in original)
    assert (_logits(reloaded) - before).abs().max().item() == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_load_adapter_on_the_patched_model(checkpoints, trained, family):
    _, before, folder = trained[family]
    base = _patched(checkpoints, family)
    base.load_adapter(str(folder))  # Transformers' PEFT integration
    base.eval()
    assert len(_lora_tensors(base)) == ADAPTER_TENSORS[family]
    assert (_logits(base) - before).abs().max().item() == 0.0


def test_from_pretrained_of_an_adapter_folder_inside_the_recipe(checkpoints, trained):
    _, before, folder = trained["qwen2_moe"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(checkpoints["qwen2_moe"])
    with get_recipe("qwen2_moe-full-example").apply():
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()  # base from the config, then the adapter
    assert len(_lora_tensors(loaded)) == ADAPTER_TENSORS["qwen2_moe"]
    assert (_logits(loaded) - before).abs().max().item() == 0.0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_adapter_of_the_patched_model_on_the_unpatched_model(checkpoints, trained, family):
    # PEFT's own Transformers-4 conversion fuses the per-expert LoRA weights (block-diagonal lora_B, rank 2 x 4 x r)
    _, before, folder = trained[family]
    vanilla = AutoModelForCausalLM.from_pretrained(checkpoints[family])
    loaded = PeftModel.from_pretrained(vanilla, folder).eval()
    assert loaded.peft_config["default"].target_parameters == {"gate_up_proj", "down_proj"}
    assert (_logits(loaded) - before).abs().max().item() < 1e-5


def test_adapter_of_the_patched_qwen2_moe_loses_its_experts_on_the_unpatched_model(checkpoints, tmp_path):
    # PEFT 0.21.2 converts a qwen2_moe adapter's weights but not its config (it looks `qwen2_moe` up among the types
    # mapped *to* qwen2_moe): on the unpatched model only the shared expert's Linears get LoRA layers, silently
    torch.manual_seed(1)
    config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(_patched(checkpoints, "qwen2_moe", "qwen2_moe-linear-experts"), config).eval()
    assert len(_lora_tensors(model)) == EXPERT_TENSORS + 12  # + the shared expert (2 layers x 3 linears x 2)
    model.save_pretrained(tmp_path)
    vanilla = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2_moe"])
    loaded = PeftModel.from_pretrained(vanilla, tmp_path).eval()
    assert len(_lora_tensors(loaded)) == 12  # the 48 expert tensors are gone
    assert (_logits(loaded) - _logits(model)).abs().max().item() > 0.1


def test_unpatched_models_keep_peft_behaviour(checkpoints):
    vanilla = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"])
    model = get_peft_model(vanilla, LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
    assert model.peft_config["default"].target_parameters == {"gate_up_proj", "down_proj"}
    assert model.peft_config["default"].target_modules == set()


def test_install_and_uninstall_are_exact():
    import peft.utils.transformers_weight_conversion as module
    from transformers import conversion_mapping

    assert peft_integration.installed()
    original_config = peft_integration._originals["convert_peft_config_for_transformers"]
    peft_integration.uninstall()
    try:
        assert not peft_integration.installed()
        assert module.get_model_conversion_mapping is conversion_mapping.get_model_conversion_mapping
        assert module.convert_peft_config_for_transformers is original_config
        assert peft_integration._hook not in sys.meta_path
        assert "peft" not in wrappers._VIEWS
    finally:
        peft_integration.install()
    assert peft_integration.installed()
    assert module.get_model_conversion_mapping is peft_integration._get_model_conversion_mapping
    assert wrappers._VIEWS["peft"] is peft_integration.peft_wrapper_bases


def test_peft_module_imported_after_install_is_wrapped_when_imported():
    # PEFT imports its conversion module lazily (first adapter injection); modelpatch wraps it through an import hook
    import importlib

    import peft.utils

    name = peft_integration.TARGET_MODULE
    saved = sys.modules[name]
    peft_integration.uninstall()
    try:
        del sys.modules[name]
        delattr(peft.utils, "transformers_weight_conversion")
        peft_integration.install()
        assert peft_integration._hook in sys.meta_path
        assert peft_integration.installed()
        fresh = importlib.import_module(name)
        assert fresh is not saved
        assert fresh.get_model_conversion_mapping is peft_integration._get_model_conversion_mapping
        assert fresh.convert_peft_config_for_transformers is peft_integration._convert_peft_config_for_transformers
        assert peft_integration._originals["convert_peft_config_for_transformers"] is not (
            saved.convert_peft_config_for_transformers
        )
    finally:
        peft_integration.uninstall()
        sys.modules[name] = saved
        peft.utils.transformers_weight_conversion = saved
        peft_integration.install()
    assert peft_integration._hook not in sys.meta_path
    assert saved.get_model_conversion_mapping is peft_integration._get_model_conversion_mapping


# -- adding an adapter on every release: Transformers' gate or PEFT's own API ---------------------------------------
def _release() -> tuple[int, int]:
    import transformers

    return tuple(int(part) for part in transformers.__version__.split(".")[:2])  # type: ignore[return-value]


def test_add_adapter_takes_the_path_each_release_allows(checkpoints):
    import importlib.metadata

    from peft import inject_adapter_in_model

    # Transformers 5.23 asks PEFT >= 0.20.0 for its adapter methods, 5.24 and 5.25 ask 0.22.0
    required = "0.20.0" if _release() < (5, 24) else "0.22.0"
    installed = importlib.metadata.version("peft")
    gate_open = tuple(map(int, installed.split("."))) >= tuple(map(int, required.split(".")))
    assert peft_integration.transformers_adapter_gate() == (gate_open, required, installed)
    if installed == "0.21.2":  # the PEFT release the constraints pin on every release: 5.23 open, 5.24+ closed
        assert gate_open == (_release() < (5, 24))

    config = dict(r=4, target_modules=["q_proj", "qkv_proj"], init_lora_weights=False)
    model = _patched(checkpoints, "qwen2_moe")  # a patched model (fused qkv_proj): the adapter targets its modules
    torch.manual_seed(1)
    path = peft_integration.add_adapter(model, LoraConfig(**config))
    assert path == ("transformers" if gate_open else "peft")
    # the same as PEFT's own injection with the same seed, and active
    reference = _patched(checkpoints, "qwen2_moe")
    torch.manual_seed(1)
    inject_adapter_in_model(LoraConfig(**config), reference)
    assert _lora_tensors(model).keys() == _lora_tensors(reference).keys() != set()
    assert all(torch.equal(v, _lora_tensors(reference)[k]) for k, v in _lora_tensors(model).items())
    assert torch.equal(_logits(model.eval()), _logits(reference.eval()))
    assert not torch.allclose(_logits(model), _logits(_patched(checkpoints, "qwen2_moe")), atol=1e-4)
    assert model._hf_peft_config_loaded and list(model.peft_config) == ["default"]
    with pytest.raises(ValueError, match="already"):
        peft_integration.add_adapter(model, LoraConfig(**config))
    if not gate_open:  # what the helper goes around: Transformers' own call refuses, naming the version
        with pytest.raises(ValueError, match=required.replace(".", r"\.")):
            _patched(checkpoints, "qwen2_moe").add_adapter(LoraConfig(**config))


def test_save_of_adapters_added_through_peft_refuses_before_writing_and_names_the_way_out(checkpoints, tmp_path):
    """Where Transformers refuses the installed PEFT (5.24+ with peft 0.21.2), its save_pretrained of a model with
    adapters fails with a traceback inside its adapter methods: modelpatch refuses first, writes nothing, and the way
    out its message names (PEFT's state dict + the adapter config, then load_adapter) reloads the adapter exactly.
    Where Transformers accepts it, save_pretrained saves the adapter and load_adapter reads it back."""
    from peft import get_peft_model_state_dict

    gate_open, required, _ = peft_integration.transformers_adapter_gate()
    model = _patched(checkpoints, "qwen2_moe")
    torch.manual_seed(1)
    peft_integration.add_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "qkv_proj"], init_lora_weights=False))
    want = _logits(model.eval())
    out = tmp_path / "adapter"
    if gate_open:
        model.save_pretrained(out)
    else:
        with pytest.raises(ModelpatchError, match=f"needs peft >= {re.escape(required)}") as refused:
            model.save_pretrained(out)
        assert not out.exists() and "get_peft_model_state_dict" in str(refused.value)
        out.mkdir()
        save_file(get_peft_model_state_dict(model), str(out / "adapter_model.safetensors"))
        model.peft_config["default"].save_pretrained(out)
    reloaded = _patched(checkpoints, "qwen2_moe")
    reloaded.load_adapter(str(out))
    assert torch.equal(_logits(reloaded.eval()), want)
