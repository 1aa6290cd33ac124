"""Quantized weights through conversion rules: what each quantizer stores per weight, which conversions of it are
exact, the save-time refusal and the pre-quantized load of a converted layout.

Transformers quantizes a weight on load after the conversion rules ran (``core_model_loading``: the converted
tensor reaches ``hf_quantizer.get_quantize_ops()`` like an unconverted one), so on-the-fly quantized loads need
nothing here. Saved, a quantized weight is several tensors (its *components*), under the module's prefix:

==========================  ============================================  =========================================
quantizer                   components of ``<module>.weight``             split along the output rows exactly?
==========================  ============================================  =========================================
torchao ``Int8Tensor``      ``._weight_qdata (O, I)``, ``._weight_scale``  yes when ``block_size == [1, I]`` (one
                            ``(O, 1)``, ``._weight_zero_point (O, 1)``     scale per output row, the default)
bitsandbytes 8-bit          ``.weight (O, I) int8``, ``.SCB (O,)``,        yes (``SCB``: one absmax per row);
                            ``.weight_format`` (0-d, copied)               ``weight_format`` is copied to each piece
bitsandbytes 4-bit          ``.weight`` (packed), ``.weight.absmax``, ...  no: blockwise absmax over the flattened
                                                                           weight and one ``quant_state`` per tensor
anything else (int4, ...)   as the quantizer writes it                     no (not known to be exact)
==========================  ============================================  =========================================

A conversion rule whose reverse only splits rows (``Concatenate(dim=0)`` on load, ``Chunk(dim=0)`` on save: the
fused ``qkv_proj``) is applied to each row component (the reference sizes of the weight give every component's
row counts); any other rule on a quantized weight (e.g. stacking per-expert weights back into a fused 3-D tensor)
is refused, as is any rule on a format that is not row-exact: :class:`QuantizedSaveError` names the parameter, the
quantizer and the way out (``save_pretrained(..., save_original_format=False)`` writes the model's own layout,
which the same recipe reloads, pre-quantized, with no conversion).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch
from transformers import core_model_loading as _tcml
from transformers.utils import logging

from ..errors import ModelpatchError
from .errors import ConversionError
from .ops import Chunk, Concatenate
from .rules import match_rule

__all__ = [
    "QuantizedSaveError",
    "QuantizedParam",
    "quantizer_label",
    "quantized_params",
    "row_split_only",
    "check_reverse_groups",
    "prequantized_companion",
    "prepare_prequantized_items",
    "fix_prequantized_metadata",
    "fused_experts_left_unquantized",
    "warn_fused_experts_left",
    "check_prequantized_layers",
    "is_quantized",
    "BNB_LAYERS",
]

logger = logging.get_logger("modelpatch.conversion")


class QuantizedSaveError(ModelpatchError, ValueError):
    """A quantized model cannot be saved in its original (checkpoint) layout exactly. Raised before anything is
    written.

    Attributes:
        parameter: the model parameter at fault (``model.layers.0.self_attn.qkv_proj.weight``).
        quantizer: the quantizer and format (``"bitsandbytes 4-bit"``).
    """

    def __init__(self, parameter: str, quantizer: str, why: str):
        self.parameter = parameter
        self.quantizer = quantizer
        super().__init__(
            f"Cannot save '{parameter}' ({quantizer}) in the original checkpoint layout exactly: {why}. Nothing was "
            "written. Save the patched layout instead with save_pretrained(..., save_original_format=False): the "
            "same recipe reloads it, pre-quantized, with no conversion."
        )


@dataclass(frozen=True)
class QuantizedParam:
    """One quantized weight of a model, as saved.

    Attributes:
        name: model-layout parameter name (``<module>.weight``).
        module: its module prefix.
        quantizer: human-readable quantizer and format.
        rows: component keys split along dim 0 by a row split (all have the weight's output rows as dim 0).
        copied: component keys copied unchanged to every piece of a split.
        row_exact: whether splitting ``rows`` along dim 0 is exact (``why`` says why not).
        metadata: the torchao safetensors metadata entry of the weight (JSON), else ``None``.
    """

    name: str
    module: str
    quantizer: str
    rows: tuple[str, ...]
    copied: tuple[str, ...] = ()
    row_exact: bool = True
    why: str = ""
    metadata: str | None = None

    def suffix(self, key: str) -> str:
        """``key`` relative to :attr:`module` (``._weight_qdata``, ``.SCB``)."""
        return key[len(self.module) :]


def quantizer_label(quantizer) -> str:
    """``"torchao Int8WeightOnlyConfig"``, ``"bitsandbytes 8-bit"``, ``"quanto int8"``, ... for messages."""
    config = quantizer.quantization_config
    method = getattr(config.quant_method, "value", config.quant_method)
    if method == "bitsandbytes":
        return "bitsandbytes 4-bit" if getattr(config, "load_in_4bit", False) else "bitsandbytes 8-bit"
    if method == "torchao":
        return f"torchao {type(config.quant_type).__name__}"
    if method == "quanto":
        return f"quanto {config.weights}"
    return str(method)


def _torchao_params(state_dict: dict, metadata: dict) -> dict[str, QuantizedParam]:
    params = {}
    for name, entry in metadata.items():
        if name == "tensor_names" or "." not in name:
            continue
        info = json.loads(entry)
        kind = info.get("_type")
        if kind in (None, "Tensor"):
            continue
        module, param = name.rsplit(".", 1)
        prefix = f"{module}._{param}_"
        keys = tuple(k for k in state_dict if k.startswith(prefix))
        qdata = state_dict.get(prefix + "qdata")
        block = (info.get("_data") or {}).get("block_size")
        exact = (
            kind == "Int8Tensor"
            and isinstance(qdata, torch.Tensor)
            and qdata.dim() == 2
            and block == [1, qdata.shape[1]]
            and all(state_dict[k].dim() >= 1 and state_dict[k].shape[0] == qdata.shape[0] for k in keys)
        )
        why = "" if exact else f"torchao {kind} with block_size {block} is not quantized row by row"
        params[name] = QuantizedParam(name, module, f"torchao {kind}", keys, (), exact, why, entry)
    return params


def _module_params(model, state_dict: dict, label: str) -> dict[str, QuantizedParam]:
    params = {}
    for module_name, module in model.named_modules():
        kind = type(module).__name__
        if kind not in ("Linear8bitLt", "Linear4bit") and not (
            "quanto" in label and kind == "QLinear" or "hqq" in label and kind == "HQQLinear"
        ):
            continue
        name = f"{module_name}.weight"
        if kind == "Linear8bitLt":
            rows = tuple(k for k in (name, f"{module_name}.SCB") if k in state_dict)
            copied = tuple(k for k in (f"{module_name}.weight_format",) if k in state_dict)
            params[name] = QuantizedParam(name, module_name, label, rows, copied)
            continue
        keys = tuple(k for k in state_dict if k == name or k.startswith(name + "."))
        why = (
            "4-bit weights are packed and quantized blockwise over the flattened weight, with one quant_state per tensor"
            if kind == "Linear4bit"
            else f"{label} weights are not known to split exactly"
        )
        params[name] = QuantizedParam(name, module_name, label, keys, (), False, why)
    return params


def quantized_params(model, state_dict: dict, metadata: dict | None = None) -> dict[str, QuantizedParam]:
    """``{parameter name: QuantizedParam}`` for every quantized weight of ``model`` in ``state_dict`` (the state dict
    ``save_pretrained`` writes: ``hf_quantizer.get_state_dict_and_metadata(model)``, else ``model.state_dict()``),
    with ``metadata`` the torchao safetensors metadata that goes with it. ``{}`` for a model without quantizer."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return {}
    label = quantizer_label(quantizer)
    if metadata and "tensor_names" in metadata:
        return _torchao_params(state_dict, metadata)
    return _module_params(model, state_dict, label)


def row_split_only(rule) -> bool:
    """Whether the reversed converter ``rule`` only splits its single source along dim 0 (the save side of
    ``Concatenate(dim=0)``)."""
    operations = list(getattr(rule, "operations", ()))
    return (
        bool(operations)
        and len(rule.source_patterns) == 1
        and all(isinstance(op, Chunk) and op.dim == 0 for op in operations)
    )


def check_reverse_groups(plan, named_plan, params: dict[str, QuantizedParam], label: str) -> None:
    """Refuse (:class:`QuantizedSaveError`) to save a quantized weight through a reverse conversion that is not exact.

    ``plan``: the reverse plan over the keys of the saved state dict (the quantizer's components); ``named_plan``: the
    same rules over the model's parameter names (built with ``incomplete=[]``), which sees the rules written for
    ``<module>.weight``. A weight is refused when a group of either plan takes it and the format is not row-exact,
    or the rule does more than split rows (stacking per-expert weights back into a fused 3-D tensor), or a rule takes
    the weight by its name but not its saved components (those would be written unconverted)."""
    owner = {key: p for p in params.values() for key in p.rows + p.copied}
    converted = {key for group in plan.groups.values() for key in group.source_keys()}
    groups = [(g, False) for g in plan.groups.values()] + [(g, True) for g in named_plan.groups.values()]
    for group, by_name in groups:
        if by_name:
            touched = {params[key] for key in group.source_keys() if key in params}
        else:
            touched = {owner[key] for key in group.source_keys() if key in owner}
        for param in sorted(touched, key=lambda p: p.name):
            if not param.row_exact:
                raise QuantizedSaveError(param.name, param.quantizer, f"{param.why}, and {group.rule!r} converts it")
            if not row_split_only(group.rule):
                raise QuantizedSaveError(
                    param.name,
                    param.quantizer,
                    f"{group.rule!r} does more than split its rows; quantized components cannot be merged or "
                    "stacked back exactly",
                )
            missed = [key for key in param.rows if key not in converted]
            if by_name and missed:
                raise QuantizedSaveError(
                    param.name,
                    param.quantizer,
                    f"{group.rule!r} names the weight itself, not its saved components (e.g. '{missed[0]}')",
                )


# --- pre-quantized loads ---------------------------------------------------------------------------------------


def _serialized(quantizer) -> list[tuple[str, str]]:
    """``(component suffix, parameter)`` pairs: ``("._weight_qdata", "weight")``, ``(".SCB", "weight")``."""
    names = []
    for param, serialized in (getattr(quantizer, "serialized_names", None) or {}).items():
        for name in serialized:
            if name != param:
                names.append((f".{name}", param))
    return sorted(names, key=lambda kv: -len(kv[0]))


def prequantized_companion(name: str, quantizer, model_keys) -> str | None:
    """The model parameter ``name`` is a saved component of (``<m>._weight_qdata`` -> ``<m>.weight``,
    ``<m>.SCB`` -> ``<m>.weight``) in a pre-quantized load, else ``None``."""
    for suffix, param in _serialized(quantizer):
        if name.endswith(suffix):
            candidate = f"{name[: -len(suffix)]}.{param}"
            if candidate in model_keys:
                return candidate
    return None


def _row_exact_checkpoint(quantizer) -> tuple[bool, str]:
    label = quantizer_label(quantizer)
    method = getattr(quantizer.quantization_config.quant_method, "value", quantizer.quantization_config.quant_method)
    if method == "bitsandbytes":
        exact = not getattr(quantizer.quantization_config, "load_in_4bit", False)
        return exact, label
    if method == "torchao":
        return True, label  # decided per weight from the checkpoint's metadata (fix_prequantized_metadata)
    return False, label


def prepare_prequantized_items(items: list, resolved_rules: list, quantizer) -> list:
    """The checkpoint items of a pre-quantized load with conversion rules, ready to plan: bitsandbytes 8-bit
    ``weight_format`` tensors (0-d, ignored by Transformers' deserializer) of the keys a converter takes are left
    out. Raises :class:`ConversionError` when a converter would take components of a format that does not convert
    exactly (bitsandbytes 4-bit, other quantizers), or when it does more than concatenate rows."""
    converters = [r for r in resolved_rules if isinstance(r, _tcml.WeightConverter)]
    if not converters:
        return items
    suffixes = [s for s, _ in _serialized(quantizer)]
    exact, label = _row_exact_checkpoint(quantizer)
    kept = []
    for key, obj in items:
        suffix = next((s for s in suffixes if key.endswith(s)), None)
        rule = next((r for r in converters if match_rule(r, key) is not None), None) if suffix else None
        if rule is None:
            kept.append((key, obj))
            continue
        if not exact:
            raise ConversionError(
                f"'{key}' is a {label} component and {rule!r} converts it: pre-quantized {label} tensors cannot be "
                "converted exactly. Save the model in its patched layout (save_pretrained(..., "
                "save_original_format=False)) and load that, or load the full-precision checkpoint with "
                "quantization_config=. Nothing was loaded."
            )
        operations = list(rule.operations)
        if not (operations and all(isinstance(op, Concatenate) and op.dim == 0 for op in operations)):
            raise ConversionError(
                f"'{key}' is a {label} component and {rule!r} does more than concatenate rows: quantized tensors "
                "cannot be converted exactly. Nothing was loaded."
            )
        if suffix == ".weight_format":
            continue
        kept.append((key, obj))
    return kept


def fix_prequantized_metadata(quantizer, dry: dict, renamed=()) -> None:
    """Give each converted torchao component group (``dry``: ``{output name: (shape, dtype, group)}`` of the load
    plan) the safetensors metadata of its sources, under the converted parameter's name, in ``quantizer.metadata``
    (Transformers' torchao deserializer looks it up by the model's parameter name). Sources must share one entry
    (same format, same input features) and be quantized row by row. ``renamed``: the plan's ``(rule, key, new
    key)`` renamings, whose components take their weight's entry under the new name.

    Raises:
        ConversionError: no entry for a source, sources with different entries, or an entry that is not row-wise.
    """
    metadata = getattr(quantizer, "metadata", None)
    if not metadata or "tensor_names" not in metadata:
        return
    names = json.loads(metadata["tensor_names"])
    pattern = re.compile(r"^(?P<module>.+)\._(?P<param>[^.]+?)_(?P<component>qdata|scale|zero_point|[a-z_]+)$")
    added = {}
    for output, (_, _, group) in dry.items():
        found = pattern.match(output)
        if found is None:
            continue
        param = f"{found['module']}.{found['param']}"
        entries: set[str] = set()
        for source in group.source_keys():
            source_match = pattern.match(source)
            entry = metadata.get(f"{source_match['module']}.{source_match['param']}") if source_match else None
            if entry is None:
                entries = set()
                break
            entries.add(entry)
        if not entries:
            continue  # not a torchao component (e.g. a plain tensor whose name happens to match)
        if len(entries) > 1:
            raise ConversionError(
                f"'{output}': its sources {list(group.source_keys())} were quantized differently; they cannot be "
                "fused into one quantized weight. Nothing was loaded."
            )
        (entry,) = entries
        info = json.loads(entry)
        block = (info.get("_data") or {}).get("block_size")
        if info.get("_type") != "Int8Tensor" or not block or block[0] != 1:
            raise ConversionError(
                f"'{output}': torchao {info.get('_type')} with block_size {block} cannot be concatenated exactly "
                "(only int8 weights quantized row by row can). Nothing was loaded."
            )
        added[param] = entry
    for _, key, new_key in renamed:
        old, new = pattern.match(key), pattern.match(new_key)
        if old is None or new is None:
            continue
        entry = metadata.get(f"{old['module']}.{old['param']}")
        if entry is not None and json.loads(entry).get("_type") != "Tensor":
            added[f"{new['module']}.{new['param']}"] = entry
    for param, entry in added.items():
        metadata[param] = entry
        if param not in names:
            names.append(param)
    metadata["tensor_names"] = json.dumps(names)


# --- fused experts left in full precision ----------------------------------------------------------------------


def fused_experts_left_unquantized(model) -> list[str]:
    """Names of the fused 3-D experts parameters (``*.experts.gate_up_proj``, ``*.experts.down_proj``, ...) of
    ``model`` that are plain floating-point tensors: weight quantizers walking ``nn.Linear`` skip them."""
    names = []
    for name, param in model.named_parameters():
        if param.dim() == 3 and param.is_floating_point() and type(param.data) is torch.Tensor and ".experts." in name:
            names.append(name)
    return names


def warn_fused_experts_left(model, label: str) -> bool:
    """Warn once for a quantized load inside a modelpatch scope that left fused experts in full precision, naming
    them (with the layer index as ``*``) and the recipe that makes them quantizable. Returns whether it warned."""
    names = fused_experts_left_unquantized(model)
    if not names:
        return False
    patterns = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names))
    model_type = getattr(model.config, "model_type", "<model_type>")
    logger.warning(
        f"{type(model).__name__} loaded with {label}: {len(names)} fused experts parameter(s) stay in full precision "
        f"(the quantizer only replaces nn.Linear): {', '.join(patterns)}. Load inside the '{model_type}-linear-experts' "
        "recipe (or 'linear-experts') to quantize every expert."
    )
    return True


