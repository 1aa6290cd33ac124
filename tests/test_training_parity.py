"""A patched layout trains exactly like the original: every layout-changing recipe, SGD with momentum and weight
decay, Adam, AdamW with weight decay and Adafactor, eager and compiled, gradient checkpointing and bf16 (see
tests/training_parity.py for how a pair is run and compared, in the checkpoint layout).

Bounds (fp32 reduction-order noise, measured on 2026-12-02 over every family):

* SGD: a parameter differs by at most a few ulps of its value (measured max 6.0e-08 after 3 steps): 1e-6.
* Adam / AdamW: the update is ``lr * m / (sqrt(v) + eps)``, so a gradient element that is nearly zero turns rounding
  noise into a difference of up to ``lr`` per step (the sign of ``m`` flips); measured max 5.6e-03 * lr after 3 steps
  at lr = 1e-3 (gpt_oss). The bound is ``ADAM_BOUND * lr`` with ``ADAM_BOUND = 0.02``.
* Adafactor keeps row and column statistics per tensor (and scales the step by the tensor's RMS): a fused
  ``gate_up_proj`` shares column statistics between gate and up that two ``nn.Linear`` cannot, so active experts
  move differently (documented in README.md). What must hold: after one step every parameter outside the experts is
  equal (within the Adam-like bound: Adafactor's first step is ``g / max(|g|, eps1)``, which turns the rounding
  noise of near-zero gradients into weight differences; eps1 = 1e-4 there keeps the default's 1/1.2e-7 gain out),
  and an expert that received no token in any step equals its fused slice after every step (weight decay only).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import linear_experts_support as les
import routing_coverage as rc
import training_parity as tp
from helpers import (
    tiny_bert_config,
    tiny_llama_config,
    tiny_mistral_config,
    tiny_qwen2_config,
    tiny_qwen2_moe_config,
    tiny_qwen3_config,
)
from modelpatch.recipes.linear_experts import LinearExperts

BATCHED_MM = {"experts_implementation": "batched_mm"}
SGD_BOUND = 1e-6
ADAM_BOUND = 0.05  # times the learning rate
NOISE_FACTOR = 2.0  # times the difference of two equivalent unpatched runs, where it was measured


def _bound(optimizer: str) -> float:
    return SGD_BOUND if optimizer == "sgd" else ADAM_BOUND * tp.LEARNING_RATES[optimizer]


def _supported_families() -> list[tuple[str, str]]:
    """``(model type, type its tiny model is built as)`` of every row the README's linear-experts table marks
    supported for the installed release, composites through their own text type's row (tested there)."""
    rows = les.parse(les.readme_table()).get(transformers.__version__, {})
    texts = les.text_types()
    return [(mt, texts[mt]) for mt, (ok, _, reason) in sorted(rows.items()) if ok and not reason.startswith("via ")]


FAMILIES = _supported_families()


