"""Which experts classes a model type has, and how its checkpoints name the experts: read from Transformers' sources
and conversion table, nothing written per family.

Nothing here is written per family. For a ``model_type`` the decorated classes are found in its modeling module's
source text (cheap: no modeling module is imported until a recipe is applied), the per-expert names in
Transformers' own conversion mapping of that type (the source patterns of the converter that fuses
``experts.*.<name>.weight`` into ``experts.gate_up_proj`` / ``experts.down_proj``: ``gate_proj/up_proj/down_proj``
for Qwen, ``w1/w3/w2`` for Mixtral; ``gate_proj/up_proj/down_proj`` for families whose checkpoints are fused
already, e.g. gpt-oss). The replacement of class ``<X>`` is ``Linear<X>`` (:class:`LinearExperts`): built with the
original's constructor arguments, it builds the original on the ``meta`` device, reads its flags, shapes and the
attributes its ``_apply_gate`` uses, and holds ``E`` :class:`ExpertMLP` modules, expert ``e`` with ``gate``, ``up``
and ``down`` linears (``up`` and ``down`` only without gate; biases where the family has them).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...conversion.rules import original_patterns
from ...errors import ModelpatchError

__all__ = [
    "DEFAULT_FLAGS",
    "FLAGS",
    "ExpertsClass",
    "ExpertsFamily",
    "UnsupportedExpertsError",
    "builtin_rules",
    "experts_family",
    "experts_model_types",
    "modeling_module_name",
    "split_builtins",
]


class UnsupportedExpertsError(ModelpatchError, ValueError):
    """The experts class (or the model type) cannot get per-expert linear experts; the message says why."""


FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
DEFAULT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
DEFAULT_FLAGS["has_post_expert_norm"] = False
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
    flags: Mapping[str, bool] = field(default_factory=lambda: dict(DEFAULT_FLAGS))

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


def modeling_module_name(model_type: str) -> str | None:
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
        flags = dict(DEFAULT_FLAGS)
        flags.update({k: v == "True" for k, v in _FLAG.findall(match.group(1) or "") if k in FLAGS})
        found.append(ExpertsClass(f"transformers.models.{folder}.modeling_{folder}", match.group(2), flags))
    return tuple(found)


@functools.cache
def experts_model_types() -> tuple[str, ...]:
    """Every ``model_type`` of the installed Transformers whose modeling module declares a class decorated with
    ``@use_experts_implementation`` (from the modules' source text; nothing is imported). Sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(mt for mt in sorted(CONFIG_MAPPING_NAMES) if _classes_in(modeling_module_name(mt) or ""))


_EXPERT_TARGET = re.compile(r"experts\.(gate_up_proj|up_proj|down_proj)$")
_PER_EXPERT_SOURCE = re.compile(r"experts\.\*\.(\w+)\.weight$")


def _unescape(pattern: str) -> str:
    return pattern.removeprefix("^").replace("\\.", ".")


def builtin_rules(model_type: str) -> list:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return list(get_checkpoint_conversion_mapping(model_type) or [])


def split_builtins(model_type: str) -> tuple[dict[str, list[str]], list, str | None]:
    """Transformers' rules of ``model_type``: ``({fused name: per-expert names}, other rules, why unsupported)``."""
    from transformers import core_model_loading as _tcml

    names: dict[str, list[str]] = {}
    others = []
    for rule in builtin_rules(model_type):
        written_sources, written_targets = original_patterns(rule)
        targets = [_unescape(t) for t in written_targets]
        fused = [m.group(1) for t in targets if (m := _EXPERT_TARGET.search(t))]
        if not fused or not isinstance(rule, _tcml.WeightConverter):
            others.append(rule)
            continue
        ops = [type(op).__name__ for op in rule.operations]
        sources = [_PER_EXPERT_SOURCE.search(_unescape(s)) for s in written_sources]
        standard = (["MergeModulelist", "Concatenate"], 2) if fused[0] == "gate_up_proj" else (["MergeModulelist"], 1)
        if (ops, len(sources)) != standard or not all(sources):
            return (
                {},
                others,
                (
                    f"Transformers converts its checkpoints' experts with {ops} "
                    f"({written_sources} -> {written_targets}), not from per-expert tensors"
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
    return any(key[:1].isupper() and f"class {key}(" in text and split_builtins(key)[0] for key in table)


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
    classes = _classes_in(modeling_module_name(model_type) or "")
    if not classes:
        raise UnsupportedExpertsError(
            f"model type {model_type!r} has no experts class decorated with @use_experts_implementation in this "
            "Transformers release"
        )
    fused, _, why = split_builtins(model_type)
    home = modeling_module_name(model_type)
    if home and home != model_type and not fused and modeling_module_name(home) == home:
        # a model type sharing another type's experts class (a composite's text model, minimax_m3_vl_text in
        # minimax_m3_vl) with no expert converter of its own: the class's per-expert names are those of the type
        # whose modeling file defines it, so one replacement class has one set of names whichever type asks first
        fused = split_builtins(home)[0]
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


def __getattr__(name: str):
    if name == "FAMILIES":  # derived when asked for: every model type with decorated experts
        return tuple(experts_family(mt) for mt in experts_model_types())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
