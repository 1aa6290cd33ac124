"""Per-expert linear experts: every expert a set of ``nn.Linear`` (what weight quantisers need), for every family.

Transformers 5.x stores the experts of a MoE layer as fused 3-D parameters in a class decorated with
``@use_experts_implementation`` (``transformers.integrations.moe``), whose flags say how: ``has_gate``
(``gate_up_proj`` holding gate and up, else ``up_proj`` only), ``is_transposed`` (``(E, in, out)`` instead of
``(E, out, in)``), ``is_concatenated`` (gate rows then up rows; ``False``: gpt-oss's alternating gate/up columns),
``has_bias`` (``<name>_bias`` of shape ``(E, out)``), ``has_post_expert_norm``; the class's ``_apply_gate`` (the
default ``act_fn(gate) * up``, or the family's own, e.g. gpt-oss's clamped GLU) combines gate and up, and
``batched_mm_experts_forward`` there is the generic formulation of every decorated class's math.

Nothing here is written per family. For a ``model_type`` the decorated classes are found in its modeling module's
source text (cheap: no modeling module is imported until a recipe is applied), the per-expert names in
Transformers' own conversion mapping of that type (the source patterns of the converter that fuses
``experts.*.<name>.weight`` into ``experts.gate_up_proj`` / ``experts.down_proj``: ``gate_proj/up_proj/down_proj``
for Qwen, ``w1/w3/w2`` for Mixtral; ``gate_proj/up_proj/down_proj`` for families whose checkpoints are fused
already, e.g. gpt-oss). The replacement of class ``<X>`` is ``Linear<X>`` (:class:`LinearExperts`): built with the
original's constructor arguments, it builds the original on the ``meta`` device, reads its flags, shapes and the
attributes its ``_apply_gate`` uses, and holds ``E`` :class:`ExpertMLP` modules, expert ``e`` with ``gate``, ``up``
and ``down`` linears (``up`` and ``down`` only without gate; biases where the family has them).

One recipe ``<model_type>-linear-experts`` loads both checkpoint layouts, and saves the one it loaded (the rules
carry alternative :class:`~modelpatch.conversion.Layout` s of one group, see :mod:`modelpatch.conversion.rules`):

* per-expert (``"per-expert"``, the default: the Hub layout, Transformers' default ``save_pretrained``): the
  tensors load directly into the expert linears; the family's built-in renamings (Mixtral's ``block_sparse_moe``
  -> ``mlp``) are kept, the built-in fusion is dropped (``overwrite=True``);
* fused (``"fused"``, ``save_pretrained(..., save_original_format=False)``): ``experts.gate_up_proj`` is transposed
  back if the class stores it transposed (:class:`~modelpatch.conversion.SwapDims`), split into gate and up
  (``Chunk(dim=1)``, or :class:`~modelpatch.conversion.Deinterleave` for alternating columns) and per expert
  (``SplitModulelist(dim=0)``); ``down_proj`` and the biases likewise. On save the rules run backwards.

A model built from a config (nothing loaded) saves the per-expert layout.

``forward(hidden_states (N, H), top_k_index (N, k) long, top_k_weights (N, k)) -> (N, H)`` follows the original
loop (experts visited in index order, the index ``E`` used as padding is skipped, ``index_add_``), so outputs equal
the fused original within fp32 rounding. Training steps the same parameters as the original: an expert no token
reached gets a zero gradient, not ``None`` (while gradients are recorded, one autograd node gives the idle experts'
trainable parameters zero gradients without running them), as its slice of the fused tensor does, so SGD momentum,
Adam moments and weight decay move it as they move the original, and
``DistributedDataParallel(find_unused_parameters=False)`` sees every parameter in every step. When FSDP2 shards the
expert modules themselves (``fully_shard`` per expert), every expert is called, in index order, on its tokens
(possibly none): each call is a collective (all-gather before, reduce-scatter after) that every rank must make.

Under ``torch.compile`` the forward takes one of two formulations, chosen by the instance attribute
``compiled_dispatch`` (class default ``"sparse"``); both call every expert's own ``nn.Linear`` modules (hooks,
quantised weights and PEFT wrappers see each call) and equal the eager forward within fp32 rounding (outputs and
gradients within 1e-5):

- ``"sparse"``: a fixed loop over all ``E`` experts, expert ``e`` applied to exactly the tokens routed to it
  (the positions of ``top_k_index == e``), weighted and summed with ``index_add_`` as in eager. The number of those
  tokens depends on the routing: the positions come from one operator, ``modelpatch::expert_positions``, whose
  size is unbacked, so the graph is whole (0 graph breaks, ``fullgraph=True`` works) with Dynamo's defaults and,
  with ``torch.compile(..., dynamic=True)`` (or ``mark_dynamic`` on the sequence dimension), no recompilation per
  sequence length or per token count (before issue 21, item 11, a ``torch.where`` here broke the graph unless
  ``capture_dynamic_output_shape_ops`` was set). Transformers' own fused experts use a ``grouped_mm`` over stacked
  weights (and a custom operator on CPU), which per-expert modules cannot use without bypassing the modules.
- ``"dense"``: every expert applied to every token, multiplied by its routing weight (0 where the token is not
  routed to it): static shapes, 0 graph breaks without any option, but ``E / k`` times the expert FLOPs and
  activations — for small expert counts, or to get ``fullgraph=True`` without changing Dynamo's configuration.
  A non-finite expert output on a token not routed to that expert would turn into NaN (``0 * inf``).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn
from transformers.activations import ACT2FN

from ..conversion import (
    Chunk,
    Deinterleave,
    Layout,
    LayoutWeightConverter,
    LayoutWeightRenaming,
    SplitModulelist,
    SwapDims,
)
from ..conversion.rules import as_modelpatch_rule
from ..conversion.zero3 import batched_zero_init, tensor_shape
from ..errors import ModelpatchError, ModelpatchValueError
from .base import Recipe, RuleSpec

__all__ = [
    "ExpertsClass",
    "ExpertsFamily",
    "ExpertMLP",
    "LinearExperts",
    "LINEAR_EXPERTS_CLASSES",
    "COMPILED_DISPATCHES",
    "UnsupportedExpertsError",
    "experts_family",
    "experts_model_types",
    "linear_experts_class",
    "linear_experts_recipe",
    "generic_linear_experts_recipe",
]


class UnsupportedExpertsError(ModelpatchError, ValueError):
    """The experts class (or the model type) cannot get per-expert linear experts; the message says why."""


_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
_DEFAULT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
_DEFAULT_FLAGS["has_post_expert_norm"] = False
_DECORATED = re.compile(r"^@use_experts_implementation(?:\((.*?)\))?\s*\nclass (\w+)\(", re.M | re.S)
_FLAG = re.compile(r"(\w+)\s*=\s*(True|False)")


@dataclass(frozen=True)
class ExpertsClass:
    """A class decorated with ``@use_experts_implementation``, as its module's source declares it.

    Attributes:
        module: the modeling module (``"transformers.models.mixtral.modeling_mixtral"``).
        name: the class name (``"MixtralExperts"``).
        flags: the decorator's arguments, defaults filled in (``has_gate``, ``has_bias``, ``is_transposed``,
            ``is_concatenated``, ``has_post_expert_norm``).
    """

    module: str
    name: str
    flags: Mapping[str, bool] = field(default_factory=lambda: dict(_DEFAULT_FLAGS))

    def load(self) -> type:
        """The class itself (imports its modeling module)."""
        return getattr(importlib.import_module(self.module), self.name)


@dataclass(frozen=True)
class ExpertsFamily:
    """What the recipe of one ``model_type`` is derived from.

    Attributes:
        model_type: ``config.model_type`` (conversion registry name).
        original: the first decorated class of its modeling module (``"MixtralExperts"``).
        names: per-expert linear names, as in the family's per-expert checkpoints: ``(gate, up, down)``, or
            ``(up, down)`` without gate.
        classes: every decorated class of the modeling module (composite models may have several).
        unsupported: why the family cannot be supported (``None`` when it can).
        per_expert_checkpoints: Transformers' conversion mapping of the type (or of the type whose modeling file
            defines the class) has an expert converter, i.e. its ``save_pretrained`` writes one tensor per expert
            (the Hub layout); ``False`` (gpt_oss, granitemoe): its checkpoints keep the fused tensors, the layout a
            model built from a config saves.
    """

    model_type: str
    original: str
    names: tuple[str, ...]
    classes: tuple[ExpertsClass, ...]
    unsupported: str | None = None
    per_expert_checkpoints: bool = True

    @property
    def flags(self) -> Mapping[str, bool]:
        return self.classes[0].flags


def _module_name(model_type: str) -> str | None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    return model_type_to_module_name(model_type)


def _models_dir() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


@functools.cache
def _classes_in(folder: str) -> tuple[ExpertsClass, ...]:
    """The decorated classes of ``transformers/models/<folder>/modeling_<folder>.py`` (read as text)."""
    path = _models_dir() / folder / f"modeling_{folder}.py"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return ()
    if "@use_experts_implementation" not in text:
        return ()
    found = []
    for match in _DECORATED.finditer(text):
        flags = dict(_DEFAULT_FLAGS)
        flags.update({k: v == "True" for k, v in _FLAG.findall(match.group(1) or "") if k in _FLAGS})
        found.append(ExpertsClass(f"transformers.models.{folder}.modeling_{folder}", match.group(2), flags))
    return tuple(found)


@functools.cache
def experts_model_types() -> tuple[str, ...]:
    """Every ``model_type`` of the installed Transformers whose modeling module declares a class decorated with
    ``@use_experts_implementation`` (from the modules' source text; nothing is imported). Sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(mt for mt in sorted(CONFIG_MAPPING_NAMES) if _classes_in(_module_name(mt) or ""))


_EXPERT_TARGET = re.compile(r"experts\.(gate_up_proj|up_proj|down_proj)$")
_PER_EXPERT_SOURCE = re.compile(r"experts\.\*\.(\w+)\.weight$")


def _unescape(pattern: str) -> str:
    return pattern.removeprefix("^").replace("\\.", ".")


def _builtin_rules(model_type: str) -> list:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return list(get_checkpoint_conversion_mapping(model_type) or [])


def _split_builtins(model_type: str) -> tuple[dict[str, list[str]], list, str | None]:
    """Transformers' rules of ``model_type``: ``({fused name: per-expert names}, other rules, why unsupported)``."""
    from transformers import core_model_loading as _tcml

    names: dict[str, list[str]] = {}
    others = []
    for rule in _builtin_rules(model_type):
        targets = [_unescape(t) for t in rule._original_target_patterns]
        fused = [m.group(1) for t in targets if (m := _EXPERT_TARGET.search(t))]
        if not fused or not isinstance(rule, _tcml.WeightConverter):
            others.append(rule)
            continue
        ops = [type(op).__name__ for op in rule.operations]
        sources = [_PER_EXPERT_SOURCE.search(_unescape(s)) for s in rule._original_source_patterns]
        standard = (["MergeModulelist", "Concatenate"], 2) if fused[0] == "gate_up_proj" else (["MergeModulelist"], 1)
        if (ops, len(sources)) != standard or not all(sources):
            return (
                {},
                others,
                (
                    f"Transformers converts its checkpoints' experts with {ops} "
                    f"({rule._original_source_patterns} -> {rule._original_target_patterns}), not from per-expert tensors"
                ),
            )
        names[fused[0]] = [m.group(1) for m in sources if m]
    return names, others, None


@functools.cache
@functools.cache
def _class_keyed_expert_converter(folder: str) -> bool:
    """Whether Transformers has an expert converter registered under the name of a class of ``folder``'s modeling
    file (Transformers looks class names up before the model type: ``Dots3NoteTextModel``), i.e. that type's
    ``save_pretrained`` writes per-expert tensors although its model type has no converter."""
    import transformers.conversion_mapping as cm

    cm.get_checkpoint_conversion_mapping("")  # builds the table
    table = getattr(cm, "_checkpoint_conversion_mapping_cache", None) or {}
    path = _models_dir() / folder / f"modeling_{folder}.py"
    if not folder or not path.is_file():
        return False
    text = path.read_text(encoding="utf-8")
    return any(key[:1].isupper() and f"class {key}(" in text and _split_builtins(key)[0] for key in table)


_CLASS_BASES = re.compile(r"^class (\w+)\(([\w., ]+)\)", re.M)


def _undecorated_subclass(folder: str, classes: tuple[ExpertsClass, ...]) -> tuple[str, str] | None:
    """``(subclass, decorated class)`` for a class of ``folder``'s modeling file that subclasses one of its
    decorated ``classes`` (read as text), e.g. Ergo's ``ErgoExperts(ErgoExpertProjections)``; ``None`` if none."""
    path = _models_dir() / folder / f"modeling_{folder}.py"
    if not folder or not path.is_file():
        return None
    names = {c.name for c in classes}
    for match in _CLASS_BASES.finditer(path.read_text(encoding="utf-8")):
        base = next((b.strip() for b in match.group(2).split(",") if b.strip() in names), None)
        if base is not None:
            return match.group(1), base
    return None


def experts_family(model_type: str) -> ExpertsFamily:
    """The :class:`ExpertsFamily` of ``model_type`` (from source text and Transformers' conversion mapping).

    Raises:
        UnsupportedExpertsError: ``model_type`` has no class decorated with ``@use_experts_implementation``.
    """
    classes = _classes_in(_module_name(model_type) or "")
    if not classes:
        raise UnsupportedExpertsError(
            f"model type {model_type!r} has no experts class decorated with @use_experts_implementation in this "
            "Transformers release"
        )
    fused, _, why = _split_builtins(model_type)
    home = _module_name(model_type)
    if home and home != model_type and not fused and _module_name(home) == home:
        # a model type sharing another type's experts class (a composite's text model, minimax_m3_vl_text in
        # minimax_m3_vl) with no expert converter of its own: the class's per-expert names are those of the type
        # whose modeling file defines it, so one replacement class has one set of names whichever type asks first
        fused = _split_builtins(home)[0]
    gated = {c.flags["has_gate"] for c in classes}
    if len(gated) > 1:
        why = why or "its experts classes differ in has_gate"
    if True in gated:
        gate_up = fused.get("gate_up_proj", ["gate_proj", "up_proj"])
        names: tuple[str, ...] = (*gate_up, fused.get("down_proj", ["down_proj"])[0])
    else:
        names = (fused.get("up_proj", ["up_proj"])[0], fused.get("down_proj", ["down_proj"])[0])
    subclass = _undecorated_subclass(home or "", classes)
    if subclass and not why:
        why = (
            f"{subclass[0]}, the experts module the model builds, subclasses the decorated {subclass[1]} and adds "
            "its own forward and parameters (e.g. a per-expert post-expert norm): a replacement of the decorated "
            "class is never built, and a ModuleList of per-expert linears has no place for the rest"
        )
    norm = [c.name for c in classes if c.flags["has_post_expert_norm"]]
    if norm and not why:
        why = (
            f"{norm[0]} has a post-expert norm (one parameterised module shared by all experts, applied to each "
            "expert's output), which a ModuleList of per-expert linears has no place for"
        )
    return ExpertsFamily(
        model_type,
        classes[0].name,
        names,
        classes,
        why,
        per_expert_checkpoints=bool(fused) or _class_keyed_expert_converter(home or ""),
    )


class ExpertMLP(nn.Module):
    """One expert: ``down(gating(gate(x), up(x)))`` (``down(act(up(x)))`` without gate); ``x (n, H) -> (n, H)``.

    Linear names follow the family (``names``: ``(gate, up, down)`` or ``(up, down)``). ``gating`` is the
    original class's ``_apply_gate`` applied to ``gate`` and ``up`` laid out as the fused tensor has them
    (concatenated, or alternating when ``interleaved``) with this module as ``self`` (it carries the attributes the
    function reads, ``attributes``); ``None`` is the default ``act_fn(gate) * up``. ``act``: an ``ACT2FN`` name or
    an activation module / function.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: Any,
        names: tuple[str, ...],
        *,
        bias: bool = False,
        gating: Callable | None = None,
        interleaved: bool = False,
        attributes: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        self.names = tuple(names)
        self.has_gate = len(self.names) == 3
        *inputs, down = self.names
        for name in inputs:
            setattr(self, name, nn.Linear(hidden_size, intermediate_size, bias=bias))
        setattr(self, down, nn.Linear(intermediate_size, hidden_size, bias=bias))
        self.act_fn = ACT2FN[act] if isinstance(act, str) else act
        self._gating = gating
        self.interleaved = interleaved
        for key, value in (attributes or {}).items():
            if not hasattr(self, key):
                setattr(self, key, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.has_gate:
            up, down = (getattr(self, name) for name in self.names)
            return down(self.act_fn(up(x)))
        gate, up, down = (getattr(self, name) for name in self.names)
        if self._gating is None:
            return down(self.act_fn(gate(x)) * up(x))
        g, u = gate(x), up(x)
        fused = torch.stack((g, u), dim=-1).flatten(-2) if self.interleaved else torch.cat((g, u), dim=-1)
        return down(self._gating(self, fused))


COMPILED_DISPATCHES = ("sparse", "dense")
"""Values of :attr:`LinearExperts.compiled_dispatch` (see the module docstring)."""

_SKIPPED_ATTRIBUTES = frozenset({"training", "config", "num_experts", *_FLAGS})


def _reference(original: type, config, args, kwargs) -> nn.Module:
    with torch.device("meta"):
        return original(config, *args, **kwargs)


def _derive(ref: nn.Module, cls_name: str) -> dict[str, Any]:
    """Shapes, flags and gating of a meta instance of a decorated experts class.

    Raises:
        UnsupportedExpertsError: a post-expert norm, parameters other than the fused ones, or an activation with
            parameters.
    """
    flags = {name: bool(getattr(ref, name, _DEFAULT_FLAGS[name])) for name in _FLAGS}
    if flags["has_post_expert_norm"]:
        raise UnsupportedExpertsError(
            f"{cls_name}: a post-expert norm (one parameterised module shared by all experts) has no place in a "
            "ModuleList of per-expert linears"
        )
    first = "gate_up_proj" if flags["has_gate"] else "up_proj"
    expected = {first, "down_proj"} | ({f"{first}_bias", "down_proj_bias"} if flags["has_bias"] else set())
    found = {name for name, _ in ref.named_parameters()} | {name for name, _ in ref.named_buffers()}
    if found != expected:
        raise UnsupportedExpertsError(
            f"{cls_name}: parameters {sorted(found)}, expected exactly {sorted(expected)} (the fused experts "
            "tensors of its @use_experts_implementation flags)"
        )
    # full shapes: under an open deepspeed.zero.Init (ZeRO-3) the reference is partitioned too, its parameters (0,)
    up = tensor_shape(getattr(ref, first))
    down = tensor_shape(ref.down_proj)  # type: ignore[arg-type]
    if flags["is_transposed"]:
        num, hidden, intermediate = up[0], up[1], down[1]
    else:
        num, hidden, intermediate = up[0], up[2], down[2]
    act = getattr(ref, "act_fn", None)
    if isinstance(act, nn.Module):
        if any(True for _ in act.parameters()) or any(True for _ in act.buffers()):
            raise UnsupportedExpertsError(f"{cls_name}: its activation {type(act).__name__} has parameters")
    gating = getattr(type(ref), "_apply_gate", None)
    if getattr(gating, "__name__", None) == "_default_apply_gate" or not flags["has_gate"]:
        gating = None
    attributes = {
        k: v
        for k, v in vars(ref).items()
        if not k.startswith("_") and k not in _SKIPPED_ATTRIBUTES and isinstance(v, (int, float, bool, str, type(None)))
    }
    return dict(
        flags=flags, num=num, hidden=hidden, intermediate=intermediate, act=act, gating=gating, attributes=attributes
    )


class _ZeroGradients(torch.autograd.Function):
    """``(anchor (0, H), *params) -> (0, H)`` empty rows whose backward gives every ``param`` a zero gradient of its
    own shape and dtype (and ``anchor`` none): the parameters join the graph as a module run on no token would make
    them join, without running it. Works under gradient checkpointing (re-run in the recomputation) and with any
    parameter (PEFT adapters, quantized wrappers' trainable parts)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.params = [(p.shape, p.dtype, p.device, _dtensor_layout(p)) for p in params]
        return anchor.new_zeros(anchor.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *(_zeros(*param) for param in ctx.params))


def _dtensor_layout(param: torch.Tensor) -> tuple | None:
    """``(local shape, mesh, placements, stride)`` of a ``DTensor`` parameter (tensor parallelism), else ``None``."""
    if not (hasattr(param, "device_mesh") and hasattr(param, "placements") and hasattr(param, "to_local")):
        return None
    return (param.to_local().shape, param.device_mesh, param.placements, param.stride())


def _zeros(shape, dtype, device, layout) -> torch.Tensor:
    """A zero gradient for a parameter: a ``DTensor`` of the parameter's layout for a ``DTensor`` parameter (an
    optimizer cannot add a plain tensor to it)."""
    if layout is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    from torch.distributed.tensor import DTensor

    local, mesh, placements, stride = layout
    zeros = torch.zeros(local, dtype=dtype, device=device)
    return DTensor.from_local(zeros, mesh, placements, run_check=False, shape=shape, stride=stride)


@torch.library.custom_op("modelpatch::expert_positions", mutates_args=())
def _expert_positions(by_slot: torch.Tensor, expert_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.where(by_slot == expert_idx)`` as one operator: ``by_slot (k, N)`` long -> ``(top_k_pos (n,),
    token_idx (n,))`` long, ``n`` the number of slots routed to ``expert_idx``.

    What :meth:`LinearExperts._sparse_static` calls under ``torch.compile`` (issue 21, item 11). Traced by Dynamo
    as ``torch.where``, the ``nonzero`` behind it broke the graph unless ``capture_dynamic_output_shape_ops`` was
    set; Dynamo then split every frame above it (a decoder layer compiled once per layer: a recompile per layer
    on the cache's guards) and compiled each expert as a frame of its own, recompiled when its row count met 0 or
    1. As an operator whose fake implementation returns a new unbacked size, the whole loop is one graph with or
    without that option, and no size is ever specialised."""
    top_k_pos, token_idx = torch.where(by_slot == expert_idx)
    return top_k_pos.clone(), token_idx.clone()  # views of one nonzero result: an operator's outputs may not alias


@_expert_positions.register_fake
def _expert_positions_fake(by_slot: torch.Tensor, expert_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    ctx = torch.library.get_ctx()
    shape_env = getattr(ctx, "_shape_env", None)
    if shape_env is None:  # no symbolic shapes: new_dynamic_size raises the usual DynamicOutputShapeException
        n = ctx.new_dynamic_size()
    else:
        # new_dynamic_size without its capture_dynamic_output_shape_ops check, as torch's own device_mesh operator
        # does: the size is a count of slots, bounded by their number
        n = shape_env.create_unbacked_symint()
        bound = by_slot.numel()
        _constrain_range_for_size(n, min=0, max=bound if isinstance(bound, int) else None)
    return by_slot.new_empty(n), by_slot.new_empty(n)


def _sharded_per_expert(experts: nn.ModuleList) -> bool:
    """Whether FSDP2 (``torch.distributed.fsdp.fully_shard``) sharded the expert modules themselves."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return any(isinstance(expert, FSDPModule) for expert in experts)


class LinearExperts(nn.ModuleList):
    """``E`` :class:`ExpertMLP` modules replacing a fused experts class; built with its constructor arguments.

    Subclasses (:func:`linear_experts_class`, one per original class) set ``family`` and ``original``; building one
    builds the original on the ``meta`` device to read its flags, sizes and gating (no memory, no weights).

    ``compiled_dispatch`` (``"sparse"`` or ``"dense"``; set it on an instance to change one layer) chooses the
    formulation traced by ``torch.compile``; eager calls run the sparse loop over the experts hit, then, while
    gradients are recorded, give every other expert's trainable parameters a zero gradient (not ``None``, one
    autograd node, no expert run) as its slice of the fused original does: optimizers step it exactly as they step the original
    (momentum and Adam moments decay, weight decay applies) and ``DistributedDataParallel`` with
    ``find_unused_parameters=False`` sees every parameter used. ``skip_idle_experts = True`` (an explicit opt-out,
    per instance) leaves idle experts out of the graph: their gradients stay ``None`` and optimizers skip them,
    which the fused original never does.

    Raises (on construction):
        UnsupportedExpertsError: the original class cannot be expressed with per-expert linears (the message says
            why: a post-expert norm, other parameters, an activation with parameters).
    """

    family: ClassVar[ExpertsFamily]
    original: ClassVar[ExpertsClass]
    compiled_dispatch: str = "sparse"
    skip_idle_experts: bool = False
    _z3_leaf: bool = True
    """DeepSpeed ZeRO-3's leaf-module flag (``deepspeed.utils.set_z3_leaf_modules``): the experts' parameters are
    fetched together when the module runs, not by a hook per expert linear (the fused original's are one
    parameter each). Also what keeps ZeRO-3 exact here: the eager loop calls only the experts its rank's tokens
    hit, and per-module fetches are collectives every rank must make in the same order."""

    def __init__(self, config, *args, **kwargs):
        super().__init__()
        derived = _derive(_reference(self.original.load(), config, args, kwargs), self.original.name)
        with batched_zero_init():  # under deepspeed.zero.Init: one broadcast for all experts, not one per linear
            self._build(config, derived)

    def _build(self, config, derived: dict[str, Any]) -> None:
        flags = derived["flags"]
        names = self.family.names if flags["has_gate"] else self.family.names[-2:]
        self.num_experts = derived["num"]
        self.hidden_dim = derived["hidden"]
        self.intermediate_dim = derived["intermediate"]
        self.has_bias = flags["has_bias"]
        act = derived["act"]
        if act is None:
            act = ACT2FN[config.hidden_act] if getattr(config, "hidden_act", None) else nn.Identity()
        for _ in range(self.num_experts):
            self.append(
                ExpertMLP(
                    self.hidden_dim,
                    self.intermediate_dim,
                    act,  # one activation module (no parameters, checked) shared by the experts
                    names,
                    bias=flags["has_bias"],
                    gating=derived["gating"],
                    interleaved=not flags["is_concatenated"],
                    attributes=derived["attributes"],
                )
            )

    def modelpatch_tp_plan(self, tp_size: int | None) -> dict[str, str]:
        """Tensor-parallel plan (see :mod:`modelpatch.integrations.tensor_parallel`), Transformers' split of the
        fused experts per expert: each expert's gate/up rows and down columns split over the ranks (``colwise`` /
        ``rowwise`` parameter placements; the expert linears run on their local shards, ``local_params``), the
        experts' summed partial outputs all-reduced once per layer (``moe_tp_experts``, which also sums the input
        gradients).

        Raises:
            TensorParallelError: the experts have biases (a row-split ``down`` bias would be added once per rank).
        """
        from ..integrations.tensor_parallel import TensorParallelError

        if self.has_bias:
            raise TensorParallelError(
                "its experts have biases, which a row-wise split of the down projection would add once per rank"
            )
        first: ExpertMLP = self[0]  # type: ignore[assignment]  # ModuleList indexing is typed as Module
        *inputs, down = first.names
        plan = {"": "moe_tp_experts"}
        for name in inputs:
            plan |= {f"*.{name}.weight": "colwise", f"*.{name}": "local_params"}
        return plan | {f"*.{down}.weight": "rowwise", f"*.{down}": "local_params"}

    @staticmethod
    def _routing(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        values = [*args, *kwargs.values()]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        index = next((t for t in tensors if not t.is_floating_point()), None)
        weights = next((t for t in tensors if t.is_floating_point()), None)
        if index is None or weights is None or len(values) != 2:
            raise ModelpatchValueError(
                "linear experts take (hidden_states, top_k_index, top_k_weights), got "
                f"{[type(v).__name__ for v in values]} after hidden_states"
            )
        return index, weights

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """``hidden_states (N, H)``, ``top_k_index (N, k)`` long (``E`` = no expert), ``top_k_weights (N, k)``
        (positional or by the family's keyword names) -> ``(N, H)`` in ``hidden_states.dtype``.

        Raises:
            ModelpatchValueError: ``compiled_dispatch`` is not one of :data:`COMPILED_DISPATCHES` (under
                ``torch.compile``), or the routing arguments are not an index and a weight tensor.
        """
        top_k_index, top_k_weights = self._routing(args, kwargs)
        if torch.compiler.is_compiling():
            dispatch = self.compiled_dispatch
            if dispatch == "sparse":
                return self._sparse_static(hidden_states, top_k_index, top_k_weights)
            if dispatch == "dense":
                return self._dense(hidden_states, top_k_index, top_k_weights)
            raise ModelpatchValueError(
                f"{type(self).__name__}.compiled_dispatch={dispatch!r}: expected one of {COMPILED_DISPATCHES}"
            )
        if _sharded_per_expert(self):
            # FSDP2 shards each expert module: its pre-forward all-gather and post-backward reduce-scatter are
            # collectives, so every rank calls every expert, in index order, on its tokens (possibly none)
            return self._sparse_static(hidden_states, top_k_index, top_k_weights)
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        hit_experts = [e for e in hit[:, 0].tolist() if e != self.num_experts]
        for expert_idx in hit_experts:
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            out = self[expert_idx](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        if torch.is_grad_enabled() and not self.skip_idle_experts and len(hit_experts) < self.num_experts:
            self._idle_experts(final, hidden_states, set(hit_experts))
        return final

    def _idle_experts(self, final: torch.Tensor, hidden_states: torch.Tensor, hit: set[int]) -> None:
        """Give the trainable parameters of each expert no token reached a zero gradient (not ``None``), as that
        expert's slice of the fused original's parameters gets: one :class:`_ZeroGradients` node over all of
        them, added to ``final`` through an empty ``index_add_`` (no expert runs, no FLOPs). Optimizers then step
        those parameters as they step the fused slice (moments decay, weight decay applies) and DDP's reducer sees
        every parameter. Frozen parameters are left out (they get no gradient either way)."""
        idle = [
            p
            for expert_idx, expert in enumerate(self)
            if expert_idx not in hit
            for p in expert.parameters()
            if p.requires_grad
        ]
        if idle:
            empty = torch.zeros(0, dtype=torch.long, device=hidden_states.device)
            final.index_add_(0, empty, _ZeroGradients.apply(hidden_states[:0], *idle).to(final.dtype))

    def _sparse_static(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The eager loop over a fixed range of experts (no ``tolist``, no skip): each expert sees exactly its
        tokens, in the eager order (by top-k slot, then token), possibly none."""
        final = torch.zeros_like(hidden_states)
        by_slot = top_k_index.t()  # (k, N): torch.where yields slot-major order, as the eager one-hot mask does
        compiling = torch.compiler.is_compiling()
        for expert_idx, expert in enumerate(self):
            if compiling:  # issue 21, item 11: one opaque operator, no graph break (see _expert_positions)
                top_k_pos, token_idx = _expert_positions(by_slot, expert_idx)
            else:
                top_k_pos, token_idx = torch.where(by_slot == expert_idx)
            out = expert(hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def _dense(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every token times its routing weight (exactly the token's weight when routed to it,
        else 0, so the sum is the eager one): static shapes."""
        final = torch.zeros_like(hidden_states)
        for expert_idx, expert in enumerate(self):
            weight = (top_k_weights * (top_k_index == expert_idx)).sum(dim=-1, keepdim=True)
            final += (expert(hidden_states) * weight).to(final.dtype)
        return final


_CLASSES: dict[tuple[str, str, tuple[str, ...]], type[LinearExperts]] = {}


def linear_experts_class(family: ExpertsFamily, original: ExpertsClass | None = None) -> type[LinearExperts]:
    """The replacement class ``Linear<Original>`` of ``original`` (default: the family's first class), created
    once per class and kept as an attribute of this module (so instances pickle)."""
    original = original or family.classes[0]
    key = (original.module, original.name, family.names)
    if key not in _CLASSES:
        name = f"Linear{original.name}"
        if any(other[:2] == key[:2] for other in _CLASSES):  # another type names this class's linears otherwise
            name = f"{name}_{family.model_type}"
        cls = type(
            name,
            (LinearExperts,),
            {
                "family": family,
                "original": original,
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"Per-expert linear replacement of ``{original.name}`` ({original.module}).",
            },
        )
        globals()[name] = cls
        _CLASSES[key] = cls
    return _CLASSES[key]


class _LinearExpertsClasses(Mapping):
    """``{model_type: replacement class}`` for every model type with decorated experts, derived on access."""

    def __getitem__(self, model_type: str) -> type[LinearExperts]:
        try:
            family = experts_family(model_type)
        except UnsupportedExpertsError:
            raise KeyError(model_type) from None
        return linear_experts_class(family)

    def __iter__(self) -> Iterator[str]:
        return iter(experts_model_types())

    def __len__(self) -> int:
        return len(experts_model_types())

    def __repr__(self) -> str:
        return f"LINEAR_EXPERTS_CLASSES({len(self)} model types, derived on access)"


LINEAR_EXPERTS_CLASSES: Mapping[str, type[LinearExperts]] = _LinearExpertsClasses()
"""``{model_type: replacement class}`` (``LINEAR_EXPERTS_CLASSES["mixtral"].__name__ == "LinearMixtralExperts"``),
derived when looked up."""


def _conversion_rules(family: ExpertsFamily) -> list:
    """The rules of ``family``: Transformers' other rules (renamings of the per-expert layout), then the fused
    layout's converters (see the module docstring)."""
    from transformers import core_model_loading as _tcml

    group = f"{family.model_type}-experts"
    # the default layout (saved by a model built from a config, or loaded from neither layout) is the one
    # Transformers' own save_pretrained writes for the type, so plain Transformers loads it
    hub = family.per_expert_checkpoints
    per_expert, fused = Layout(group, "per-expert", default=hub), Layout(group, "fused", default=not hub)
    _, others, _ = _split_builtins(family.model_type)
    rules: list = []
    for rule in others:
        if isinstance(rule, _tcml.PrefixChange):
            continue  # a change of the base-model prefix, which Transformers applies itself
        if type(rule) is _tcml.WeightRenaming:
            sources, targets = list(rule._original_source_patterns), list(rule._original_target_patterns)
            rules.append(LayoutWeightRenaming(sources, targets, layout=per_expert))
        else:
            rules.append(as_modelpatch_rule(rule))
    flags = family.flags
    swap = [SwapDims(1, 2)] if flags["is_transposed"] else []
    split = Chunk(dim=1) if flags["is_concatenated"] else Deinterleave(dim=1)
    suffixes = ["weight"] + (["bias"] if flags["has_bias"] else [])
    if flags["has_gate"]:
        gate, up, down = family.names
        first, inputs, split_ops = "gate_up_proj", [gate, up], [split]
    else:
        up, down = family.names[-2:]
        first, inputs, split_ops = "up_proj", [up], []
    for suffix in suffixes:
        fused_name = "" if suffix == "weight" else "_bias"
        ops = (swap if suffix == "weight" else []) + split_ops + [SplitModulelist(dim=0)]
        targets = [f"experts.*.{name}.{suffix}" for name in inputs]
        rules.append(LayoutWeightConverter(f"experts.{first}{fused_name}", targets, ops, layout=fused))
        down_ops = (swap if suffix == "weight" else []) + [SplitModulelist(dim=0)]
        rules.append(
            LayoutWeightConverter(
                f"experts.down_proj{fused_name}", f"experts.*.{down}.{suffix}", down_ops, layout=fused
            )
        )
    return rules


def _check_supported(family: ExpertsFamily) -> None:
    if family.unsupported:
        raise UnsupportedExpertsError(f"no linear-experts recipe for {family.model_type!r}: {family.unsupported}")


def linear_experts_recipe(family: ExpertsFamily | str, *, from_fused: bool = False) -> Recipe:
    """The per-expert recipe ``<model_type>-linear-experts`` of ``family`` (an :class:`ExpertsFamily` or a
    ``model_type``): loads per-expert and fused checkpoints alike, saves the layout loaded.

    ``from_fused`` is accepted for old code and changes nothing (the recipe loads both layouts).

    Raises:
        UnsupportedExpertsError: the model type has no decorated experts class, or it cannot be supported (the
            message says why).
    """
    family = experts_family(family) if isinstance(family, str) else family
    _check_supported(family)
    mapping = {c.name: linear_experts_class(family, c) for c in family.classes}
    names = "/".join(family.names)
    return Recipe(
        name=f"{family.model_type}-linear-experts",
        description=f"{', '.join(mapping)} -> ModuleList of per-expert nn.Linear ({names}); per-expert or fused "
        "checkpoints, saved in the layout loaded",
        patch_mapping=mapping,
        conversion={family.model_type: RuleSpec(functools.partial(_conversion_rules, family), overwrite=True)},
        model_types=(family.model_type,),
    )


def generic_linear_experts_recipe() -> Recipe:
    """``linear-experts``: the recipes of every supported model type at once (a model of any of them gets its
    experts replaced and its rules). Derived from source text when called (no modeling module imported)."""
    mapping: dict[str, type[LinearExperts]] = {}
    conversion: dict[str, RuleSpec] = {}
    types = []
    for model_type in experts_model_types():
        family = experts_family(model_type)
        if family.unsupported:
            continue
        if any(c.name in mapping and mapping[c.name].family.names != family.names for c in family.classes):
            continue  # its class is replaced by name for another type that names the linears otherwise: own recipe
        for c in family.classes:
            mapping.setdefault(c.name, linear_experts_class(family, c))
        conversion[model_type] = RuleSpec(functools.partial(_conversion_rules, family), overwrite=True)
        types.append(model_type)
    return Recipe(
        name="linear-experts",
        description="every @use_experts_implementation experts class -> ModuleList of per-expert nn.Linear",
        patch_mapping=mapping,
        conversion=conversion,
        model_types=tuple(types),
    )


def __getattr__(name: str):
    if name == "FAMILIES":  # derived when asked for: every model type with decorated experts
        return tuple(experts_family(mt) for mt in experts_model_types())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
