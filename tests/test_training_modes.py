"""Training parity under the modes users train in: gradient checkpointing (reentrant and non-reentrant), bf16
(CPU autocast, and bf16 weights), and LoRA on the per-expert modules against PEFT's LoRA on the fused parameters
(``target_parameters``). See tests/training_parity.py for how a pair is run and compared (checkpoint layout).

Bounds:

* gradient checkpointing recomputes the same fp32 forward: the fp32 bounds of tests/test_training_parity.py.
* bf16: the patched model and the unpatched one must be no further apart than two equivalent unpatched runs (eager
  against ``experts_implementation="batched_mm"`` / ``attn_implementation="sdpa"``). Measured (2026-12-03, 3 steps,
  as ``||patched - unpatched|| / ||unpatched - start||`` per tensor, the largest): see ``BF16_RELATIVE_FLOOR``; the
  max abs difference is no use there (a bf16 rounding flips the sign of near-zero gradients, and Adam turns that
  into a full ``lr`` step on that element, in both comparisons alike).
* LoRA: the per-expert adapters start as the fused adapter's slices (same ``A``, ``B = 0``) and train to the same
  values (SGD bound 1e-6, AdamW 0.05 x lr).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import transformers

import training_parity as tp
from helpers import tiny_qwen2_moe_config
from modelpatch.recipes import get_recipe
from modelpatch.recipes.linear_experts import LinearExperts
from test_training_parity import BATCHED_MM, NOISE_FACTOR, QKV_CASES, _assert_exact, _bound

CASES = {
    "qwen2_moe-linear-experts": QKV_CASES["qwen2_moe-full-example"],  # a tiny qwen2_moe checkpoint
    "qwen2_moe-full-example": QKV_CASES["qwen2_moe-full-example"],
    "llama-fused-qkv": QKV_CASES["llama-fused-qkv"],
}
NOISE = {"qwen2_moe": BATCHED_MM | {"attn_implementation": "sdpa"}, "llama": {"attn_implementation": "sdpa"}}
BF16_RELATIVE_FLOOR = 0.05
"""The smallest relative bound of a bf16 comparison (5% of the update), for pairs whose unpatched noise is lower."""


def _checkpointing(reentrant: bool):
    def configure(model: torch.nn.Module) -> None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        model.config.use_cache = False

    return configure


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("recipe", sorted(CASES))
def test_gradient_checkpointing_keeps_parity(recipe, reentrant):
    model_type = recipe.split("-")[0]
    result = tp.run_pair(
        model_type, recipe, ["sgd", "adamw"], checkpoint=CASES[recipe], configure=_checkpointing(reentrant)
    )
    _assert_exact(result, ["sgd", "adamw"], f"{recipe} checkpointing reentrant={reentrant}")
    if "moe" in recipe:
        assert all(p.idle_expert_steps for p in result.values()), "no idle expert: the case tests nothing"


BF16_MODES = {"autocast": dict(autocast=torch.bfloat16), "weights": dict(load_kwargs={"dtype": torch.bfloat16})}


@pytest.mark.parametrize("mode", sorted(BF16_MODES))
@pytest.mark.parametrize("recipe", ["qwen2_moe-full-example", "llama-fused-qkv"])
def test_bf16_keeps_parity(recipe, mode):
    model_type = recipe.split("-")[0]
    result = tp.run_pair(
        model_type, recipe, ["sgd", "adamw"], checkpoint=CASES[recipe], noise=NOISE[model_type], **BF16_MODES[mode]
    )
    for name, parity in result.items():
        what = (recipe, mode, name)
        assert parity.keys_equal and not parity.none_grads, what
        assert parity.noise_relative is not None
        worst = max(parity.relative.items(), key=lambda kv: kv[1])
        assert worst[1] <= max(BF16_RELATIVE_FLOOR, NOISE_FACTOR * parity.noise_relative), (
            what,
            worst,
            parity.noise_relative,
        )
        assert max(parity.moved.values()) > 0.5 * tp.LEARNING_RATES[name], what  # the steps did move the weights
    if "moe" in recipe:
        assert all(p.idle_expert_steps for p in result.values())


# LoRA on the per-expert down_proj modules against PEFT's LoRA on the fused down_proj parameter


def _lora_pair(rank: int = 4):
    from peft import LoraConfig, get_peft_model

    checkpoint = CASES["qwen2_moe-linear-experts"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        _, cls = checkpoint(folder)
        fused = tp.load(cls, folder, None)
        split = tp.load(cls, folder, "qwen2_moe-linear-experts")
    fused = get_peft_model(
        fused, LoraConfig(r=rank, lora_alpha=8, target_modules=[], target_parameters=["mlp.experts.down_proj"])
    )
    split = get_peft_model(split, LoraConfig(r=rank, lora_alpha=8, target_modules=r".*mlp\.experts\.\d+\.down_proj"))
    return fused, split


def _fused_adapters(model) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """``{layer path: (A (E*r, I), B (H, E*r), E)}`` of PEFT's ParamWrapper on each fused down_proj."""
    out = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            path = name.split(".mlp.experts")[0]
            out[path] = (module.lora_A["default"].weight, module.lora_B["default"].weight, module.num_experts)
    return out


