"""Optimizer state follows the layout: a run resumes across layouts (issue 19).

Two layout-changing recipes: ``qwen2_moe-linear-experts`` (per-expert ``nn.Linear`` experts; the unpatched
Transformers 5 model fuses them into ``gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]``) and
``llama-fused-qkv`` (one ``qkv_proj`` of 64 + 32 + 32 rows, GQA). Optimizers with two param groups (decay / no
decay, as the Trainer builds them): SGD with momentum, Adam with ``amsgrad`` (``max_exp_avg_sq``), AdamW.

Bounds, measured on 2026-12-03 (tiny models, CPU, fp32, one thread): the conversion itself is exact (``torch.equal``
everywhere). A resumed run differs from the uninterrupted run of the layout it started in by fp32 reduction noise of
the other layout's forward (one matmul over ``qkv_proj`` instead of three, per-expert matmuls): SGD at most 3.0e-08
(bound 2e-7), Adam/AdamW at most 9.8e-07 (bound 5e-6; Adam turns the noise of near-zero gradients into larger
steps; two uninterrupted runs in the two layouts differ by up to 9.4e-06 at lr 1e-3). Resuming without the optimizer
state instead differs by 3.4e-03 (Adam/AdamW) and 0.10 (SGD): the bounds tell a lost or misplaced state apart. The
Trainer (AdamW, linear decay, 2 + 2 steps): at most 1.3e-07 against the uninterrupted run (bound 1e-6), and a
patched run's ``optimizer.pt`` is the unpatched run's within 5.1e-08.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2MoeForCausalLM, Trainer, TrainingArguments

import training_parity as tp
from helpers import save_tiny, tiny_llama_config, tiny_qwen2_moe_config
from modelpatch import (
    OptimizerStateError,
    load_original_optimizer_state_dict,
    optimizer_state_dict_in_model_layout,
    original_optimizer_state_dict,
)
from modelpatch.integrations import trainer as trainer_integration

FAMILIES = {
    "qwen2_moe": (Qwen2MoeForCausalLM, tiny_qwen2_moe_config, "qwen2_moe-linear-experts"),
    "llama": (LlamaForCausalLM, tiny_llama_config, "llama-fused-qkv"),
}

OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-3, amsgrad=True),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-3),
}
BOUNDS = {"sgd": 2e-7, "adam": 5e-6, "adamw": 5e-6}
TRAINER_BOUND = 1e-6


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny checkpoint per family (the unpatched model, seed 0)."""
    folders = {}
    for family, (cls, config, _) in FAMILIES.items():
        folders[family] = tmp_path_factory.mktemp(family) / "base"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_tiny(cls, config(), folders[family])
    return folders


def _load(family: str, folder: Path, patched: bool) -> torch.nn.Module:
    cls, _, recipe = FAMILIES[family]
    return tp.load(cls, folder, recipe if patched else None)


