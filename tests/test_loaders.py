"""Every loader speaks both layouts, or refuses (issue 19, deliverable 5).

A user loaded original-layout checkpoints (written by the *unpatched* model's ``save_pretrained``) into patched
models with the loaders of the training stack: ``model.load_state_dict``, Transformers' ``load_sharded_checkpoint``
(the Trainer's sharded resume), accelerate's ``load_checkpoint_in_model``, ``safetensors.torch.load_model`` and the
Trainer's ``_load_from_checkpoint``. Each must load the checkpoint exactly (max abs diff 0 against the checkpoint's
tensors, read back through ``iter_original_state_dict``) or refuse with a clear error before anything is written.
Two families: llama with fused QKV (the original layout differs from the model's) and qwen2_moe with per-expert
``nn.Linear`` experts (the original layout is the model's; the fused experts tensor of Transformers' in-memory
layout is the other one).
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass

import accelerate
import accelerate.big_modeling
import accelerate.utils
import accelerate.utils.modeling
import pytest
import safetensors.torch as st
import torch
import transformers.trainer
import transformers.trainer_utils
from accelerate import init_empty_weights, load_checkpoint_and_dispatch, load_checkpoint_in_model
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    Qwen2MoeForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.trainer_utils import load_sharded_checkpoint

from helpers import tiny_llama_config, tiny_qwen2_moe_config
from modelpatch import iter_original_state_dict
from modelpatch.apply import transformers as integration
from modelpatch.conversion import ConversionShapeError
from modelpatch.conversion.errors import StateDictLayoutError
from modelpatch.integrations import loaders as loaders_integration
from modelpatch.recipes import get_recipe


@dataclass
class Family:
    name: str
    recipe: str
    config: object
    single: str  # folder with model.safetensors (original layout)
    sharded: str  # the same weights in many shards, with model.safetensors.index.json
    checkpoint: dict  # the checkpoint's tensors
    unpatched: dict  # the unpatched model's state_dict() (Transformers' in-memory layout)
    original_key: str  # an original-layout key whose rows the model holds in a fused tensor (qwen2_moe: its own)
    fused_key: str  # the other layout's key naming the same rows
    other_shard_key: str  # a key of the same group as original_key, stored in another shard


FAMILIES = {
    "llama": (
        "llama-fused-qkv",
        LlamaForCausalLM,
        lambda: tiny_llama_config(attention_bias=True),
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ),
    "qwen2_moe": (
        "qwen2_moe-linear-experts",
        Qwen2MoeForCausalLM,
        tiny_qwen2_moe_config,
        "model.layers.1.mlp.experts.2.gate_proj.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.2.up_proj.weight",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """``load_sharded_checkpoint`` and accelerate call ``gc.collect()`` after every shard: in a process holding torch
    and Transformers that is ~0.6 s each (measured), so the objects alive now are frozen out of the collector."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    recipe, model_cls, config, original_key, fused_key, other = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = model_cls(config())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    checkpoint = st.load_file(root / "single" / "model.safetensors")
    unpatched = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Family(request.param, recipe, config, str(root / "single"), str(root / "sharded"), checkpoint, unpatched,
                  original_key, fused_key, other)  # fmt: skip


def _patched(family: Family):
    """The patched model, loaded from the checkpoint, then moved off it (+1 everywhere): nothing equals it by luck."""
    with get_recipe(family.recipe).apply():
        model = AutoModelForCausalLM.from_pretrained(family.single).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def _snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before: dict) -> bool:
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def _max_diff(model, checkpoint: dict) -> float:
    """Max abs difference between the model's weights in the original layout and the checkpoint's tensors."""
    original = dict(iter_original_state_dict(model))
    assert original.keys() == checkpoint.keys()
    return max((original[k] - checkpoint[k]).abs().max().item() for k in checkpoint)


def _trainer(model, tmp_path) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], disable_tqdm=True)
    return Trainer(model=model, args=args)


def _file(family: Family) -> str:
    return os.path.join(family.single, "model.safetensors")