def _expert_adapters(model) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearExperts):
            out[name.split(".mlp.experts")[0]] = [
                (e.down_proj.lora_A["default"].weight, e.down_proj.lora_B["default"].weight) for e in module
            ]
    return out


def _slice(a: torch.Tensor, b: torch.Tensor, experts: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s factors of PEFT's stacked ones: ``A.reshape(E, r, I)[e]`` and ``B.reshape(H, r, E)[:, :, e]``
    (peft/tuners/lora/layer.py ``ParamWrapper.get_delta_weight``)."""
    return a.reshape(experts, -1, a.shape[-1])[e], b.reshape(b.shape[0], -1, experts)[:, :, e]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_lora_on_expert_modules_trains_like_lora_on_fused_parameters(optimizer):
    fused, split = _lora_pair()
    fa, ea = _fused_adapters(fused), _expert_adapters(split)
    assert sorted(fa) == sorted(ea) and fa
    with torch.no_grad():  # the same start: each expert's A is its slice of the fused A (B starts at zero in both)
        for path, (a, b, experts) in fa.items():
            for e, (ea_e, eb_e) in enumerate(ea[path]):
                sa, sb = _slice(a, b, experts, e)
                assert ea_e.shape == sa.shape and eb_e.shape == sb.shape, (path, e)
                ea_e.copy_(sa)
                eb_e.copy_(sb)
    data = tp.batches("qwen2_moe", split, 3)
    lr = tp.LEARNING_RATES[optimizer]
    trainable = [[p for p in m.parameters() if p.requires_grad] for m in (fused, split)]
    assert len(trainable[0]) == 2 * len(fa) and len(trainable[1]) == 2 * sum(len(v) for v in ea.values())
    parity = tp.Parity()
    tp.train(fused, tp.OPTIMIZERS[optimizer](trainable[0], lr), data)
    tp.train(split, tp.OPTIMIZERS[optimizer](trainable[1], lr), data, parity=parity)
    assert not [n for n in parity.none_grads if "lora" in n], parity.none_grads[:4]
    assert parity.idle_expert_steps, "no idle expert: the case tests nothing"
    worst, moved = 0.0, 0.0
    for path, (a, b, experts) in fa.items():
        for e, (ea_e, eb_e) in enumerate(ea[path]):
            sa, sb = _slice(a, b, experts, e)
            worst = max(worst, (ea_e - sa).abs().max().item(), (eb_e - sb).abs().max().item())
            moved = max(moved, sb.abs().max().item())
    assert worst <= _bound(optimizer), worst
    assert moved > 20 * _bound(optimizer)  # B left zero: the steps trained the adapters


def test_idle_expert_gradients_are_zero_tensors_under_checkpointing_and_lora():
    """The idle fill gives zeros of each parameter's own shape and dtype (not None), with checkpointing on."""
    _, split = _lora_pair()
    split.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    split.train()
    tp.scalar_loss(split(input_ids=torch.tensor([[5, 9]]))).backward()
    idle = tp._idle(split, 0)
    assert idle
    for module in split.modules():
        if isinstance(module, LinearExperts):
            for expert in module:
                for p in expert.parameters():
                    if p.requires_grad:
                        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype
                    else:
                        assert p.grad is None  # frozen base weights stay out of the graph


def test_skip_idle_experts_is_an_explicit_opt_out():
    torch.manual_seed(0)
    config = tiny_qwen2_moe_config()
    with get_recipe("qwen2_moe-linear-experts").apply():
        model = transformers.Qwen2MoeForCausalLM(config)
    layers = [m for m in model.modules() if isinstance(m, LinearExperts)]
    assert layers and not any(m.skip_idle_experts for m in layers)  # the default fills
    for m in layers:
        m.skip_idle_experts = True
    tp.scalar_loss(model(input_ids=torch.tensor([[5]]))).backward()
    nones = [n for n, p in model.named_parameters() if ".experts." in n and p.grad is None]
    assert nones  # a token reaches top_k of the experts: the others are left out
