"""patch_model: patch a model that is already built, move its weights through the load rules, revert exactly."""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
import torch.nn as nn
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm

import modelpatch
from helpers import (
    INPUT_IDS,
    tiny_llama_config,
    tiny_mixtral_config,
    tiny_qwen2_moe_config,
    tiny_qwen3_moe_config,
)
from modelpatch import (
    InstancePatchError,
    ModelPatch,
    OptimizerGroupError,
    UnmatchedPatchKeyError,
    apply_patches,
    patch_model,
)
from modelpatch.conversion.state import get_state
from modelpatch.recipes import FUSED_QKV_CLASSES, LINEAR_EXPERTS_CLASSES, get_recipe
from modelpatch.routing import record_routing, replay_routing
from routing_models import ExpertsObserver, perturb_routers

# (id, model class, config, recipe, replaced class, replacement class, modules replaced)
CASES = [
    ("llama-mha", LlamaForCausalLM, dict(num_key_value_heads=4), "llama-fused-qkv"),
    ("llama-gqa", LlamaForCausalLM, dict(), "llama-fused-qkv"),
    ("llama-mha-bias", LlamaForCausalLM, dict(num_key_value_heads=4, attention_bias=True), "llama-fused-qkv"),
    ("llama-gqa-bias", LlamaForCausalLM, dict(attention_bias=True), "llama-fused-qkv"),
    ("qwen2_moe-full", Qwen2MoeForCausalLM, dict(), "qwen2_moe-full-example"),
    ("qwen3_moe-experts", Qwen3MoeForCausalLM, dict(), "qwen3_moe-linear-experts"),
    ("mixtral-experts", MixtralForCausalLM, dict(), "mixtral-linear-experts"),
]
CONFIGS = {
    LlamaForCausalLM: tiny_llama_config,
    Qwen2MoeForCausalLM: tiny_qwen2_moe_config,
    Qwen3MoeForCausalLM: tiny_qwen3_moe_config,
    MixtralForCausalLM: tiny_mixtral_config,
}
EXPECTED_ROWS = {  # replaced module paths per layer, and the replacement classes
    "llama-fused-qkv": ({"self_attn"}, {FUSED_QKV_CLASSES["llama"]}),
    "qwen2_moe-full-example": (
        {"self_attn", "mlp.experts"},
        {FUSED_QKV_CLASSES["qwen2_moe"], LINEAR_EXPERTS_CLASSES["qwen2_moe"]},
    ),
    "qwen3_moe-linear-experts": ({"mlp.experts"}, {LINEAR_EXPERTS_CLASSES["qwen3_moe"]}),
    "mixtral-linear-experts": ({"mlp.experts"}, {LINEAR_EXPERTS_CLASSES["mixtral"]}),
}


def _build(model_cls, overrides, seed=0):
    torch.manual_seed(seed)
    return model_cls(CONFIGS[model_cls](**overrides)).eval()


def _snapshot(model):
    """Modules and parameter objects (identity) and a copy of every value."""
    return (
        dict(model.named_modules()),
        dict(model.named_parameters()),
        {k: v.detach().clone() for k, v in model.state_dict().items()},
    )


def _assert_back(model, snapshot):
    modules, params, values = snapshot
    now = dict(model.named_modules())
    assert now.keys() == modules.keys()
    assert all(now[k] is modules[k] for k in modules)
    now_params = dict(model.named_parameters())
    assert now_params.keys() == params.keys()
    assert all(now_params[k] is params[k] for k in params)
    state = model.state_dict()
    assert state.keys() == values.keys()
    assert all(torch.equal(state[k], values[k]) for k in values)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_patch_swaps_modules_keeps_logits_and_revert_restores_the_same_objects(case):
    _, model_cls, overrides, recipe = case
    model = _build(model_cls, overrides)
    snapshot = _snapshot(model)
    with torch.no_grad():
        before = model(INPUT_IDS).logits
    patch = get_recipe(recipe).patch(model)
    paths, classes = EXPECTED_ROWS[recipe]
    assert sorted(r.path for r in patch.report) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in paths)
    assert {r.replacement for r in patch.report} == classes
    for row in patch.report:
        assert type(model.get_submodule(row.path)) is row.replacement
        assert modelpatch.replacement_of(model.get_submodule(row.path)).via == "patch_model"
        assert snapshot[0][row.path] is not model.get_submodule(row.path)
    report = modelpatch.patch_report(model)
    assert [(r.path, r.via) for r in report.rows] == [(r.path, "patch_model") for r in patch.report]
    with torch.no_grad():
        after = model(INPUT_IDS).logits
    assert (after - before).abs().max().item() < 1e-5
    # every new parameter has the dtype, device and requires_grad of its sources
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" and p.requires_grad for p in model.parameters())
    patch.revert()
    assert patch.reverted
    _assert_back(model, snapshot)
    assert modelpatch.patch_report(model).rows == []
    assert get_state(model) is None
    patch.revert()  # a second revert does nothing
    _assert_back(model, snapshot)


