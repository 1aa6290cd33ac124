"""The wrappers modelpatch installs on Transformers: installed when Transformers' modules are imported (never by
importing modelpatch), removed exactly by ``uninstall()`` and put back by ``install()``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel
from transformers import modeling_utils as _mu
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.utils import output_capturing as _capturing

import modelpatch
from helpers import INPUT_IDS, save_tiny, tiny_llama_config
from modelpatch import (
    Concatenate,
    WeightConverter,
    apply_patches,
    register_checkpoint_conversion_mapping,
    register_patch_mapping,
)
from modelpatch.apply import transformers as integration
from modelpatch.integrations import loaders as loaders_integration
from modelpatch.recipes import get_recipe

FusedQKVAttention = get_recipe("llama-fused-qkv").patch_mapping["LlamaAttention"]


QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])


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


# -- import cost: Transformers' heavy modules are wrapped when imported, not imported by modelpatch -------------------


_SRC = Path(modelpatch.__file__).resolve().parents[1]


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