# each loader: (model, family, tmp_path) -> its report as (missing, unexpected), or None where it returns none
LOADERS = {
    "load_state_dict": lambda m, f, t: m.load_state_dict(st.load_file(_file(f)), strict=True),
    "load_state_dict(strict=False)": lambda m, f, t: m.load_state_dict(st.load_file(_file(f)), strict=False),
    "load_sharded_checkpoint": lambda m, f, t: load_sharded_checkpoint(m, f.sharded),
    "load_sharded_checkpoint(strict=False)": lambda m, f, t: load_sharded_checkpoint(m, f.sharded, strict=False),
    "accelerate file": lambda m, f, t: load_checkpoint_in_model(m, _file(f)),
    "accelerate folder": lambda m, f, t: load_checkpoint_in_model(m, f.sharded),
    "accelerate folder strict": lambda m, f, t: load_checkpoint_in_model(m, f.sharded, strict=True),
    "accelerate device_map": lambda m, f, t: load_checkpoint_in_model(m, f.sharded, device_map={"": "cpu"}),
    "safetensors load_model": lambda m, f, t: st.load_model(m, _file(f)),
    "safetensors load_model(strict=False)": lambda m, f, t: st.load_model(m, _file(f), strict=False),
    "Trainer resume, one file": lambda m, f, t: _trainer(m, t)._load_from_checkpoint(f.single),
    "Trainer resume, sharded": lambda m, f, t: _trainer(m, t)._load_from_checkpoint(f.sharded),
}


def test_the_sharded_folder_splits_groups_across_shards(family):
    weight_map = json.loads(open(os.path.join(family.sharded, "model.safetensors.index.json")).read())["weight_map"]
    assert len(set(weight_map.values())) >= 14
    assert weight_map[family.original_key] != weight_map[family.other_shard_key]  # q_proj and k_proj apart


@pytest.mark.parametrize("loader", list(LOADERS))
def test_every_loader_loads_an_original_layout_checkpoint_exactly(family, loader, tmp_path):
    model = _patched(family)
    assert _max_diff(model, family.checkpoint) >= 1.0 - 0.2
    report = LOADERS[loader](model, family, tmp_path)
    if report is not None:
        missing, unexpected = report
        assert list(missing) == [] and list(unexpected) == []
    assert _max_diff(model, family.checkpoint) == 0.0


def test_load_checkpoint_and_dispatch_into_an_empty_patched_model(family):
    with get_recipe(family.recipe).apply(), init_empty_weights():
        model = AutoModelForCausalLM.from_config(family.config())
    assert all(p.is_meta for p in model.parameters())
    model = load_checkpoint_and_dispatch(model, family.sharded, device_map={"": "cpu"})
    assert not any(p.is_meta for p in model.parameters())
    assert _max_diff(model, family.checkpoint) == 0.0


def test_a_partial_original_layout_dict_loads_only_its_rows(family, tmp_path):
    model = _patched(family)
    before = _snapshot(model)
    value = family.checkpoint[family.original_key]
    result = model.load_state_dict({family.original_key: value}, strict=False)
    assert family.original_key not in result.missing_keys and result.unexpected_keys == []
    assert family.other_shard_key in result.missing_keys  # named in the caller's layout
    after = model.state_dict()
    if family.name == "llama":  # rows 0:64 of qkv_proj (64 q, 32 k, 32 v rows)
        assert torch.equal(after[family.fused_key][:64], value)
        assert torch.equal(after[family.fused_key][64:], before[family.fused_key][64:])
        changed = {family.fused_key}
    else:
        assert torch.equal(after[family.original_key], value)
        changed = {family.original_key}
    assert all(torch.equal(after[k], before[k]) for k in before if k not in changed)
    # the same partial checkpoint as a file, through the file loaders: the same rows, nothing else
    path = tmp_path / "part.safetensors"
    st.save_file({family.original_key: value}, path, metadata={"format": "pt"})
    for load in (
        lambda m: st.load_model(m, path, strict=False),
        lambda m: load_checkpoint_in_model(m, str(path)),
    ):
        other = _patched(family)
        load(other)
        assert all(torch.equal(other.state_dict()[k], after[k]) for k in after)