def test_key_map_of_fused_qkv_and_linear_experts():
    model = _build(LlamaForCausalLM, dict(attention_bias=True))
    with get_recipe("llama-fused-qkv").patch(model) as patch:
        row = patch.report[0]
        assert row.original is LlamaAttention and row.key == "LlamaAttention"
        prefix = "model.layers.0.self_attn."
        assert dict(row.key_map) == {
            **{f"{prefix}{p}_proj.{t}": (f"{prefix}qkv_proj.{t}",) for p in "qkv" for t in ("weight", "bias")},
            f"{prefix}o_proj.weight": (f"{prefix}o_proj.weight",),
            f"{prefix}o_proj.bias": (f"{prefix}o_proj.bias",),
        }
        assert row.as_dict()["key_map"][f"{prefix}q_proj.weight"] == [f"{prefix}qkv_proj.weight"]
    moe = _build(Qwen3MoeForCausalLM, {})
    with get_recipe("qwen3_moe-linear-experts").patch(moe) as patch:
        prefix = "model.layers.1.mlp.experts."
        key_map = patch.report[1].key_map
        assert key_map[prefix + "gate_up_proj"] == tuple(
            f"{prefix}{e}.{name}.weight" for name in ("gate_proj", "up_proj") for e in range(4)
        )
        assert key_map[prefix + "down_proj"] == tuple(f"{prefix}{e}.down_proj.weight" for e in range(4))


def test_untouched_tensors_are_handed_over_and_converted_originals_are_freed():
    model = _build(LlamaForCausalLM, {})
    attention = model.model.layers[0].self_attn
    o_weight, q_weight = attention.o_proj.weight, attention.q_proj.weight
    with get_recipe("llama-fused-qkv").patch(model):
        fused = model.model.layers[0].self_attn
        assert fused.o_proj.weight is o_weight  # no rule changes it: the same Parameter, no copy
        assert q_weight.numel() == 0 and attention.k_proj.weight.numel() == 0  # converted: storage freed
        assert fused.qkv_proj.weight.shape == (64 + 2 * 32, 64)
    assert attention.q_proj.weight is q_weight and q_weight.shape == (64, 64)


def test_dtype_and_requires_grad_follow_the_sources():
    model = _build(LlamaForCausalLM, {}).to(torch.bfloat16)
    attention = model.model.layers[0].self_attn
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        proj.weight.requires_grad_(False)
    snapshot = _snapshot(model)
    with get_recipe("llama-fused-qkv").patch(model):
        qkv = [layer.self_attn.qkv_proj.weight for layer in model.model.layers]
        assert [w.dtype for w in qkv] == [torch.bfloat16, torch.bfloat16]
        assert [w.requires_grad for w in qkv] == [False, True]  # layer 0: all sources frozen; layer 1: all train
    _assert_back(model, snapshot)
    assert [layer.self_attn.q_proj.weight.requires_grad for layer in model.model.layers] == [False, True]


def test_a_new_parameter_from_frozen_and_trainable_sources_is_refused_before_anything_changes():
    # /tmp/trial/frozen_q.py: the fused qkv_proj trained (any source trains), revert wrote it into the frozen q_proj
    model = _build(LlamaForCausalLM, {})
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.requires_grad_(False)
    snapshot = _snapshot(model)
    prefix = "model.layers.0.self_attn."
    message = (
        f"the new parameter '{prefix}qkv_proj.weight' is made from frozen \\['{prefix}q_proj.weight'\\] "
        f"\\(requires_grad=False\\) and trainable \\['{prefix}k_proj.weight', '{prefix}v_proj.weight'\\]"
    )
    with pytest.raises(InstancePatchError, match=message):
        get_recipe("llama-fused-qkv").patch(model)
    _assert_back(model, snapshot)
    assert [p.requires_grad for p in model.parameters()] == [
        not k.endswith("q_proj.weight") for k, _ in model.named_parameters()
    ]
    assert get_state(model) is None and ModelPatch.of(model) == []