def _groups(model) -> list[dict]:
    """Decay / no-decay param groups, as the Trainer builds them (``named_parameters`` order within each)."""
    named = list(model.named_parameters())
    plain = [p for n, p in named if "bias" not in n and "norm" not in n]
    rest = [p for n, p in named if "bias" in n or "norm" in n]
    return [{"params": plain, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _batches(steps: int = 4) -> list[dict]:
    out = []
    for i in range(steps):
        ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(i))
        out.append({"input_ids": ids, "labels": ids})
    return out


def _diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _names_in_order(model, optimizer) -> list[str]:
    """The model's names of ``optimizer``'s parameters in state-dict index order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_name(state_dict: dict, names: list[str]) -> dict[str, dict]:
    order = [i for group in state_dict["param_groups"] for i in group["params"]]
    return {names[order.index(i)]: value for i, value in state_dict["state"].items()}


def _assert_same_state(a: dict, b: dict) -> None:
    """Two optimizer state dicts are equal: same groups, same indices and keys, every value exactly equal."""
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for index, value in a["state"].items():
        assert list(value) == list(b["state"][index])
        for key, tensor in value.items():
            other = b["state"][index][key]
            assert type(tensor) is type(other)
            assert torch.equal(tensor, other) if isinstance(tensor, torch.Tensor) else tensor == other, (index, key)


def _step_synthetic(model, optimizer, steps: int = 2, seed: int = 0) -> None:
    """``steps`` optimizer steps with random gradients (no forward: the state is what is tested here)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


# -- the conversion itself -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_converts_exactly_and_round_trips(bases, family, optimizer):
    patched, unpatched = _load(family, bases[family], True), _load(family, bases[family], False)
    opt = OPTIMIZERS[optimizer](_groups(patched))
    _step_synthetic(patched, opt)
    own = copy.deepcopy(opt.state_dict())

    original = original_optimizer_state_dict(patched, opt)
    _assert_same_state(opt.state_dict(), own)  # the optimizer is not changed

    # the structure of the unpatched model's optimizer: groups, sizes, per-element shapes, one entry per parameter
    reference = OPTIMIZERS[optimizer](_groups(unpatched))
    assert [len(g["params"]) for g in original["param_groups"]] == [
        len(g["params"]) for g in reference.state_dict()["param_groups"]
    ]
    assert [g["weight_decay"] for g in original["param_groups"]] == [0.1, 0.0]
    theirs = _names_in_order(unpatched, reference)
    shapes = dict((n, p.shape) for n, p in unpatched.named_parameters())
    state = _by_name(original, theirs)
    assert sorted(state) == sorted(theirs)
    keys = {"sgd": ["momentum_buffer"], "adam": ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]}
    keys["adamw"] = ["step", "exp_avg", "exp_avg_sq"]
    for name, value in state.items():
        assert list(value) == keys[optimizer]
        for key, tensor in value.items():
            assert tensor.shape == (() if key == "step" else shapes[name]), (name, key)
            if key == "step":
                assert tensor.item() == 2.0

    # every converted tensor is the patched state rearranged, checked against a layout written out by hand
    mine = _by_name(own, _names_in_order(patched, opt))
    for key in keys[optimizer]:
        if key == "step":
            continue
        for layer in range(2):
            if family == "llama":
                prefix = f"model.layers.{layer}.self_attn."
                q, k, v = mine[prefix + "qkv_proj.weight"][key].split([64, 32, 32])
                for part, tensor in zip("qkv", (q, k, v)):
                    assert torch.equal(state[f"{prefix}{part}_proj.weight"][key], tensor)
            else:
                prefix = f"model.layers.{layer}.mlp.experts."
                gate_up = torch.stack(
                    [
                        torch.cat(
                            [mine[f"{prefix}{e}.gate_proj.weight"][key], mine[f"{prefix}{e}.up_proj.weight"][key]]
                        )
                        for e in range(4)
                    ]
                )
                down = torch.stack([mine[f"{prefix}{e}.down_proj.weight"][key] for e in range(4)])
                assert torch.equal(state[prefix + "gate_up_proj"][key], gate_up)
                assert torch.equal(state[prefix + "down_proj"][key], down)
        shared = "model.layers.0.mlp.gate_proj.weight" if family == "llama" else "model.layers.0.mlp.gate.weight"
        param = dict(patched.named_parameters())[shared]
        assert state[shared][key] is opt.state[param][key]  # a parameter both layouts share: the optimizer's own

    # back into a fresh optimizer of the patched model: exactly the state it had
    fresh = OPTIMIZERS[optimizer](_groups(patched))
    load_original_optimizer_state_dict(patched, fresh, original)
    _assert_same_state(fresh.state_dict(), own)
    # the steps of one tensor made of several are separate tensors (torch increments them in place)
    steps = [value["step"] for value in fresh.state.values() if "step" in value]
    assert len({id(step) for step in steps}) == len(steps)

    # the unpatched optimizer loads it with plain torch, and its own state dict is the original layout already
    reference.load_state_dict(original)
    _assert_same_state(original_optimizer_state_dict(unpatched, reference), reference.state_dict())
    assert optimizer_state_dict_in_model_layout(unpatched, reference, original) is original


def test_a_state_dict_in_the_model_layout_loads_as_it_is(bases):
    patched = _load("llama", bases["llama"], True)
    opt = OPTIMIZERS["adamw"](_groups(patched))
    _step_synthetic(patched, opt)
    own = opt.state_dict()
    assert optimizer_state_dict_in_model_layout(patched, opt, own) is own