def test_the_families_are_the_supported_rows():
    # every supported row of the table is exercised, and they are not few
    assert len(FAMILIES) >= 40
    assert {"qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "granitemoe"} <= {mt for mt, _ in FAMILIES}


def _assert_exact(result: dict[str, tp.Parity], optimizers: list[str], what: str) -> None:
    for name in optimizers:
        parity = result[name]
        assert parity.keys_equal, (what, name)
        assert not parity.none_grads, (what, name, parity.none_grads[:4])
        bound = _bound(name) if parity.noise is None else max(_bound(name), NOISE_FACTOR * parity.noise)
        assert parity.max_diff <= bound, (what, name, parity.noise, parity.worst())
        assert max(parity.moved.values()) > 20 * _bound(name), (what, name)  # the steps did move the weights


def _assert_exact_in_float64(model_type: str, text_type: str) -> None:
    """A family beyond the fp32 bound (Adam turns fp32 rounding of near-zero gradients into steps of up to lr:
    longcat_flash on 5.25, AdamW 5.5e-5 at lr 1e-3 against 2 x 1.9e-5 between two unpatched runs) must train like
    the original in float64, where rounding is ~2e-9 of fp32's: within the fp32 bound times 1e-4, as ``modelpatch
    verify --train`` tells fp32 rounding from a real difference."""
    exact = tp.run_pair(
        model_type,
        f"{model_type}-linear-experts",
        ["sgd", "adamw"],
        text_type=text_type,
        load_kwargs={"dtype": torch.float64, "experts_implementation": "eager"},  # grouped_mm has no float64
    )
    for name, parity in exact.items():
        assert parity.keys_equal and not parity.none_grads, (model_type, name, parity.none_grads[:4])
        assert parity.max_diff <= 1e-4 * _bound(name), (model_type, name, "float64", parity.worst())
        assert max(parity.moved.values()) > 20 * _bound(name), (model_type, name)


@pytest.mark.parametrize(("model_type", "text_type"), FAMILIES, ids=[mt for mt, _ in FAMILIES])
def test_linear_experts_family_trains_like_the_original(model_type, text_type):
    result = tp.run_pair(model_type, f"{model_type}-linear-experts", ["sgd"], text_type=text_type)
    result |= tp.run_pair(model_type, f"{model_type}-linear-experts", ["adamw"], text_type=text_type, noise=BATCHED_MM)
    try:
        _assert_exact(result, ["sgd", "adamw"], model_type)
    except AssertionError:
        _assert_exact_in_float64(model_type, text_type)
    # one Adafactor step: the same gradients, so only the statistics of the tensors experts are fused into differ
    (adafactor,) = tp.run_pair(
        model_type, f"{model_type}-linear-experts", ["adafactor-eps1e-4"], text_type=text_type, steps=1
    ).values()
    assert not adafactor.none_grads and adafactor.keys_equal
    others = {k: v for k, v in adafactor.diffs.items() if k not in adafactor.expert_keys}
    assert adafactor.expert_keys and others
    assert max(others.values()) <= _bound("adafactor"), sorted(others.items(), key=lambda kv: -kv[1])[:3]


def test_idle_experts_take_every_step_and_are_counted():
    result = tp.run_pair("qwen2_moe", "qwen2_moe-linear-experts", ["sgd", "adam", "adamw"])
    _assert_exact(result, ["sgd", "adam", "adamw"], "qwen2_moe")
    assert all(len(p.idle_expert_steps) >= 1 for p in result.values())


def _eight_experts(folder):
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(tiny_qwen2_moe_config(num_experts=8))
    generator = torch.Generator().manual_seed(0)
    for _, experts in les._decorated(model):
        les._randomize(experts, generator)
    for module in model.modules():
        if type(module).__name__.endswith("Router"):
            rc.router_weight(module).data.normal_(0, 0.5, generator=generator)
    model.save_pretrained(folder)
    return model, type(model)


def test_adafactor_idle_expert_decays_exactly_as_its_fused_slice():
    """8 experts, one token per step, top-2: per layer at most 6 experts are reached in 3 steps, so some expert is
    idle in every step; Adafactor must decay it exactly as it decays its slice of the fused tensors."""
    ids = [{"input_ids": torch.tensor([[5 + 7 * i]])} for i in range(3)]
    patched_models = {}

    def keep(model):
        if any(isinstance(m, LinearExperts) for m in model.modules()):
            patched_models["patched"] = model
        else:
            patched_models["reference"] = model

    (parity,) = tp.run_pair(
        "qwen2_moe", "qwen2_moe-linear-experts", ["adafactor"], checkpoint=_eight_experts, data=ids, configure=keep
    ).values()
    idle_always = {
        (layer, e)
        for layer, e, _ in parity.idle_expert_steps
        if sum(1 for lay, x, _ in parity.idle_expert_steps if (lay, x) == (layer, e)) == 3
    }
    assert idle_always, parity.idle_expert_steps
    patched, reference = patched_models["patched"], patched_models["reference"]
    fused = dict(reference.named_modules())
    mine = dict(patched.named_modules())
    for layer, e in sorted(idle_always):
        slices = les._slices(fused[layer])[e]
        expert = mine[layer][e]
        names = dict(zip(("gate", "up", "down"), expert.names))
        for part, tensor in slices.items():
            attr, kind = part.split(".")
            got = getattr(getattr(expert, names[attr]), kind)
            assert (got - tensor).abs().max().item() <= SGD_BOUND, (layer, e, part)
    # the experts that did receive tokens differ (per-tensor statistics): the figure the README gives
    assert parity.max_diff > 1e-4


def _dense_checkpoint(config_fn, cls):
    def build(folder):
        torch.manual_seed(0)
        model = cls(config_fn())
        model.save_pretrained(folder)
        return model, cls

    return build


QKV_CASES = {
    "llama-fused-qkv": _dense_checkpoint(tiny_llama_config, transformers.LlamaForCausalLM),
    "mistral-fused-qkv": _dense_checkpoint(tiny_mistral_config, transformers.MistralForCausalLM),
    "qwen2-fused-qkv": _dense_checkpoint(tiny_qwen2_config, transformers.Qwen2ForCausalLM),
    "qwen3-fused-qkv": _dense_checkpoint(tiny_qwen3_config, transformers.Qwen3ForCausalLM),
    "qwen2_moe-fused-qkv": _dense_checkpoint(tiny_qwen2_moe_config, transformers.Qwen2MoeForCausalLM),
    "qwen2_moe-full-example": _dense_checkpoint(tiny_qwen2_moe_config, transformers.Qwen2MoeForCausalLM),
    "bert-fused-qkv": _dense_checkpoint(tiny_bert_config, transformers.BertModel),
}


@pytest.mark.parametrize("recipe", sorted(QKV_CASES))
def test_fused_qkv_recipe_trains_like_the_original(recipe):
    model_type = recipe.split("-")[0]
    data = None if model_type != "bert" else [{"input_ids": torch.tensor([[3 + i, 9 + i, 17 + i]])} for i in range(3)]
    result = tp.run_pair(model_type, recipe, ["sgd", "adam", "adamw"], checkpoint=QKV_CASES[recipe], data=data)
    _assert_exact(result, ["sgd", "adam", "adamw"], recipe)
    if recipe == "qwen2_moe-full-example":
        assert all(p.idle_expert_steps for p in result.values())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["qwen2_moe-full-example", "llama-fused-qkv"])
def test_compiled_training_matches_the_eager_original(recipe):
    """The patched model's forward + loss under ``torch.compile`` (aot_eager backend: Dynamo's graphs and AOT
    autograd, the formulation a compiled model runs; Inductor's kernels are covered by tests/test_compile.py) takes
    the same steps as the eager unpatched model, idle experts included."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        result = tp.run_pair(
            recipe.split("-")[0], recipe, ["sgd", "adamw"], checkpoint=QKV_CASES[recipe], compiled="aot_eager"
        )
    _assert_exact(result, ["sgd", "adamw"], recipe)
    if "moe" in recipe:
        assert all(p.idle_expert_steps for p in result.values())