def _train(model, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(INPUT_IDS, labels=INPUT_IDS).loss.backward()
        optimizer.step()
    model.eval()


def test_trained_fused_qkv_values_are_written_back_through_the_inverse_split():
    model = _build(LlamaForCausalLM, dict(attention_bias=True))
    originals = [layer.self_attn for layer in model.model.layers]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patch = get_recipe("llama-fused-qkv").patch(model)
    _train(model)
    with torch.no_grad():
        patched_logits = model(INPUT_IDS).logits
    fused = [
        (layer.self_attn.qkv_proj.weight.detach().clone(), layer.self_attn.qkv_proj.bias.detach().clone())
        for layer in model.model.layers
    ]
    patch.revert()
    for original, (weight, bias) in zip(originals, fused):
        # GQA: 64 query rows, 32 key rows, 32 value rows (not equal thirds)
        for name, rows in (("q_proj", slice(0, 64)), ("k_proj", slice(64, 96)), ("v_proj", slice(96, 128))):
            assert torch.equal(getattr(original, name).weight, weight[rows])
            assert torch.equal(getattr(original, name).bias, bias[rows])
    assert not torch.equal(
        model.model.layers[0].self_attn.q_proj.weight, before["model.layers.0.self_attn.q_proj.weight"]
    )
    with torch.no_grad():
        assert (model(INPUT_IDS).logits - patched_logits).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("model_cls", "recipe", "names"),
    [
        (Qwen3MoeForCausalLM, "qwen3_moe-linear-experts", ("gate_proj", "up_proj", "down_proj")),
        # Mixtral's recipe renames block_sparse_moe -> mlp as Transformers does: revert must rename again (it kept
        # the untrained tensors, with only a warning, before)
        (MixtralForCausalLM, "mixtral-linear-experts", ("w1", "w3", "w2")),
    ],
)
def test_trained_linear_experts_are_stacked_back_into_the_fused_parameters(model_cls, recipe, names, caplog):
    gate, up, down = names
    model = _build(model_cls, {})
    experts = [layer.mlp.experts for layer in model.model.layers]
    with caplog.at_level("WARNING", logger="modelpatch"):
        patch = get_recipe(recipe).patch(model)
    # every tensor moved exactly: no warning at all (the fused-layout alternatives of the rules used to be reported
    # as having "moved no tensor")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    _train(model)
    with torch.no_grad():
        patched_logits = model(INPUT_IDS).logits
        expected = [
            (
                torch.stack([torch.cat([getattr(e, gate).weight, getattr(e, up).weight]) for e in layer.mlp.experts]),
                torch.stack([getattr(e, down).weight for e in layer.mlp.experts]),
            )
            for layer in model.model.layers
        ]
    patch.revert()
    for module, (gate_up, down) in zip(experts, expected):
        assert module is not None and torch.equal(module.gate_up_proj, gate_up) and torch.equal(module.down_proj, down)
    assert [layer.mlp.experts for layer in model.model.layers] == experts
    with torch.no_grad():
        assert (model(INPUT_IDS).logits - patched_logits).abs().max().item() < 1e-5


