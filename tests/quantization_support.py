"""Quantizers and tiny checkpoints shared by the quantization tests.

The backends are imported here, at module top: a test that needs a quantizer fails loudly when it is missing.
"""

from __future__ import annotations

import bitsandbytes  # noqa: F401 - the tests need every backend (the `test` extra installs them)
import optimum.quanto  # noqa: F401
import torch
import torchao  # noqa: F401
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers import (
    tiny_llama_config,
    tiny_mixtral_config,
    tiny_qwen2_config,
    tiny_qwen2_moe_config,
    tiny_qwen3_moe_config,
)
from modelpatch.cli.quantize import QUANTIZATIONS, dequantized_weight, is_quantized

# bitsandbytes 0.50's 4-bit CPU packing (AVX-512-BF16 CPUs) needs in_features a multiple of 64 and out_features a
# multiple of 32: the experts here are 64 wide (the helpers' tiny MoE experts are 32), so every quantizer runs on
# every x86-64 CPU
EXPERTS_64 = dict(moe_intermediate_size=64)

# recipe -> tiny config (GQA; qwen2 with its q/k/v biases)
CASES = {
    "qwen2_moe-linear-experts": lambda **kw: tiny_qwen2_moe_config(**(EXPERTS_64 | kw)),
    "qwen3_moe-linear-experts": lambda **kw: tiny_qwen3_moe_config(**(EXPERTS_64 | kw)),
    "mixtral-linear-experts": tiny_mixtral_config,
    "llama-fused-qkv": tiny_llama_config,
    "qwen2-fused-qkv": tiny_qwen2_config,
}

# the class of a quantized weight, per quantizer
WEIGHT_CLASS = {
    "torchao-int8": "Int8Tensor",
    "quanto-int8": "WeightQBytesTensor",
    "bnb-8bit": "Int8Params",
    "bnb-4bit": "Params4bit",
}

# max |dequantized - checkpoint slice| / max |checkpoint slice| (measured: int8 0.0039-0.0041, bnb 4-bit <= 0.166)
WEIGHT_RTOL = {"torchao-int8": 0.005, "quanto-int8": 0.005, "bnb-8bit": 0.005, "bnb-4bit": 0.2}

IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10]])


def quantization_config(name: str):
    config = QUANTIZATIONS[name].build()
    if name == "bnb-4bit":
        # bitsandbytes' 4-bit CPU packing cannot pack qwen2_moe's 1-output shared_expert_gate (out_features must be
        # a multiple of 32 on AVX-512-BF16 CPUs): kept in full precision on every CPU, like lm_head
        config.llm_int8_skip_modules = ["lm_head", "shared_expert_gate"]
    return config


def save_checkpoint(recipe: str, path) -> str:
    """A tiny checkpoint of ``recipe``'s family (default init: every expert and projection distinct), saved with
    Transformers' ``save_pretrained`` (per-expert layout)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CASES[recipe]())
    model.save_pretrained(path)
    return str(path)


def checkpoint(path) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")


__all__ = [
    "CASES",
    "IDS",
    "WEIGHT_CLASS",
    "WEIGHT_RTOL",
    "checkpoint",
    "dequantized_weight",
    "is_quantized",
    "quantization_config",
    "save_checkpoint",
]