# -- resume across layouts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "optimizer"), [("qwen2_moe", "adamw"), ("qwen2_moe", "sgd"), ("llama", "adamw")])
def test_resume_across_layouts_equals_the_uninterrupted_run(bases, tmp_path, family, optimizer):
    data = _batches()
    bound = BOUNDS[optimizer]
    uninterrupted = {}
    for patched in (False, True):
        model = _load(family, bases[family], patched)
        tp.train(model, OPTIMIZERS[optimizer](_groups(model)), data)
        uninterrupted[patched] = tp.original_state(model)
    for first in (False, True):  # unpatched -> patched, then patched -> unpatched
        folder = tmp_path / f"step2-{first}"
        model = _load(family, bases[family], first)
        opt = OPTIMIZERS[optimizer](_groups(model))
        tp.train(model, opt, data[:2])
        model.save_pretrained(folder)
        torch.save(original_optimizer_state_dict(model, opt), folder / "optimizer.pt")

        resumed = _load(family, folder, not first)
        opt = OPTIMIZERS[optimizer](_groups(resumed))
        state = torch.load(folder / "optimizer.pt", weights_only=True)
        if first:  # the unpatched side needs nothing of modelpatch: torch's own load_state_dict
            opt.load_state_dict(state)
        else:
            load_original_optimizer_state_dict(resumed, opt, state)
        tp.train(resumed, opt, data[2:])  # (no dropout: the seeds tp.train sets do not matter)
        assert _diff(tp.original_state(resumed), uninterrupted[first]) <= bound, (family, optimizer, first)
    # without the optimizer state the same resume is far outside the bound: the bound sees a lost state
    blank = _load(family, tmp_path / "step2-False", True)
    tp.train(blank, OPTIMIZERS[optimizer](_groups(blank)), data[2:])
    assert _diff(tp.original_state(blank), uninterrupted[False]) > 100 * bound