def test_keep_original_reverts_by_pointer_swap_and_drops_training():
    model = _build(Qwen3MoeForCausalLM, {})
    snapshot = _snapshot(model)
    patch = get_recipe("qwen3_moe-linear-experts").patch(model, keep_original=True)
    assert snapshot[1]["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # not freed
    for name, param in model.named_parameters():
        param.requires_grad_(".mlp.experts." in name)  # train the replacements only
    _train(model)
    gate = model.model.layers[0].mlp.experts[0].gate_proj.weight
    assert not torch.equal(gate, snapshot[2]["model.layers.0.mlp.experts.gate_up_proj"][0, :32])  # it trained
    patch.revert()
    _assert_back(model, snapshot)


def test_exception_inside_the_block_reverts():
    model = _build(LlamaForCausalLM, {})
    snapshot = _snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        with get_recipe("llama-fused-qkv").patch(model) as patch:
            assert type(model.model.layers[0].self_attn) is FUSED_QKV_CLASSES["llama"]
            raise RuntimeError("boom")
    assert patch.reverted
    _assert_back(model, snapshot)


@pytest.mark.parametrize("order", ["first-patch-first", "last-patch-first"])
def test_two_patches_revert_in_either_order(order):
    model = _build(Qwen2MoeForCausalLM, {})
    snapshot = _snapshot(model)
    with torch.no_grad():
        before = model(INPUT_IDS).logits
    attention = get_recipe("qwen2_moe-fused-qkv").patch(model)
    experts = get_recipe("qwen2_moe-linear-experts").patch(model)
    assert [type(r).__name__ for r in (attention, experts)] == ["ModelPatch", "ModelPatch"]
    assert len(modelpatch.patch_report(model).rows) == 4
    rules = get_state(model).rules
    assert [r.target_patterns for r in rules] == [["self_attn.qkv_proj"]]  # the fused-QKV rule, bound for saving
    with torch.no_grad():
        assert (model(INPUT_IDS).logits - before).abs().max().item() < 1e-5
    first, second = (attention, experts) if order == "first-patch-first" else (experts, attention)
    first.revert()
    assert len(modelpatch.patch_report(model).rows) == 2
    with torch.no_grad():
        assert (model(INPUT_IDS).logits - before).abs().max().item() < 1e-5
    second.revert()
    _assert_back(model, snapshot)
    assert get_state(model) is None


@pytest.mark.parametrize(
    "model_cls, recipe",
    [
        (LlamaForCausalLM, "llama-fused-qkv"),
        (Qwen3MoeForCausalLM, "qwen3_moe-linear-experts"),
        (MixtralForCausalLM, "mixtral-linear-experts"),
        (Qwen2MoeForCausalLM, "qwen2_moe-full-example"),
    ],
)
def test_saved_patched_instance_loads_plainly_with_the_original_weights(tmp_path, model_cls, recipe):
    model = _build(model_cls, {})
    values = {k: v.clone() for k, v in model.state_dict().items()}
    with get_recipe(recipe).patch(model):
        model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    state = loaded.state_dict()
    assert type(loaded) is model_cls and state.keys() == values.keys()
    assert all(torch.equal(state[k], values[k]) for k in values)


def test_routing_record_and_replay_on_a_patched_instance():
    model = _build(Qwen3MoeForCausalLM, {})
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(model) as unpatched:
        model(ids)
    with get_recipe("qwen3_moe-linear-experts").patch(model):
        with torch.no_grad(), record_routing(model) as trace:
            model(ids)
        assert all(torch.equal(torch.cat(trace[layer]), torch.cat(unpatched[layer])) for layer in (0, 1))
        perturb_routers(model)
        with torch.no_grad(), ExpertsObserver(model) as natural:
            model(ids)
        assert any(not torch.equal(natural.indices(layer), torch.cat(trace[layer])) for layer in (0, 1))
        model.train()
        with ExpertsObserver(model) as seen, replay_routing(model, trace):
            model(ids, labels=ids).loss.backward()
        for layer in (0, 1):
            assert type(model.model.layers[layer].mlp.experts) is LINEAR_EXPERTS_CLASSES["qwen3_moe"]
            assert torch.equal(seen.calls[layer][-1][0], torch.cat(trace[layer]))
        assert float(model.model.layers[0].mlp.gate.weight.grad.abs().sum()) > 0


def test_quantize_after_patch_quantizes_every_expert_linear():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = _build(Qwen3MoeForCausalLM, {})
    with torch.no_grad():
        before = model(INPUT_IDS).logits
    patch = get_recipe("qwen3_moe-linear-experts").patch(model)
    quantize_(model, Int8WeightOnlyConfig())
    experts = [m for path, m in model.named_modules() if isinstance(m, nn.Linear) and ".mlp.experts." in f"{path}."]
    assert len(experts) == 2 * 4 * 3  # layers * experts * (gate, up, down)
    assert all(type(m.weight).__name__ == "Int8Tensor" for m in experts)
    with torch.no_grad():
        assert (model(INPUT_IDS).logits - before).abs().max().item() < 0.05  # int8 weights: close, not exact
    with pytest.raises(modelpatch.ConversionError, match="aten.stack"):
        patch.revert()  # quantized weights cannot be stacked back into the fused layout
    assert not patch.reverted


def test_update_optimizer_follows_the_key_map_both_ways():
    model = _build(LlamaForCausalLM, {})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(INPUT_IDS, labels=INPUT_IDS).loss.backward()
    optimizer.step()
    o_proj = model.model.layers[0].self_attn.o_proj.weight
    patch = get_recipe("llama-fused-qkv").patch(model)
    assert patch.update_optimizer(optimizer) == 2 * 3  # q, k, v of each layer -> one qkv_proj
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert o_proj in optimizer.state  # handed over unchanged: keeps its Adam moments
    patch.revert()
    assert patch.update_optimizer(optimizer) == 2
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}