# --- pre-quantized loads whose checkpoint holds some layers unquantized -------------------------------------------

BNB_LAYERS = {"Linear8bitLt": "Int8Params", "Linear4bit": "Params4bit"}
"""bitsandbytes layer class names and the parameter class each holds its quantized weight in."""


def is_quantized(module) -> bool:
    """Whether ``module``'s ``weight`` is held quantized (a tensor subclass or parameter class of a quantizer, or
    integer data), i.e. not a plain floating-point tensor."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return False
    return type(weight) not in (torch.Tensor, torch.nn.Parameter) or not weight.is_floating_point()


def check_prequantized_layers(model, label: str) -> None:
    """After a pre-quantized load inside a modelpatch scope: the checkpoint may hold layers unquantized that the
    patched model has as ``nn.Linear`` (a MoE checkpoint that plain Transformers quantized with its experts fused,
    so left in full precision, loaded with a linear-experts recipe).

    Raises:
        ConversionError: bitsandbytes layers hold float weights from the checkpoint (their forward would fail on the
            missing quantization state): the first layers are named.

    Logs a warning naming the per-expert ``nn.Linear`` weights that stay in full precision (torchao and the other
    quantizers that only deserialize what the checkpoint quantized).
    """
    broken, full = [], []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        expected = BNB_LAYERS.get(type(module).__name__)
        if expected is not None and weight is not None and type(weight).__name__ != expected:
            broken.append(name)
        elif isinstance(module, torch.nn.Linear) and ".experts." in name and not is_quantized(module):
            full.append(name)
    if broken:
        raise ConversionError(
            f"{type(model).__name__} loaded with {label}: {len(broken)} bitsandbytes layer(s) got unquantized weights "
            f"from the pre-quantized checkpoint (e.g. {broken[:3]}); it did not quantize them (a checkpoint that "
            "plain Transformers quantized keeps fused experts in full precision). Load the full-precision "
            "checkpoint with quantization_config inside the recipe instead."
        )
    if full:
        patterns = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in full))
        logger.warning(
            f"{type(model).__name__} loaded with {label}: {len(full)} expert Linear layer(s) stay in full precision, "
            f"the pre-quantized checkpoint holds them unquantized: {', '.join(patterns[:6])}. Load the full-precision "
            "checkpoint with quantization_config inside the recipe to quantize them."
        )
