"""``modelpatch verify --quantization NAME``: the patched model loaded quantized, what got quantized, how far its
outputs moved from the full-precision patched model, and the quantized save round trip.

Names (:data:`QUANTIZATIONS`): ``torchao-int8`` (torchao ``Int8WeightOnlyConfig``), ``quanto-int8``
(optimum-quanto ``QuantoConfig(weights="int8")``), ``bnb-8bit`` and ``bnb-4bit`` (bitsandbytes, its CPU backend
here). torchao's int4 weight-only layouts do not run on a CPU-only torch (torchao 0.18: the plain layout has no CPU
kernel, the tile-packed one needs CUDA, the default needs the ``mslk`` package), so there is no ``torchao-int4``.

The save round trip saves the quantized patched model in the original layout (``save_pretrained``) and reloads it
pre-quantized with the recipe; where modelpatch refuses that layout
(:class:`~modelpatch.conversion.QuantizedSaveError`), it saves the patched layout
(``save_original_format=False``) instead and says so. The reload must give the outputs of the model as it was
saved, bit for bit: bitsandbytes' 4-bit CPU kernels (AVX-512-BF16 CPUs) repack a weight on its first forward and
unpack it, rounded, when it is saved, so there the saved model's outputs move (measured: 0.024 on the tiny llama);
the note says by how much.

bitsandbytes 0.50's CPU packing needs ``in_features`` a multiple of its blocksize (64) and ``out_features`` a
multiple of 32 (``_convert_weight_packed_for_cpu``); a Linear that does not fit crashes its first forward
(``shape '[64, 0]' is invalid``). ``--quantization bnb-4bit`` names the first such layer in one line (exit 2)
where bitsandbytes packs (a CPU with AVX-512-BF16), before any forward.
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..conversion.quantized import BNB_LAYERS, QuantizedSaveError, fused_experts_left_unquantized, is_quantized
from .checkpoint import remote_code_kwargs
from .errors import CliError

__all__ = [
    "Quantization",
    "QUANTIZATIONS",
    "quantization_config",
    "is_quantized",
    "dequantized_weight",
    "Census",
    "census",
    "QuantizedResult",
    "run_quantized",
    "bnb_cpu_packing_problem",
]

BNB_CPU_BLOCKSIZE = 64  # bitsandbytes' default 4-bit blocksize: in_features must be a multiple of it
BNB_CPU_BLOCK_N = 32  # _convert_weight_packed_for_cpu's block_n: out_features must be a multiple of it


def bnb_cpu_packing_problem(model: torch.nn.Module, *, packing: bool | None = None) -> str | None:
    """The first bitsandbytes 4-bit Linear of ``model`` that bitsandbytes' CPU packing cannot handle, as a message;
    ``None`` when all fit or bitsandbytes does not pack here.

    Args:
        packing: whether bitsandbytes packs 4-bit weights for its CPU kernels (default: what it decides on this
            machine, ``bitsandbytes.functional.has_avx512bf16()``, for modules on the CPU).
    """
    for name, module in model.named_modules():
        if type(module).__name__ != "Linear4bit" or getattr(module.weight, "device", None) != torch.device("cpu"):
            continue
        if packing is None:
            from bitsandbytes.functional import has_avx512bf16

            packing = bool(has_avx512bf16())
        if not packing:
            return None
        n, k = module.out_features, module.in_features
        if k % BNB_CPU_BLOCKSIZE or n % BNB_CPU_BLOCK_N:
            return (
                f"bitsandbytes cannot pack '{name}' ({k} inputs, {n} outputs) for its 4-bit CPU kernels on this "
                f"machine (AVX-512-BF16): they need in_features a multiple of {BNB_CPU_BLOCKSIZE} and out_features "
                f"a multiple of {BNB_CPU_BLOCK_N}"
            )
    return None


@dataclass(frozen=True)
class Quantization:
    """A quantization the command line knows: ``module`` must import (from the ``extra`` of modelpatch), ``build``
    returns the ``quantization_config`` for ``from_pretrained``; ``atol`` is its usual output error on the tiny
    test models (max abs logit difference to full precision, measured below half of it)."""

    name: str
    extra: str
    module: str
    build: Callable[[], Any]
    atol: float


def _torchao_int8():
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _quanto_int8():
    from transformers import QuantoConfig

    return QuantoConfig(weights="int8")


def _bnb(bits: int):
    def build():
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(**{f"load_in_{bits}bit": True})

    return build


QUANTIZATIONS: dict[str, Quantization] = {
    q.name: q
    for q in (
        Quantization("torchao-int8", "torchao", "torchao", _torchao_int8, 0.05),
        Quantization("quanto-int8", "quanto", "optimum.quanto", _quanto_int8, 0.05),
        Quantization("bnb-8bit", "bitsandbytes", "bitsandbytes", _bnb(8), 0.05),
        Quantization("bnb-4bit", "bitsandbytes", "bitsandbytes", _bnb(4), 0.5),
    )
}
"""Every ``--quantization`` name."""


def quantization_config(name: str, known: dict[str, Quantization] | None = None):
    """``(Quantization, quantization_config)`` for ``name`` among ``known`` (default :data:`QUANTIZATIONS`).

    Raises:
        CliError: an unknown name (the known ones listed), or a backend that is not installed (the extra named).
    """
    known = QUANTIZATIONS if known is None else known
    quantization = known.get(name)
    if quantization is None:
        raise CliError(f"unknown quantization '{name}'; known: {', '.join(known)}")
    try:
        importlib.import_module(quantization.module)
    except ImportError as exc:
        raise CliError(
            f"--quantization {name} needs {quantization.module.split('.')[0]} ({exc}); install it with "
            f"pip install 'modelpatch[{quantization.extra}]'"
        ) from None
    return quantization, quantization.build()


def dequantized_weight(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` as a float32 ``(out, in)`` tensor: torchao and quanto tensors' ``dequantize()``,
    bitsandbytes' ``dequantize_bnb_weight``; a full-precision weight as it is."""
    weight: Any = module.weight
    kind = type(weight).__name__
    if kind in BNB_LAYERS.values():
        from transformers.integrations.bitsandbytes import dequantize_bnb_weight

        return dequantize_bnb_weight(weight, getattr(module, "state", None)).float()
    if hasattr(weight, "dequantize") and kind not in ("Tensor", "Parameter"):
        return weight.dequantize().float()
    return weight.detach().float()