def _group_ids(optimizer):
    return [[id(p) for p in group["params"]] for group in optimizer.param_groups]


def test_update_optimizer_refuses_sources_in_two_groups_and_accepts_them_in_one():
    # /tmp/trial/opt_groups.py: q/k in a group with lr 0.1, v with lr 0.05 -> qkv_proj was in both, stepped twice
    model = _build(LlamaForCausalLM, {})
    attention = model.model.layers[0].self_attn
    qk, v = [attention.q_proj.weight, attention.k_proj.weight], [attention.v_proj.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in qk + v)]
    optimizer = torch.optim.SGD([{"params": qk, "lr": 0.1}, {"params": v, "lr": 0.05}, {"params": rest}], lr=0.0)
    before = _group_ids(optimizer)
    patch = get_recipe("llama-fused-qkv").patch(model)
    prefix = "model.layers.0.self_attn."
    message = (
        f"cannot place '{prefix}qkv_proj.weight': its sources sit in different parameter groups \\('{prefix}q_proj"
        f".weight' in group 0 \\(lr=0.1, .*'{prefix}v_proj.weight' in group 1 \\(lr=0.05, .*Put \\['{prefix}"
        f"q_proj.weight', '{prefix}k_proj.weight', '{prefix}v_proj.weight'\\] in one parameter group, or build the "
        "optimizer after patching"
    )
    with pytest.raises(OptimizerGroupError, match=message):
        patch.update_optimizer(optimizer)
    assert _group_ids(optimizer) == before  # unchanged
    patch.revert()

    # the same sources in one group: qkv_proj goes into that group only
    optimizer = torch.optim.SGD([{"params": qk + v, "lr": 0.1}, {"params": rest}], lr=0.0)
    patch = get_recipe("llama-fused-qkv").patch(model)
    assert patch.update_optimizer(optimizer) == 2 * 3
    assert _group_ids(optimizer)[0] == [id(model.model.layers[0].self_attn.qkv_proj.weight)]
    assert sorted(sum(_group_ids(optimizer), [])) == sorted(id(p) for p in model.parameters())
    patch.revert()
    assert patch.update_optimizer(optimizer) == 2
    assert _group_ids(optimizer)[0] == [id(p) for p in qk + v]
    assert sorted(sum(_group_ids(optimizer), [])) == sorted(id(p) for p in model.parameters())


def test_update_optimizer_after_revert_refuses_one_parameter_from_two_groups():
    # the reverse mapping: one fused experts parameter comes back from per-expert parameters in two groups
    model = _build(Qwen3MoeForCausalLM, {})
    patch = get_recipe("qwen3_moe-linear-experts").patch(model)
    names = dict(model.named_parameters())
    first = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert first in names
    rest = [p for k, p in names.items() if k != first]
    optimizer = torch.optim.SGD([{"params": [names[first]], "lr": 0.1}, {"params": rest, "lr": 0.2}])
    patch.revert()
    before = _group_ids(optimizer)
    message = (
        "cannot place 'model.layers.0.mlp.experts.gate_up_proj': its sources sit in different parameter groups "
        f"\\('{first}' in group 0 \\(lr=0.1, .*'model.layers.0.mlp.experts.0.up_proj.weight' in group 1 \\(lr=0.2"
    )
    with pytest.raises(OptimizerGroupError, match=message):
        patch.update_optimizer(optimizer)
    assert _group_ids(optimizer) == before