def test_a_partial_group_is_refused_by_accelerate_with_a_device_map(tmp_path):
    family_args = FAMILIES["llama"]
    with get_recipe(family_args[0]).apply():
        model = AutoModelForCausalLM.from_config(family_args[2]())
    before = _snapshot(model)
    path = tmp_path / "part.safetensors"
    st.save_file({family_args[3]: torch.zeros(64, 64)}, path, metadata={"format": "pt"})
    with pytest.raises(StateDictLayoutError, match=r"writes whole parameters.*self_attn\.q_proj\.weight") as caught:
        load_checkpoint_in_model(model, str(path), device_map={"": "cpu"})
    assert caught.value.keys == (family_args[3],)
    assert _unchanged(model, before)


def _both(family: Family, model, whole: bool, fused_first: bool) -> dict:
    """The original-layout rows (``whole``: the whole group) beside a stale tensor of the other layout naming them."""
    if family.name == "llama":
        originals = {family.original_key: family.checkpoint[family.original_key]}
        if whole:
            originals.update({k.replace("q_proj", p): family.checkpoint[k.replace("q_proj", p)] for k in originals
                              for p in ("k_proj", "v_proj")})  # fmt: skip
        stale = {family.fused_key: model.state_dict()[family.fused_key].clone()}  # the model's own, stale rows
    else:
        originals = {family.original_key: family.checkpoint[family.original_key]}
        if whole:
            originals.update({k: v for k, v in family.checkpoint.items() if "layers.1.mlp.experts." in k})
        stale = {family.fused_key: family.unpatched[family.fused_key]}  # Transformers' fused experts tensor
    return {**stale, **originals} if fused_first else {**originals, **stale}


@pytest.mark.parametrize("fused_first", [False, True], ids=["originals-first", "fused-first"])
@pytest.mark.parametrize("whole", [False, True], ids=["part", "whole-group"])
def test_a_stale_fused_tensor_beside_its_originals_is_refused(family, whole, fused_first):
    model = _patched(family)
    before = _snapshot(model)
    both = _both(family, model, whole, fused_first)
    for strict in (False, True):
        with pytest.raises(StateDictLayoutError, match="is given twice") as caught:
            model.load_state_dict(both, strict=strict)
        message = str(caught.value)  # both keys named: llama's q_proj from qkv_proj, qwen2_moe's expert from gate_up
        assert family.fused_key in message and "in the original layout" in message
        assert family.original_key in caught.value.keys and family.fused_key in caught.value.keys
        if not whole:
            assert family.original_key in message
        assert _unchanged(model, before)