def _linear_like(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ in ("QLinear", *BNB_LAYERS)


@dataclass
class Census:
    """What a quantized load quantized: ``linear``/``linear_quantized`` count Linear layers, ``experts``/
    ``experts_quantized`` the Linear layers inside ``*.experts.*``; ``not_quantized`` names the Linear layers left in
    full precision, ``fused_experts`` the fused 3-D experts parameters left in full precision."""

    linear: int = 0
    linear_quantized: int = 0
    experts: int = 0
    experts_quantized: int = 0
    not_quantized: list[str] = field(default_factory=list)
    fused_experts: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "linear": self.linear,
            "linear_quantized": self.linear_quantized,
            "expert_linear": self.experts,
            "expert_linear_quantized": self.experts_quantized,
            "not_quantized": self.not_quantized,
            "fused_experts_full_precision": self.fused_experts,
        }


def census(model: torch.nn.Module) -> Census:
    """Count the quantized Linear layers of ``model`` (see :class:`Census`)."""
    result = Census(fused_experts=fused_experts_left_unquantized(model))
    for name, module in model.named_modules():
        if not _linear_like(module):
            continue
        quantized = is_quantized(module)
        result.linear += 1
        result.linear_quantized += quantized
        if ".experts." in f".{name}.":
            result.experts += 1
            result.experts_quantized += quantized
        if not quantized:
            result.not_quantized.append(name)
    return result


@dataclass
class QuantizedResult:
    """``verify --quantization``'s measurements (``as_dict()`` is the ``"quantization"`` entry of ``--json``)."""

    name: str
    census: Census = field(default_factory=Census)
    max_abs_diff: float = float("nan")
    atol: float = 0.0
    saved_layout: str = ""
    save_note: str = ""
    round_trip_diff: float | None = None

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "census": self.census.as_dict(),
            "output": {"max_abs_diff_to_full_precision": self.max_abs_diff, "atol": self.atol},
            "save": {"layout": self.saved_layout, "note": self.save_note, "reload_max_abs_diff": self.round_trip_diff},
        }


def run_quantized(
    cls, model_dir: str, recipe, dtype, name: str, reference: torch.Tensor, inputs: dict, output: Callable
) -> QuantizedResult:
    """Load ``model_dir`` with ``recipe`` quantized by ``name``; census, output difference to ``reference`` (the
    full-precision patched output for ``inputs``, computed by ``output(model, inputs)``) and the save round trip.

    Raises:
        CliError: an unknown quantization or a missing backend (see :func:`quantization_config`), or a load that
            fails (its message).
    """
    quantization, config = quantization_config(name)
    # in bfloat16/float16 the activations' own rounding adds to the quantizer's error (torchao int8 on a tiny
    # qwen3_moe in bfloat16: 0.0625 with every expert quantized, against 0.0052 in float32): twice the budget
    atol = quantization.atol * (1 if dtype in (None, torch.float32) else 2)
    result = QuantizedResult(name, atol=atol)
    try:
        with recipe.apply():
            model = cls.from_pretrained(
                model_dir, dtype=dtype, quantization_config=config, **remote_code_kwargs()
            ).eval()
    except Exception as exc:  # noqa: BLE001 - the loader's message is the answer
        raise CliError(
            f"quantized ({name}) patched load of '{model_dir}' failed: {type(exc).__name__}: {exc}"
        ) from None
    if name == "bnb-4bit" and (problem := bnb_cpu_packing_problem(model)) is not None:
        raise CliError(f"--quantization {name}: {problem}")
    result.census = census(model)
    actual, _ = output(model, inputs)
    result.max_abs_diff = float((actual - reference).abs().max()) if actual.shape == reference.shape else float("inf")
    with tempfile.TemporaryDirectory(prefix="modelpatch-verify-quantized-") as folder:
        saved = f"{folder}/saved"
        try:
            model.save_pretrained(saved)
            result.saved_layout = "original"
        except QuantizedSaveError as exc:
            result.save_note = str(exc).split(". Nothing was written")[0]
            model.save_pretrained(saved, save_original_format=False)
            result.saved_layout = "patched (save_original_format=False)"
        except ValueError as exc:  # Transformers: this quantizer's models are not serializable
            result.saved_layout = "not saved"
            result.save_note = str(exc).split(" - ")[0]
            return result
        # bitsandbytes' 4-bit CPU kernels round a packed weight when saving it: the model as saved is the reference
        as_saved, _ = output(model, inputs)
        if not torch.equal(as_saved, actual):
            drift = f"saving moved this model's outputs by {float((as_saved - actual).abs().max()):.3g} ({name})"
            result.save_note = f"{result.save_note}; {drift}" if result.save_note else drift
        with recipe.apply():
            reloaded = cls.from_pretrained(saved, dtype=dtype, **remote_code_kwargs()).eval()
        again, _ = output(reloaded, inputs)
        result.round_trip_diff = (
            float((again - as_saved).abs().max()) if again.shape == as_saved.shape else float("inf")
        )
    return result