class NormFromModule(nn.Module):
    """A replacement that cannot be built with ``LlamaRMSNorm``'s arguments, but says how to build it."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @classmethod
    def from_module(cls, original):
        return cls(original.weight.shape[0], original.variance_epsilon)

    def forward(self, hidden):
        variance = hidden.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden.float() * torch.rsqrt(variance + self.eps)).to(hidden.dtype)


class NormWithoutFromModule(NormFromModule):
    from_module = None  # type: ignore[assignment]


def test_from_module_builds_the_replacement_and_an_unrecoverable_argument_is_named():
    model = _build(LlamaForCausalLM, {})
    snapshot = _snapshot(model)
    with pytest.raises(InstancePatchError, match=r"'hidden_size' of LlamaRMSNorm.__init__.*from_module"):
        patch_model(model, {"LlamaRMSNorm": NormWithoutFromModule})
    _assert_back(model, snapshot)
    with torch.no_grad():
        before = model(INPUT_IDS).logits
    weight = model.model.norm.weight
    with patch_model(model, {"LlamaRMSNorm": NormFromModule}) as patch:
        assert len(patch.report) == 2 * 2 + 1
        assert type(model.model.norm) is NormFromModule and model.model.norm.weight is weight
        assert model.model.norm.eps == model.config.rms_norm_eps
        with torch.no_grad():
            assert (model(INPUT_IDS).logits - before).abs().max().item() < 1e-5
    _assert_back(model, snapshot)
    assert type(model.model.norm) is LlamaRMSNorm


def test_already_replaced_modules_are_refused():
    model = _build(LlamaForCausalLM, {})
    with get_recipe("llama-fused-qkv").patch(model):
        with pytest.raises(InstancePatchError, match=r"already a replacement .*by patch_model"):
            get_recipe("llama-fused-qkv").patch(model)
    with apply_patches({"LlamaAttention": FUSED_QKV_CLASSES["llama"]}):
        built = LlamaForCausalLM(tiny_llama_config())
    with pytest.raises(InstancePatchError, match="'model.layers.0.self_attn' is already a replacement"):
        patch_model(built, {"LlamaAttention": FUSED_QKV_CLASSES["llama"]})


@pytest.mark.slow  # importing peft takes ~3 s
def test_peft_models_are_refused_with_the_supported_order():
    from peft import LoraConfig, get_peft_model

    model = _build(LlamaForCausalLM, {})
    peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], r=2))
    with pytest.raises(InstancePatchError, match="PEFT model.*before get_peft_model"):
        get_recipe("llama-fused-qkv").patch(peft_model)
    with pytest.raises(InstancePatchError, match="PEFT adapter layer.*base_layer"):
        get_recipe("llama-fused-qkv").patch(peft_model.base_model.model)
    assert type(peft_model.base_model.model.model.layers[0].self_attn) is LlamaAttention


def test_accelerate_hooks_are_kept_on_parents_and_refused_on_replaced_modules():
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = _build(LlamaForCausalLM, {})
    layer = model.model.layers[0]
    add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    with torch.no_grad():
        before = model(INPUT_IDS).logits
    with get_recipe("llama-fused-qkv").patch(model):
        assert isinstance(layer._hf_hook, AlignDevicesHook)  # the parent keeps its hook
        with torch.no_grad():
            assert (model(INPUT_IDS).logits - before).abs().max().item() < 1e-5
    add_hook_to_module(model.model.layers[1].self_attn.q_proj, AlignDevicesHook(execution_device="cpu"))
    snapshot = _snapshot(model)
    with pytest.raises(InstancePatchError, match=r"'model.layers.1.self_attn.q_proj' carries an accelerate hook"):
        get_recipe("llama-fused-qkv").patch(model)
    _assert_back(model, snapshot)


class ScaledAttention(LlamaAttention):
    """Llama attention with one new parameter no rule provides (its ``__init__`` value, 1, keeps outputs equal)."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, *args, **kwargs):
        output, weights = super().forward(*args, **kwargs)
        return output * self.scale, weights


