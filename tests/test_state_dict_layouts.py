"""``model.load_state_dict`` accepts both layouts on models that carry conversion rules (issue 11, item 1), and so the
Trainer's resume and best-model reload restore exactly what was trained (item 2), with no subclass and no extra
call."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import safetensors.torch as st
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.trainer_utils import load_sharded_checkpoint

from helpers import tiny_llama_config, tiny_qwen2_moe_config, tiny_qwen3_moe_config
from modelpatch.conversion import ConversionShapeError, has_state_dict_hooks
from modelpatch.conversion.statedict import remove_state_dict_hooks
from modelpatch.recipes import get_recipe

X = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10]])


def _randomize(model, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)


def _saved(tmp_path, model_cls, config, name="base"):
    torch.manual_seed(0)
    model = model_cls(config)
    _randomize(model)
    path = tmp_path / name
    model.save_pretrained(path)
    return str(path)


def _load(recipe: str, path: str):
    with get_recipe(recipe).apply():
        return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture
def fused_llama(tmp_path):
    path = _saved(tmp_path, LlamaForCausalLM, tiny_llama_config(attention_bias=True))
    return _load("llama-fused-qkv", path), path


def _perturb(model, amount: float = 0.01) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * amount)


def test_original_layout_state_dict_loads_strictly_and_exactly(fused_llama, tmp_path):
    model, _ = fused_llama
    _perturb(model)
    trained = model(X).logits.detach()
    model.save_pretrained(tmp_path / "trained")
    saved = st.load_file(tmp_path / "trained" / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in saved and not any("qkv_proj" in k for k in saved)
    _perturb(model, 1.0)
    assert (model(X).logits - trained).abs().max() > 0.1
    result = model.load_state_dict(saved, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    layer = model.model.layers[1].self_attn
    expected = torch.cat([saved[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.qkv_proj.weight, expected)
    assert torch.equal(
        layer.qkv_proj.bias, torch.cat([saved[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    )
    assert (model(X).logits - trained).abs().max().item() == 0.0
    # state_dict() stays in the model's own layout, and loads back as before
    own = model.state_dict()
    assert "model.layers.0.self_attn.qkv_proj.weight" in own and "model.layers.0.self_attn.q_proj.weight" not in own
    assert model.load_state_dict(own, strict=True).missing_keys == []


def test_missing_keys_are_named_in_the_callers_layout(fused_llama, tmp_path):
    model, path = fused_llama
    saved = st.load_file(os.path.join(path, "model.safetensors"))
    del saved["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "model.layers.1.self_attn.k_proj.weight"'):
        model.load_state_dict(saved, strict=True)
    saved = st.load_file(os.path.join(path, "model.safetensors"))
    no_attention = {k: v for k, v in saved.items() if "layers.0.self_attn" not in k}
    model2 = _load("llama-fused-qkv", path)
    result = model2.load_state_dict(no_attention, strict=False)
    assert sorted(result.missing_keys) == sorted(
        f"model.layers.0.self_attn.{p}.{w}"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        for w in ("weight", "bias")
    )
    assert result.unexpected_keys == []


def test_mixed_layouts_and_extra_keys(fused_llama):
    model, path = fused_llama
    saved = st.load_file(os.path.join(path, "model.safetensors"))
    _perturb(model)
    mixed = {k: v for k, v in saved.items() if "layers.0.self_attn" not in k}
    mixed.update({k: v for k, v in model.state_dict().items() if "layers.0.self_attn" in k})
    mixed["model.extra.weight"] = torch.zeros(2)
    result = model.load_state_dict(mixed, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["model.extra.weight"]
    q, k, v = (saved[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, torch.cat([q, k, v]))


def test_shape_error_names_the_parameter(fused_llama):
    model, path = fused_llama
    saved = st.load_file(os.path.join(path, "model.safetensors"))
    saved["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    before = model.model.layers[1].self_attn.qkv_proj.weight.clone()
    with pytest.raises(ConversionShapeError, match="model.layers.1.self_attn.qkv_proj.weight"):
        model.load_state_dict(saved)
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, before)


def test_sharded_checkpoint_with_groups_across_shards(fused_llama, tmp_path):
    import json

    model, _ = fused_llama
    _perturb(model)
    want = model(X).logits.detach()
    model.save_pretrained(tmp_path / "trained")
    saved = st.load_file(tmp_path / "trained" / "model.safetensors")
    # two shards (Transformers' own index format) that split layer 0's q/k/v group, as a size-based split can:
    # q_proj in the first, k_proj/v_proj in the second
    second = {
        k: v for k, v in saved.items() if k.startswith(("model.layers.0.self_attn.k_", "model.layers.0.self_attn.v_"))
    }
    first = {k: v for k, v in saved.items() if k not in second}
    assert "model.layers.0.self_attn.q_proj.weight" in first and "model.layers.0.self_attn.k_proj.weight" in second
    folder = tmp_path / "sharded"
    folder.mkdir()
    weight_map = {}
    for name, part in (("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", second)):
        st.save_file(part, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _perturb(model, 1.0)
    load_sharded_checkpoint(model, folder, strict=False)  # one load_state_dict(strict=False) per shard
    assert (model(X).logits - want).abs().max().item() == 0.0


def test_hooks_follow_the_model_and_only_models_with_rules_have_them(fused_llama, tmp_path):
    model, path = fused_llama
    assert has_state_dict_hooks(model)
    assert not has_state_dict_hooks(AutoModelForCausalLM.from_pretrained(path))
    saved = st.load_file(os.path.join(path, "model.safetensors"))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        _perturb(clone, 1.0)
        clone.load_state_dict(saved)
        assert torch.equal(clone(X).logits, model(X).logits)


@pytest.mark.parametrize(
    ("recipe", "model_cls", "config"),
    [
        ("qwen2_moe-full-example", Qwen2MoeForCausalLM, tiny_qwen2_moe_config),
        ("qwen3_moe-linear-experts", Qwen3MoeForCausalLM, tiny_qwen3_moe_config),
    ],
)
def test_moe_recipes_load_their_own_saved_layout(tmp_path, recipe, model_cls, config):
    path = _saved(tmp_path, model_cls, config())
    model = _load(recipe, path)
    _perturb(model)
    want = model(X).logits.detach()
    model.save_pretrained(tmp_path / "trained")
    saved = st.load_file(tmp_path / "trained" / "model.safetensors")
    _perturb(model, 1.0)
    assert model.load_state_dict(saved, strict=True).missing_keys == []
    assert (model(X).logits - want).abs().max().item() == 0.0


# --- Trainer -------------------------------------------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, seed: int, n: int = 16):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (n, 8), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out, **overrides) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_steps=4,
        save_steps=2,
        save_strategy="steps",
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


TRAINER_CASES = [
    ("llama-fused-qkv", LlamaForCausalLM, lambda: tiny_llama_config(attention_bias=True)),
    ("qwen3_moe-linear-experts", Qwen3MoeForCausalLM, tiny_qwen3_moe_config),
    ("qwen2_moe-full-example", Qwen2MoeForCausalLM, tiny_qwen2_moe_config),
]


def _train(path, recipe, out, resume=None, hooks=True, **overrides):
    model = _load(recipe, path).train()
    if not hooks:
        remove_state_dict_hooks(model)
    trainer = Trainer(model=model, args=_args(out, **overrides), train_dataset=_Tokens(0))
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "model_cls", "config"), TRAINER_CASES)
def test_trainer_resume_equals_an_uninterrupted_run(tmp_path, recipe, model_cls, config):
    path = _saved(tmp_path, model_cls, config())
    full, _ = _train(path, recipe, tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    # the checkpoint is in the original layout: plain Transformers loads it, every key used
    _, info = AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    resumed, _ = _train(path, recipe, tmp_path / "resumed", resume=str(checkpoint))
    full_state, resumed_state = full.state_dict(), resumed.state_dict()
    assert full_state.keys() == resumed_state.keys()
    assert max((full_state[k] - resumed_state[k]).abs().max().item() for k in full_state) == 0.0
    if recipe != "qwen3_moe-linear-experts":  # its checkpoint layout is the model's own: nothing to convert
        # without the hooks the resumed model keeps the pretrained fused weights (the defect this fixes)
        broken, _ = _train(path, recipe, tmp_path / "broken", resume=str(checkpoint), hooks=False)
        broken_state = broken.state_dict()
        assert max((full_state[k] - broken_state[k]).abs().max().item() for k in full_state) > 1e-3


@pytest.mark.slow
def test_trainer_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    path = _saved(tmp_path, LlamaForCausalLM, tiny_llama_config(attention_bias=True))
    model = _load("llama-fused-qkv", path).train()
    args = _args(
        tmp_path / "best",
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=False,  # training on random tokens raises the loss on other random tokens: step 2 is best
        save_total_limit=None,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(0), eval_dataset=_Tokens(1, 8))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-2")
    reference = _load("llama-fused-qkv", best)
    last = _load("llama-fused-qkv", str(tmp_path / "best" / "checkpoint-4"))
    state, want, final = model.state_dict(), reference.state_dict(), last.state_dict()
    assert max((state[k] - want[k]).abs().max().item() for k in want) == 0.0
    assert max((final[k] - want[k]).abs().max().item() for k in want) > 1e-3


def test_a_partial_group_is_written_into_its_rows_at_once(fused_llama):
    # fresh-user trial: q_proj alone was held back silently and applied, stale, by a later unrelated call
    model, path = fused_llama
    saved = st.load_file(os.path.join(path, "model.safetensors"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    before = qkv.weight.detach().clone()
    new_q = torch.randn(64, 64)
    result = model.load_state_dict({"model.layers.0.self_attn.q_proj.weight": new_q}, strict=False)
    assert torch.equal(qkv.weight[:64], new_q) and torch.equal(qkv.weight[64:], before[64:])  # as an unpatched model
    assert result.unexpected_keys == []
    assert "model.layers.0.self_attn.k_proj.weight" in result.missing_keys
    assert "model.layers.0.self_attn.q_proj.weight" not in result.missing_keys
    k, v = (saved[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "kv")
    model.load_state_dict({"model.layers.0.self_attn.k_proj.weight": k + 1}, strict=False)
    model.load_state_dict({"model.layers.0.self_attn.v_proj.weight": v}, strict=False)
    assert torch.equal(qkv.weight, torch.cat([new_q, k + 1, v]))  # GQA rows: 64 q, 32 k, 32 v


def test_the_same_parameter_in_both_layouts_is_refused(fused_llama):
    from modelpatch.conversion import ConversionError

    model, path = fused_llama
    both = st.load_file(os.path.join(path, "model.safetensors"))
    both["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(128, 64)
    with pytest.raises(ConversionError, match=r"'model.layers.0.self_attn.qkv_proj.weight' is given twice"):
        model.load_state_dict(both, strict=True)


def test_a_partial_expert_group_is_written_into_its_expert_slice(tmp_path):
    # attention fused by the recipe, experts still fused by Transformers' built-in rules (MergeModulelist+Concatenate)
    path = _saved(tmp_path, Qwen2MoeForCausalLM, tiny_qwen2_moe_config())
    model = _load("qwen2_moe-fused-qkv", path)
    experts = model.model.layers[1].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    gate = torch.randn(32, 64)
    model.load_state_dict({"model.layers.1.mlp.experts.2.gate_proj.weight": gate}, strict=False)
    assert torch.equal(experts.gate_up_proj[2, :32], gate)
    assert torch.equal(experts.gate_up_proj[2, 32:], before[2, 32:]) and torch.equal(
        experts.gate_up_proj[:2], before[:2]
    )