def test_a_stale_fused_tensor_in_checkpoint_files_is_refused_before_loading(family, tmp_path):
    model = _patched(family)
    before = _snapshot(model)
    stale = {family.fused_key: _both(family, model, False, True)[family.fused_key].contiguous()}
    single = tmp_path / "both.safetensors"
    st.save_file({**family.checkpoint, **stale}, single, metadata={"format": "pt"})
    folder = tmp_path / "both-sharded"  # the stale tensor alone in a second shard
    folder.mkdir()
    weight_map = {}
    for name, part in (
        ("model-00001-of-00002.safetensors", family.checkpoint),
        ("model-00002-of-00002.safetensors", stale),
    ):
        st.save_file(part, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loads = [
        lambda: st.load_model(model, single),
        lambda: st.load_model(model, single, strict=False),
        lambda: load_checkpoint_in_model(model, str(single)),
        lambda: load_checkpoint_in_model(model, str(folder), device_map={"": "cpu"}),
        lambda: load_sharded_checkpoint(model, folder, strict=False),
    ]
    for load in loads:
        with pytest.raises(StateDictLayoutError, match="is given twice"):
            load()
        assert _unchanged(model, before)


def test_a_key_in_neither_layout_is_refused_naming_it_or_reported(family, tmp_path):
    model = _patched(family)
    before = _snapshot(model)
    unknown = "model.layers.0.self_attn.qkv_projection.weight"
    state = {**family.checkpoint, unknown: torch.zeros(3, 64)}
    with pytest.raises(
        StateDictLayoutError, match=rf'Unexpected key\(s\) in state_dict: "{unknown}" \(shape \(3, 64\)\): in neither'
    ):
        model.load_state_dict(state, strict=True)
    assert _unchanged(model, before)
    # on disk: refused from the headers, before the first tensor is read
    single = tmp_path / "unknown.safetensors"
    st.save_file(state, single, metadata={"format": "pt"})
    folder = tmp_path / "unknown-sharded"
    folder.mkdir()
    st.save_file(state, folder / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, "model-00001-of-00001.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for load in (
        lambda: st.load_model(model, single),
        lambda: load_checkpoint_in_model(model, str(single), strict=True),
        lambda: load_sharded_checkpoint(model, folder),
    ):
        with pytest.raises(StateDictLayoutError, match=f'"{unknown}"') as caught:
            load()
        assert unknown in caught.value.keys
        assert _unchanged(model, before)
    # strict=False: loaded exactly, the key reported (never accepted and ignored)
    assert model.load_state_dict(state, strict=False).unexpected_keys == [unknown]
    assert _max_diff(model, family.checkpoint) == 0.0
    other = _patched(family)
    assert load_sharded_checkpoint(other, folder, strict=False).unexpected_keys == [unknown]
    assert _max_diff(other, family.checkpoint) == 0.0


def test_a_shape_that_fits_no_layout_is_refused_naming_key_shape_and_layout(family, tmp_path):
    model = _patched(family)
    before = _snapshot(model)
    wrong = {**family.checkpoint, family.other_shard_key: torch.zeros(8, 64)}
    if family.name == "llama":  # an original-layout source: the fused parameter it would build is named too
        error, pattern = ConversionShapeError, r"qkv_proj\.weight.*\(104, 64\).*\(128, 64\).*k_proj\.weight' \(8, 64\)"
    else:  # a key of the model's own layout
        error, pattern = (
            StateDictLayoutError,
            r"experts\.2\.up_proj\.weight' \(8, 64\) is a key of the model's layout.*\(32, 64\)",
        )
    for strict in (True, False):
        with pytest.raises(error, match=pattern):
            model.load_state_dict(wrong, strict=strict)
        assert _unchanged(model, before)
    fused = model.state_dict()[family.fused_key] if family.name == "llama" else None
    if fused is not None:  # the fused key itself, wrong: a key of the model's layout
        with pytest.raises(StateDictLayoutError, match=r"qkv_proj\.weight' \(10, 64\) is a key of the model's layout"):
            model.load_state_dict({family.fused_key: torch.zeros(10, 64)}, strict=False)
        assert _unchanged(model, before)
    folder = tmp_path / "wrong"
    folder.mkdir()
    parts = {"model-00001-of-00002.safetensors": dict(list(wrong.items())[: len(wrong) // 2])}
    parts["model-00002-of-00002.safetensors"] = dict(list(wrong.items())[len(wrong) // 2 :])
    weight_map = {}
    for name, part in parts.items():
        st.save_file(part, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for load in (
        lambda: load_sharded_checkpoint(model, folder, strict=False),
        lambda: load_checkpoint_in_model(model, str(folder)),
        lambda: load_checkpoint_in_model(model, str(folder), device_map={"": "cpu"}),
    ):
        with pytest.raises(error, match=pattern):
            load()
        assert _unchanged(model, before)


def test_uninstall_restores_every_wrapped_loader_exactly_and_install_puts_them_back():
    bindings = [
        (transformers.trainer_utils, "load_sharded_checkpoint"),
        (transformers.trainer, "load_sharded_checkpoint"),
        (st, "load_model"),
        (accelerate.utils.modeling, "load_checkpoint_in_model"),
        (accelerate.utils, "load_checkpoint_in_model"),
        (accelerate, "load_checkpoint_in_model"),
        (accelerate.big_modeling, "load_checkpoint_in_model"),
        (accelerate.utils.modeling, "load_state_dict"),
    ]
    wrapped = [getattr(module, name) for module, name in bindings]
    originals = [w.__wrapped__ for w in wrapped]
    assert all(o.__module__.split(".")[0] in ("transformers", "safetensors", "accelerate") for o in originals)
    assert loaders_integration.installed()
    integration.uninstall()
    try:
        assert not loaders_integration.installed()
        assert all(getattr(module, name) is o for (module, name), o in zip(bindings, originals))
        assert not hasattr(transformers.trainer_utils.load_sharded_checkpoint, "__wrapped__")
    finally:
        integration.install()
    assert loaders_integration.installed()
    again = [getattr(module, name) for module, name in bindings]
    assert all(a.__wrapped__ is o for a, o in zip(again, originals))
    loaders_integration.install()  # idempotent
    assert [getattr(module, name) for module, name in bindings] == again