def test_strict_unmatched_key_leftover_tensors_and_missing_tensors(caplog):
    model = _build(LlamaForCausalLM, {})
    snapshot = _snapshot(model)
    with pytest.raises(UnmatchedPatchKeyError, match="'LlamaAtention'.*did you mean 'LlamaAttention'"):
        patch_model(model, {"LlamaAtention": FUSED_QKV_CLASSES["llama"]}, strict=True)
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        empty = patch_model(model, {"LlamaAtention": FUSED_QKV_CLASSES["llama"]})
    assert isinstance(empty, ModelPatch) and len(empty) == 0 and "LlamaAtention" in caplog.text
    # no rule: q/k/v would be dropped (an unexpected key at load), whatever strict says
    with pytest.raises(modelpatch.ConversionError, match=r"produced 'model.layers.0.self_attn.q_proj.weight'.*not a"):
        patch_model(model, {"LlamaAttention": FUSED_QKV_CLASSES["llama"]})
    with pytest.raises(modelpatch.ConversionError, match=r"not provided by the conversion rules \(\['scale'\]\)"):
        patch_model(model, {"LlamaAttention": ScaledAttention}, strict=True)
    _assert_back(model, snapshot)


def test_replacement_only_tensors_get_init_values_and_are_dropped_on_revert(caplog):
    model = _build(LlamaForCausalLM, {})
    snapshot = _snapshot(model)
    with torch.no_grad():
        before = model(INPUT_IDS).logits
    q_weight = model.model.layers[0].self_attn.q_proj.weight
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        patch = patch_model(model, {"LlamaAttention": ScaledAttention})
    assert "not provided by the conversion rules (['scale'])" in caplog.text
    attention = model.model.layers[0].self_attn
    assert type(attention) is ScaledAttention and attention.q_proj.weight is q_weight
    assert torch.equal(attention.scale, torch.ones(1))
    with torch.no_grad():
        assert torch.equal(model(INPUT_IDS).logits, before)
    _train(model)
    trained = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    patch.revert()
    assert model.model.layers[0].self_attn is snapshot[0]["model.layers.0.self_attn"]
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, trained)  # the trained values, same object
    assert model.model.layers[0].self_attn.q_proj.weight is q_weight


class NormScaled(NormFromModule):
    """Stores its weight under another name (``scale``): a rule moves ``weight`` there one way only."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps)
        self.scale = self.weight
        del self.weight

    def forward(self, hidden):
        variance = hidden.float().pow(2).mean(-1, keepdim=True)
        return self.scale * (hidden.float() * torch.rsqrt(variance + self.eps)).to(hidden.dtype)


class _OneWay(modelpatch.conversion.ops._tcml.ConversionOps):
    """An operation without an inverse (its reverse cannot be built)."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        ((_, tensors),) = input_dict.items()
        return {target_patterns[0]: tensors[0] if isinstance(tensors, list) else tensors}

    @property
    def reverse_op(self):
        raise NotImplementedError("no inverse")


def test_a_module_whose_tensors_cannot_be_moved_back_is_refused_unless_keep_original():
    model = _build(LlamaForCausalLM, {})
    snapshot = _snapshot(model)
    names = ("input_layernorm", "post_attention_layernorm", "model.norm")
    rules = {"llama": [modelpatch.WeightConverter(f"{n}.weight", f"{n}.scale", [_OneWay()]) for n in names]}
    with pytest.raises(
        InstancePatchError,
        match=r"'model.layers.0.input_layernorm'.*do not give LlamaRMSNorm's tensors back.*keep_original",
    ):
        patch_model(model, {"^LlamaRMSNorm$": NormScaled}, conversion_rules=rules)
    _assert_back(model, snapshot)  # nothing changed
    with torch.no_grad():
        before = model(INPUT_IDS).logits
    with patch_model(model, {"^LlamaRMSNorm$": NormScaled}, conversion_rules=rules, keep_original=True):
        assert type(model.model.norm) is NormScaled
        with torch.no_grad():
            assert (model(INPUT_IDS).logits - before).abs().max().item() < 1e-5
    _assert_back(model, snapshot)


def _deepcopy(model):
    return copy.deepcopy(model)


def _pickle_round_trip(model):
    return pickle.loads(pickle.dumps(model))


def _torch_save_round_trip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPY_CASES = [
    ("llama-gqa", LlamaForCausalLM, "llama-fused-qkv"),
    ("qwen2_moe", Qwen2MoeForCausalLM, "qwen2_moe-linear-experts"),
]
COPIERS = [_deepcopy, _pickle_round_trip, _torch_save_round_trip]