# -- refusals ----------------------------------------------------------------------------------------------------------
def test_factored_adafactor_state_is_refused_naming_the_parameter(bases):
    patched, unpatched = _load("llama", bases["llama"], True), _load("llama", bases["llama"], False)
    opt = torch.optim.Adafactor(_groups(patched), lr=1e-2)
    _step_synthetic(patched, opt, steps=1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(OptimizerStateError, match="row_var") as caught:
        original_optimizer_state_dict(patched, opt)
    assert caught.value.parameter == "model.layers.0.self_attn.qkv_proj.weight"
    assert caught.value.layout == "model"
    assert "model's own layout" in str(caught.value) and "(SGD, Adam, AdamW)" in str(caught.value)
    _assert_same_state(opt.state_dict(), before)

    # the other way: an unpatched run's Adafactor state into the patched model's optimizer
    theirs = torch.optim.Adafactor(_groups(unpatched), lr=1e-2)
    _step_synthetic(unpatched, theirs, steps=1)
    with pytest.raises(OptimizerStateError, match="row_var") as caught:
        load_original_optimizer_state_dict(patched, opt, theirs.state_dict())
    assert caught.value.parameter == "model.layers.0.self_attn.q_proj.weight"
    assert caught.value.layout == "original"
    _assert_same_state(opt.state_dict(), before)


def test_a_state_dict_in_neither_layout_is_refused(bases):
    patched = _load("llama", bases["llama"], True)
    opt = OPTIMIZERS["adamw"](_groups(patched))
    _step_synthetic(patched, opt)
    before = copy.deepcopy(opt.state_dict())
    original = original_optimizer_state_dict(patched, opt)

    sizes = [len(g["params"]) for g in original["param_groups"]]
    assert sizes == [16, 5] and [len(g["params"]) for g in opt.param_groups] == [12, 5]
    fewer = copy.deepcopy(original)  # one parameter short: 15 in the first group, neither layout's 16 nor 12
    fewer["param_groups"][0]["params"].pop()
    with pytest.raises(OptimizerStateError, match="neither layout") as caught:
        load_original_optimizer_state_dict(patched, opt, fewer)
    assert "param group 0 has 15 parameters, not 16" in str(caught.value)
    assert "param group 0 has 15 parameters, not 12" in str(caught.value)

    wrong = copy.deepcopy(original)  # another model's k_proj state (48 rows instead of 32)
    unpatched = _load("llama", bases["llama"], False)
    theirs = _names_in_order(unpatched, OPTIMIZERS["adamw"](_groups(unpatched)))
    order = [i for g in wrong["param_groups"] for i in g["params"]]
    wrong["state"][order[theirs.index("model.layers.1.self_attn.k_proj.weight")]]["exp_avg"] = torch.zeros(48, 64)
    with pytest.raises(OptimizerStateError, match=r"shape \(48, 64\)") as caught:
        load_original_optimizer_state_dict(patched, opt, wrong)
    assert caught.value.parameter == "model.layers.1.self_attn.k_proj.weight"
    assert caught.value.layout == "original"

    with pytest.raises(OptimizerStateError, match="Not an optimizer state dict"):
        load_original_optimizer_state_dict(patched, opt, {"exp_avg": torch.zeros(1)})
    _assert_same_state(opt.state_dict(), before)


def test_one_tensor_in_two_param_groups_or_in_part_is_refused(bases):
    patched = _load("qwen2_moe", bases["qwen2_moe"], True)
    named = dict(patched.named_parameters())
    gate = "model.layers.0.mlp.experts.0.gate_proj.weight"
    up = "model.layers.0.mlp.experts.0.up_proj.weight"
    split = torch.optim.AdamW(
        [{"params": [p for n, p in named.items() if n != up]}, {"params": [named[up]], "weight_decay": 0.0}]
    )
    with pytest.raises(OptimizerStateError, match="one param group") as caught:
        original_optimizer_state_dict(patched, split)
    assert caught.value.parameter == gate and caught.value.layout == "model"

    part = torch.optim.AdamW([p for n, p in named.items() if n != up])
    with pytest.raises(OptimizerStateError, match="or none") as caught:
        original_optimizer_state_dict(patched, part)
    assert caught.value.parameter == gate

    stranger = torch.optim.AdamW(list(patched.parameters()) + [torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(OptimizerStateError, match=r"param_groups\[0\]\['params'\]\[55\].*not a parameter"):
        original_optimizer_state_dict(patched, stranger)


def test_experts_out_of_step_are_refused(bases):
    patched = _load("qwen2_moe", bases["qwen2_moe"], True)
    opt = OPTIMIZERS["adamw"](_groups(patched))
    _step_synthetic(patched, opt, steps=1)
    named = dict(patched.named_parameters())
    idle = "model.layers.1.mlp.experts.2.down_proj.weight"
    opt.state[named[idle]]["step"] = torch.tensor(7.0)
    with pytest.raises(OptimizerStateError, match="'step' differs") as caught:
        original_optimizer_state_dict(patched, opt)
    assert caught.value.parameter == idle

    del opt.state[named[idle]]  # an expert never stepped (a None gradient)
    with pytest.raises(OptimizerStateError, match="has none") as caught:
        original_optimizer_state_dict(patched, opt)
    assert caught.value.parameter == idle


# -- the Trainer -----------------------------------------------------------------------------------------------------
def _trainer(model, folder: Path) -> Trainer:
    data = [{"input_ids": b["input_ids"][0], "labels": b["input_ids"][0]} for b in _batches()]
    args = TrainingArguments(
        output_dir=str(folder),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=1,
        learning_rate=1e-3,
        weight_decay=0.1,
        use_cpu=True,
        report_to=[],
        logging_steps=100,
        seed=0,
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=data)


def _optimizer_file(folder: Path) -> dict:
    return torch.load(folder / "optimizer.pt", weights_only=True)


def _assert_close_state(got: dict, want: dict, bound: float) -> None:
    assert [len(g["params"]) for g in got["param_groups"]] == [len(g["params"]) for g in want["param_groups"]]
    assert sorted(got["state"]) == sorted(want["state"])
    for index, value in want["state"].items():
        assert list(got["state"][index]) == list(value)
        for key, tensor in value.items():
            assert got["state"][index][key].shape == tensor.shape
            assert (got["state"][index][key] - tensor).abs().max().item() <= bound, (index, key)


def test_trainer_resumes_across_layouts_both_ways(bases, tmp_path):
    reference = _load("llama", bases["llama"], False)
    _trainer(reference, tmp_path / "unpatched").train()
    patched = _load("llama", bases["llama"], True)
    _trainer(patched, tmp_path / "patched").train()
    # the patched run's optimizer.pt is what the unpatched run wrote (original layout), up to the layouts' noise
    for step in (2, 4):
        got, want = (_optimizer_file(tmp_path / run / f"checkpoint-{step}") for run in ("patched", "unpatched"))
        _assert_close_state(got, want, TRAINER_BOUND)

    resumed = _load("llama", bases["llama"], True)  # a patched Trainer resumes the unpatched run
    trainer = _trainer(resumed, tmp_path / "resumed")
    trainer.train(resume_from_checkpoint=str(tmp_path / "unpatched/checkpoint-2"))
    assert _diff(tp.original_state(resumed), tp.original_state(reference)) <= TRAINER_BOUND
    assert not {"state_dict", "load_state_dict"} & set(vars(trainer.optimizer))  # the stand-ins are gone

    back = _load("llama", bases["llama"], False)  # and an unpatched Trainer resumes the patched run
    _trainer(back, tmp_path / "back").train(resume_from_checkpoint=str(tmp_path / "patched/checkpoint-2"))
    assert _diff(tp.original_state(back), tp.original_state(patched)) <= TRAINER_BOUND


def test_trainer_resumes_an_unpatched_moe_run_with_linear_experts(bases, tmp_path):
    reference = _load("qwen2_moe", bases["qwen2_moe"], False)
    _trainer(reference, tmp_path / "unpatched").train()
    resumed = _load("qwen2_moe", bases["qwen2_moe"], True)
    _trainer(resumed, tmp_path / "resumed").train(resume_from_checkpoint=str(tmp_path / "unpatched/checkpoint-2"))
    assert _diff(tp.original_state(resumed), tp.original_state(reference)) <= TRAINER_BOUND
    # its own checkpoint-4 holds the original layout: the unpatched run's optimizer.pt, up to the noise
    got = _optimizer_file(tmp_path / "resumed/checkpoint-4")
    _assert_close_state(got, _optimizer_file(tmp_path / "unpatched/checkpoint-4"), TRAINER_BOUND)


def test_trainer_keeps_adafactor_state_in_the_model_layout_with_a_warning(bases, tmp_path, caplog):
    patched = _load("llama", bases["llama"], True)
    trainer = _trainer(patched, tmp_path)
    trainer.optimizer = torch.optim.Adafactor(_groups(patched), lr=1e-2)
    trainer.create_scheduler(num_training_steps=4, optimizer=trainer.optimizer)
    _step_synthetic(patched, trainer.optimizer, steps=1)
    with caplog.at_level(logging.WARNING, logger="modelpatch.integrations.trainer"):
        trainer._save_optimizer_and_scheduler(str(tmp_path))
    messages = [r.getMessage() for r in caplog.records if r.name == "modelpatch.integrations.trainer"]
    assert len(messages) == 1 and "model.layers.0.self_attn.qkv_proj.weight" in messages[0]
    _assert_same_state(_optimizer_file(tmp_path), trainer.optimizer.state_dict())
    assert "state_dict" not in vars(trainer.optimizer)


def test_unpatched_trainer_refuses_a_patched_runs_adafactor_state_before_loading(bases, tmp_path):
    # trial: torch's bare "ValueError: loaded state dict contains a parameter group that doesn't match the size of
    # optimizer's group" under the load wrapper, although modelpatch had warned at save time
    def run(patched: bool) -> Trainer:
        data = [{"input_ids": b["input_ids"][0], "labels": b["input_ids"][0]} for b in _batches()]
        args = TrainingArguments(
            output_dir=str(tmp_path / "run"),
            max_steps=2,
            save_steps=2,
            per_device_train_batch_size=1,
            learning_rate=1e-2,
            weight_decay=0.1,
            optim="adafactor",
            use_cpu=True,
            report_to=[],
            logging_steps=100,
            seed=0,
            disable_tqdm=True,
        )
        return Trainer(model=_load("qwen2_moe", bases["qwen2_moe"], patched), args=args, train_dataset=data)

    run(True).train()
    checkpoint = tmp_path / "run/checkpoint-2"
    assert json.loads((checkpoint / trainer_integration.LAYOUT_FILE).read_text()) == {
        "layout": "model",
        "model": "Qwen2MoeForCausalLM",
        "rules": ["qwen2_moe"],
        "param_groups": [44, 11],  # decay: 2 layers x 4 experts x 3 Linears + 20 others; no decay: biases, norms
    }
    resumed = run(False)
    with pytest.raises(OptimizerStateError) as caught:
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert str(caught.value) == (
        f"resume_from_checkpoint={str(checkpoint)!r}: optimizer.pt holds the own layout of a patched "
        "Qwen2MoeForCausalLM (conversion rule set(s) 'qwen2_moe'), kept there because its state could not be "
        "converted to the original layout (modelpatch warned when it was saved), param groups of [44, 11] "
        "parameters; this Qwen2MoeForCausalLM is unpatched (the original layout), param groups of [24, 11] "
        "parameters: param group 0 has 44 parameters in the checkpoint, 24 here. Resume with the recipe (patch) the "
        "run was trained with, as the save-time warning said; a new run can start from the checkpoint's "
        "model.safetensors (original layout), which from_pretrained loads with or without a patch. Nothing was "
        "loaded into the optimizer or the scheduler."
    )
    # nothing loaded: no optimizer state, the optimizer's groups as built, the scheduler at its start; no stand-in
    assert resumed.optimizer.state_dict()["state"] == {}
    assert [len(g["params"]) for g in resumed.optimizer.param_groups] == [24, 11]
    assert resumed.lr_scheduler.last_epoch == 0
    assert "load_state_dict" not in vars(resumed.optimizer)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_unpatched_trainer_refuses_own_layout_state_of_any_optimizer(bases, tmp_path, optimizer):
    # SGD / Adam / AdamW state is written in the original layout, unless it cannot be converted (then in the
    # model's own, as Adafactor's): an own-layout optimizer.pt without modelpatch's layout file is refused the same way
    patched = _load("llama", bases["llama"], True)
    source = OPTIMIZERS[optimizer](_groups(patched))
    _step_synthetic(patched, source, steps=1)
    torch.save(source.state_dict(), tmp_path / "optimizer.pt")
    unpatched = _load("llama", bases["llama"], False)
    trainer = _trainer(unpatched, tmp_path / "out")
    trainer.optimizer = OPTIMIZERS[optimizer](_groups(unpatched))
    trainer.create_scheduler(num_training_steps=4, optimizer=trainer.optimizer)
    torch.save(trainer.lr_scheduler.state_dict(), tmp_path / "scheduler.pt")
    with pytest.raises(OptimizerStateError) as caught:
        trainer._load_optimizer_and_scheduler(str(tmp_path))
    assert str(caught.value) == (
        f"resume_from_checkpoint={str(tmp_path)!r}: optimizer.pt holds a layout other than this model's, param groups "
        "of [12, 5] parameters; this LlamaForCausalLM is unpatched (the original layout), param groups of [16, 5] "
        "parameters: param group 0 has 12 parameters in the checkpoint, 16 here. Resume with the recipe (patch) the "
        "run was trained with, as the save-time warning said; a new run can start from the checkpoint's "
        "model.safetensors (original layout), which from_pretrained loads with or without a patch. Nothing was "
        "loaded into the optimizer or the scheduler."
    )
    assert trainer.optimizer.state_dict()["state"] == {}
    assert "load_state_dict" not in vars(trainer.optimizer)


def test_trainer_integration_uninstalls_exactly():
    methods = ("_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")
    wrapped = {name: vars(Trainer)[name] for name in methods}
    assert trainer_integration.installed()
    trainer_integration.uninstall()
    try:
        assert not trainer_integration.installed()
        assert all(vars(Trainer)[name] is wrapped[name].__wrapped__ for name in methods)
    finally:
        trainer_integration.install()
    assert trainer_integration.installed()
    assert all(vars(Trainer)[name].__wrapped__ is wrapped[name].__wrapped__ for name in methods)


def test_transformers_alone_does_not_resume_unpatched_fused_experts(bases):
    # the README's caveat: the Trainer resumes weights with load_state_dict(state_dict, False), which an unpatched
    # Transformers 5 MoE model (fused experts, no conversion state) does not convert: the experts keep their values
    from safetensors.torch import load_file

    unpatched = _load("qwen2_moe", bases["qwen2_moe"], False)
    result = unpatched.load_state_dict(load_file(bases["qwen2_moe"] / "model.safetensors"), False)
    fused = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
    assert sorted(result.missing_keys) == sorted(fused)
    assert len(result.unexpected_keys) == 2 * 4 * 3  # the per-expert tensors of the checkpoint