def _values(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_values(model, values):
    state = model.state_dict()
    assert state.keys() == values.keys()
    assert all(torch.equal(state[k], values[k]) for k in values)


@pytest.mark.parametrize("copier", COPIERS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("case", COPY_CASES, ids=[c[0] for c in COPY_CASES])
def test_a_copy_of_a_patched_model_is_patched_and_reverts_on_its_own(case, copier):
    # /tmp/trial/deepcopy_patched.py: deepcopy failed on the UndoStack's lock, pickle / torch.save on Swap's weakrefs
    _, model_cls, recipe = case
    model = _build(model_cls, {})
    unpatched = _values(model)
    patch = get_recipe(recipe).patch(model)
    torch.manual_seed(1)
    with torch.no_grad():  # "trained" while patched: revert must carry these values back
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    patched = _values(model)
    copied = copier(model)
    [copied_patch] = ModelPatch.of(copied)
    assert copied_patch is not patch and copied_patch.model is copied
    assert ModelPatch.of(model) == [patch]
    assert [r.path for r in copied_patch.report] == [r.path for r in patch.report]
    originals = {id(p) for p in model.parameters()}
    assert not any(id(p) in originals for p in copied.parameters())

    copied_patch.revert()  # the copy reverts; the original stays patched, its values untouched
    assert copied_patch.reverted and not patch.reverted
    _assert_values(model, patched)
    assert ModelPatch.of(copied) == [] and get_state(copied) is None
    assert copied.state_dict().keys() == unpatched.keys()

    patch.revert()  # the same values come back on both
    _assert_values(copied, _values(model))
    assert not any(torch.equal(_values(model)[k], unpatched[k]) for k in unpatched if "layers.0" in k)


def test_a_deepcopy_reverted_after_the_original_and_its_own_optimizer():
    model = _build(LlamaForCausalLM, {})
    patch = get_recipe("llama-fused-qkv").patch(model)
    copied = copy.deepcopy(model)
    [copied_patch] = ModelPatch.of(copied)
    copied_values = _values(copied)
    optimizer = torch.optim.SGD(copied.parameters(), lr=0.1)
    patch.revert()
    _assert_values(copied, copied_values)  # the copy is still patched, unchanged
    assert type(copied.model.layers[0].self_attn) is FUSED_QKV_CLASSES["llama"]
    copied_patch.revert()
    assert copied_patch.update_optimizer(optimizer) == 2  # each qkv_proj back to the copy's q, k, v
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in copied.parameters()]
    _assert_values(copied, _values(model))


def test_revert_after_peft_wrapped_layers_of_the_replacement_is_refused_and_changes_nothing():
    # /tmp/trial/peft_revert.py: revert raised a ConversionError about Chunk(dim=0) and a '...base_layer' key
    from peft import LoraConfig, get_peft_model

    model = _build(LlamaForCausalLM, {})
    patch = get_recipe("llama-fused-qkv").patch(model)
    peft_model = get_peft_model(model, LoraConfig(target_modules=["qkv_proj", "o_proj"], r=2, init_lora_weights=False))
    before = _values(model)
    attentions = [layer.self_attn for layer in model.model.layers]
    prefix = "model.layers.0.self_attn."
    message = (
        f"cannot revert: the tensors of '{prefix[:-1]}' \\(FusedQKVLlamaAttention\\) are no longer the ones "
        f"patch_model put there: unexpected keys \\['{prefix}o_proj.base_layer.weight', .*missing keys \\['{prefix}"
        f"o_proj.weight', '{prefix}qkv_proj.weight'\\]; PEFT adapters wrap its layers: call merge_and_unload\\(\\)"
    )
    with pytest.raises(modelpatch.ModelpatchError, match=message) as info:
        patch.revert()
    assert type(info.value) is modelpatch.errors.ModelpatchRuntimeError
    assert not patch.reverted and ModelPatch.of(model) == [patch]
    assert [layer.self_attn for layer in model.model.layers] == attentions
    _assert_values(model, before)

    merged = peft_model.merge_and_unload()  # the way out: the adapters merged into qkv_proj, then revert
    assert merged is model
    qkv = model.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    patch.revert()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, qkv[: q.shape[0]])
