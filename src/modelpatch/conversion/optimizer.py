"""Optimizer state in the original layout: a run resumes across layouts.

A patched model's weights leave in the checkpoint layout (``save_pretrained``, :func:`~modelpatch.iter_original_state_dict`);
its optimizer's state is keyed by the patched model's own parameters (``qkv_proj``, one ``nn.Linear`` per expert).
This module moves an optimizer state dict (torch's ``optimizer.state_dict()``: ``{"state": {index: {key: value}},
"param_groups": [{..., "params": [index, ...]}]}``) between the model's own layout and the **original layout**:
the state dict the same optimizer would have over the *unpatched* model's parameters (its class built from the
same config), indexed in the order of those parameters within each param group. That is what an unpatched run
writes (the Trainer's ``optimizer.pt``) and reads back.

What moves, parameter by parameter:

* per-element state, a tensor of its parameter's shape (SGD ``momentum_buffer``, Adam/AdamW ``exp_avg``,
  ``exp_avg_sq``, ``max_exp_avg_sq``), goes through the same rules as the weights, both stages: to the checkpoint
  layout as :func:`~modelpatch.iter_original_state_dict` takes the weights (:mod:`.saving`, group by group), then
  from it to the target layout as a load converts them (the target's rules and Transformers' built-in converters
  in force for it, e.g. per-expert tensors fused into ``gate_up_proj`` for the unpatched model);
* any other value (the scalar ``step``, floats, ``None``) is per parameter: copied to each parameter made from it,
  and the parameters merged into one must agree on it;
* state of another shape (Adafactor's factored ``row_var``/``col_var``) is copied where no operation changes its
  parameter (a parameter the layouts share) and refused on a converted parameter: it describes rows and columns of
  one tensor, which a fused or split tensor does not have.

Which parameters belong together (a *unit*: the parameters of both layouts one conversion group links, e.g. a
fused ``qkv_proj`` and its ``q_proj``/``k_proj``/``v_proj``, or a layer's per-expert ``gate_proj``/``up_proj`` and
its ``gate_up_proj``) is found on ``meta`` tensors from the conversions' own record of what each output was made
from (:attr:`.streaming.OriginalLayoutIterator.sources`), before any state is read. A unit is in the optimizer as
a whole and in one param group, or refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ModelpatchTypeError
from ..lazy_imports import pretrained_model_class
from .compose import ResolvedRules, resolve_model_rules
from .errors import ConversionError, OptimizerStateError
from .loading import model_key
from .manual import builtin_transforms, resolve_transforms
from .plan import build_plan
from .reference import state_shapes, vanilla_meta_model
from .saving import iter_original_state_dict, original_layout
from .state import get_state
from .streaming import iter_reverted, transformers_conversions

__all__ = [
    "original_optimizer_state_dict",
    "load_original_optimizer_state_dict",
    "optimizer_state_dict_in_model_layout",
    "carries_own_layout",
]

_WAY_OUT_FACTORED = (
    "Keep this optimizer's state in the model's own layout (torch.save(optimizer.state_dict()) and resume with the "
    "same recipe; the loaders here accept it as it is), or train with an optimizer whose state is per element (SGD, "
    "Adam, AdamW)."
)


_PENDING = object()  # a per-element value not converted yet


@dataclass
class _Unit:
    """Parameters of both layouts that one conversion group links (``model``: the model's own names, ``original``:
    the unpatched model's, each in its model's ``named_parameters`` order); ``operated``: an operation, not only a
    renaming, lies between them."""

    model: list[str] = field(default_factory=list)
    original: list[str] = field(default_factory=list)
    operated: bool = False

    @property
    def shared(self) -> bool:
        """One parameter on each side, no operation between: any state copies as it is."""
        return len(self.model) == 1 and len(self.original) == 1 and not self.operated


@dataclass
class _Layouts:
    model: Any
    vanilla: Any
    model_shapes: dict[str, torch.Size]  # named_parameters order
    vanilla_shapes: dict[str, torch.Size]
    units: list[_Unit]
    of_model: dict[str, _Unit]
    of_original: dict[str, _Unit]

    def shapes(self, side: str) -> dict[str, torch.Size]:
        return self.model_shapes if side == "model" else self.vanilla_shapes

    def unit(self, side: str, name: str) -> _Unit:
        return (self.of_model if side == "model" else self.of_original)[name]


def carries_own_layout(model) -> bool:
    """Whether ``model``'s parameters may be in a layout of their own (it carries conversion state, or user rules
    are in effect for it): the optimizer state then moves through :func:`original_optimizer_state_dict`."""
    return get_state(model) is not None or resolve_model_rules(model) is not None


def _describe(model, side: str) -> str:
    name = type(model).__name__
    return (
        f"the layout of this {name} (its own parameters)"
        if side == "model"
        else f"the original layout (unpatched {name})"
    )


def _meta(named) -> dict[str, torch.Tensor]:
    return {name: torch.empty(p.shape, dtype=p.dtype, device="meta") for name, p in named}


def _provenance(iterator) -> dict[str, tuple[tuple[str, ...], bool]]:
    for _ in iterator:  # meta tensors: names only
        pass
    return iterator.sources


def _layouts(model) -> _Layouts | None:  # noqa: C901 - refusals and the units of both layouts in the order each depends on the last
    """The units of ``model`` and its unpatched class, or ``None`` when the model has no layout of its own."""
    if not isinstance(model, pretrained_model_class()):
        raise ModelpatchTypeError(
            f"optimizer state in the original layout takes a transformers PreTrainedModel, got {type(model).__name__} "
            "(for a DDP/FSDP wrapper pass the model it wraps: model.module)"
        )
    if not carries_own_layout(model):
        return None
    if getattr(model, "_hf_peft_config_loaded", False):
        raise OptimizerStateError(
            f"{type(model).__name__} has PEFT adapters loaded through Transformers (model.load_adapter), whose "
            "parameters the original layout does not have. Keep this optimizer's state in the model's own layout "
            "(optimizer.state_dict())."
        )
    vanilla = vanilla_meta_model(model)
    if vanilla is None:
        raise OptimizerStateError(
            f"The unpatched {type(model).__name__} cannot be built from the model's config, so the original layout of "
            "its optimizer state is unknown. Save the optimizer state in the model's own layout (optimizer.state_dict())."
        )
    model_named = list(model.named_parameters())
    vanilla_named = list(vanilla.named_parameters())
    own = _meta(model_named)
    for key in model._keys_to_ignore_on_save or ():
        own.pop(key, None)
    try:
        from_model = _provenance(original_layout(model, own))
        theirs = _meta(vanilla_named)
        from_vanilla = _provenance(iter_reverted(vanilla, theirs, transformers_conversions(vanilla), None))
    except ConversionError as exc:
        raise OptimizerStateError(
            f"The layouts of {type(model).__name__} cannot be matched parameter by parameter: {exc}"
        ) from exc
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(node):
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    operated: set[tuple[str, str]] = set()
    for side, provenance in (("model", from_model), ("original", from_vanilla)):
        for name, (sources, made) in provenance.items():
            node = find(("checkpoint", name))
            for source in sources:
                parent[find((side, source))] = node
            if made:
                operated.add(("checkpoint", name))
    for name, _ in model_named:
        find(("model", name))
    for name, _ in vanilla_named:
        find(("original", name))
    units: dict[tuple[str, str], _Unit] = {}
    for name, _ in model_named:
        units.setdefault(find(("model", name)), _Unit()).model.append(name)
    for name, _ in vanilla_named:
        units.setdefault(find(("original", name)), _Unit()).original.append(name)
    for node in operated:
        if find(node) in units:
            units[find(node)].operated = True
    of_model = {name: unit for unit in units.values() for name in unit.model}
    of_original = {name: unit for unit in units.values() for name in unit.original}
    return _Layouts(
        model,
        vanilla,
        {name: p.shape for name, p in model_named},
        {name: p.shape for name, p in vanilla_named},
        list(units.values()),
        of_model,
        of_original,
    )


def _optimizer_names(layouts: _Layouts, optimizer) -> list[list[str]]:
    """The model's names of ``optimizer``'s parameters, per param group."""
    names = {id(p): name for name, p in layouts.model.named_parameters()}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        found = []
        for i, param in enumerate(group["params"]):
            if id(param) not in names:
                raise OptimizerStateError(
                    f"param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)}) is not a parameter of "
                    f"{type(layouts.model).__name__}: only the model's own parameters have a place in the original "
                    "layout. Give the optimizer the model's parameters only."
                )
            found.append(names[id(param)])
        groups.append(found)
    return groups


def _original_groups(layouts: _Layouts, groups: list[list[str]]) -> list[list[str]]:
    """The unpatched model's names of the same optimizer, per param group, in its ``named_parameters`` order; every
    unit must be in the optimizer whole, in one group, and have a place in both layouts."""
    group_of = {name: g for g, names in enumerate(groups) for name in names}
    chosen: dict[int, int] = {}
    describe = _describe(layouts.model, "model")
    for unit in layouts.units:
        present = [name for name in unit.model if name in group_of]
        if not present:
            continue
        absent = [name for name in unit.model if name not in group_of]
        if absent:
            raise OptimizerStateError(
                f"'{present[0]}' ({describe}) is in the optimizer but '{absent[0]}', which the original layout "
                f"merges with it into {unit.original}, is not. Give the optimizer all of {unit.model} or none.",
                present[0],
                "model",
            )
        in_groups = sorted({group_of[name] for name in present})
        if len(in_groups) > 1:
            other = next(name for name in present if group_of[name] != group_of[present[0]])
            raise OptimizerStateError(
                f"'{present[0]}' (param group {group_of[present[0]]}) and '{other}' (param group {group_of[other]}) "
                f"({describe}) are one tensor in the original layout ({unit.original}), which can be in one param "
                "group only. Put the parameters of one conversion group in one param group (same lr, weight decay).",
                present[0],
                "model",
            )
        if not unit.original:
            raise OptimizerStateError(
                f"'{present[0]}' ({describe}) has no counterpart in the original layout (the unpatched "
                f"{type(layouts.model).__name__} has no parameter made from it). Keep this optimizer's state in the "
                "model's own layout (optimizer.state_dict()).",
                present[0],
                "model",
            )
        chosen[id(unit)] = in_groups[0]
    orphan = next((unit for unit in layouts.units if unit.original and not unit.model), None)
    if orphan is not None and chosen:
        raise OptimizerStateError(
            f"'{orphan.original[0]}' ({_describe(layouts.model, 'original')}) is made from no parameter of this model, "
            "so the original layout of its optimizer state is unknown (an unpatched optimizer steps it). Keep this "
            "optimizer's state in the model's own layout (optimizer.state_dict()).",
            orphan.original[0],
            "original",
        )
    result: list[list[str]] = [[] for _ in groups]
    for name in layouts.vanilla_shapes:
        unit = layouts.of_original[name]
        if id(unit) in chosen:
            result[chosen[id(unit)]].append(name)
    return result


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    return bool(a == b)


def _kind(value, shape: torch.Size) -> str:
    """``"element"``: a tensor of the parameter's shape; ``"scalar"``: a 0-d tensor or any other value;
    ``"wrong"``: a tensor of the parameter's rank whose sizes are neither the parameter's nor 1 (another model's);
    ``"other"``: any other tensor (factored state: Adafactor's ``row_var`` ``[..., rows, 1]``)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 and len(shape) > 0:
        return "scalar"
    if value.shape == shape:
        return "element"
    if value.dim() == len(shape) and any(v not in (s, 1) for v, s in zip(value.shape, shape)):
        return "wrong"
    return "other"


def _wrong_shape(layouts: _Layouts, side: str, name: str, key: str, value: torch.Tensor) -> OptimizerStateError:
    shape = tuple(layouts.shapes(side)[name])
    return OptimizerStateError(
        f"Optimizer state '{key}' of '{name}' ({_describe(layouts.model, side)}) has shape {tuple(value.shape)}, "
        f"which fits neither the parameter's shape {shape} nor factored state of it: the state dict is of another "
        "model or layout. Pass the state dict of the same optimizer over this model's parameters, or over the "
        "unpatched model's.",
        name,
        side,
    )


def _copy(value, times: int):
    return value.clone() if isinstance(value, torch.Tensor) and times > 1 else value


def _convert(  # noqa: C901 - one walk over the parameter groups; each branch is one case of a unit's state (moved, split, merged, kept)
    layouts: _Layouts,
    side: str,
    state: dict[str, dict],
    names: list[list[str]],
    targets: list[list[str]],
) -> dict[str, dict]:
    """``{target name: per-parameter state}`` of ``state`` (``{name: per-parameter state}`` in layout ``side``)."""
    other = "original" if side == "model" else "model"
    shapes = layouts.shapes(side)
    describe = _describe(layouts.model, side)
    per_element: dict[str, dict[str, torch.Tensor]] = {}  # state key -> {name: tensor}
    result: dict[str, dict] = {}
    wanted = {name for group in targets for name in group}
    units = {id(layouts.unit(side, name)): layouts.unit(side, name) for group in names for name in group}
    for unit in units.values():
        mine = getattr(unit, side)
        theirs = [name for name in getattr(unit, other) if name in wanted]
        with_state = [name for name in mine if state.get(name)]
        if not with_state:
            continue
        if len(with_state) < len(mine):
            missing = next(name for name in mine if not state.get(name))
            raise OptimizerStateError(
                f"'{with_state[0]}' ({describe}) has optimizer state but '{missing}', which the other layout makes one "
                f"tensor with, has none (a parameter the optimizer has not stepped yet). Step every parameter of "
                f"{mine} together (a zero gradient, not None) before converting the state.",
                missing,
                side,
            )
        keys = list(state[mine[0]])
        for name in mine[1:]:
            if set(state[name]) != set(keys):
                raise OptimizerStateError(
                    f"'{mine[0]}' and '{name}' ({describe}) hold different optimizer state keys ({sorted(keys)} and "
                    f"{sorted(state[name])}); the parameters one tensor is made of must have the same state.",
                    name,
                    side,
                )
        for name in theirs:
            result[name] = {}
        for key in keys:
            values = [state[name][key] for name in mine]
            kinds = [_kind(value, shapes[name]) for name, value in zip(mine, values)]
            if all(kind == "element" for kind in kinds):
                for name, value in zip(mine, values):
                    per_element.setdefault(key, {})[name] = value
                for name in theirs:
                    result[name][key] = _PENDING  # keeps the key order
                continue
            if unit.shared and ("other" in kinds or "wrong" in kinds):  # a parameter both layouts share
                result[theirs[0]][key] = values[0]
                continue
            if "wrong" in kinds:
                name = mine[kinds.index("wrong")]
                raise _wrong_shape(layouts, side, name, key, state[name][key])
            if "other" in kinds:
                name = mine[kinds.index("other")]
                raise OptimizerStateError(
                    f"Optimizer state '{key}' of '{name}' ({describe}) has shape {tuple(state[name][key].shape)}, not "
                    f"the parameter's {tuple(shapes[name])}: factored state (e.g. Adafactor's row_var/col_var) describes the "
                    f"rows and columns of that one tensor, which the other layout splits or fuses "
                    f"({getattr(unit, other)}), so it cannot be converted (and per-element state of another shape "
                    f"is not this model's). {_WAY_OUT_FACTORED}",
                    name,
                    side,
                )
            if "element" in kinds:
                name = mine[kinds.index("scalar")]
                raise OptimizerStateError(
                    f"Optimizer state '{key}' is a tensor of the parameter's shape for '{mine[kinds.index('element')]}'"
                    f" but not for '{name}' ({describe}); the parameters one tensor is made of must have the same "
                    "state.",
                    name,
                    side,
                )
            for name, value in zip(mine[1:], values[1:]):
                if not _same(values[0], value):
                    raise OptimizerStateError(
                        f"Optimizer state '{key}' differs between '{mine[0]}' ({values[0]!r}) and '{name}' "
                        f"({value!r}) ({describe}), which the other layout makes one tensor: it has one value for "
                        "them. Step every parameter of the group together (a zero gradient, not None).",
                        name,
                        side,
                    )
            for name in theirs:
                result[name][key] = _copy(values[0], len(theirs))
    for key, tensors in per_element.items():
        converted = _move(layouts, side, tensors)
        for name, value in result.items():
            if value.get(key) is _PENDING:
                if name not in converted:
                    raise OptimizerStateError(
                        f"Converting optimizer state '{key}' like the weights produced no '{name}' "
                        f"({_describe(layouts.model, other)}); the layouts do not match parameter by parameter.",
                        name,
                        other,
                    )
                value[key] = converted[name]
    return result


def _move(layouts: _Layouts, side: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (whole units, layout ``side``) in the other layout, through the checkpoint layout."""
    try:
        if side == "model":
            checkpoint = dict(iter_original_state_dict(layouts.model, tensors))
            rules, renamings = builtin_transforms(layouts.vanilla, ResolvedRules())
            target, shapes = layouts.vanilla, layouts.vanilla_shapes
        else:
            vanilla = layouts.vanilla
            checkpoint = dict(iter_reverted(vanilla, tensors, transformers_conversions(vanilla), None))
            resolved, renamings = resolve_transforms(layouts.model, None)
            rules, target, shapes = resolved.rules, layouts.model, layouts.model_shapes
        plan = build_plan(list(checkpoint.items()), rules, key_renamings=renamings)
        del checkpoint
        references = state_shapes(((k, tuple(v)) for k, v in shapes.items()), target.base_model_prefix)
        plan.dry_run(references)
        with torch.no_grad():
            converted = plan.convert_all(references)
    except OptimizerStateError:
        raise
    except ConversionError as exc:
        raise OptimizerStateError(f"The optimizer state cannot be converted like the weights: {exc}") from exc
    result = {}
    for name, tensor in converted.items():
        key = model_key(name, shapes, target.base_model_prefix)
        if key is None or tuple(tensor.shape) != tuple(shapes[key]):
            raise OptimizerStateError(
                f"Converting the optimizer state produced '{name}' of shape {tuple(tensor.shape)}, which is not a "
                f"parameter of {_describe(layouts.model, 'original' if side == 'model' else 'model')}.",
                name,
            )
        result[key] = tensor
    return result


def _assemble(saved: dict, names: list[list[str]], state: dict[str, dict], hyper_groups: list[dict]) -> dict[str, Any]:
    """A torch optimizer state dict: parameters indexed in ``names`` order, groups' settings from ``hyper_groups``."""
    result_state: dict[int, dict] = {}
    groups = []
    index = 0
    for group_names, group in zip(names, hyper_groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        indices = []
        for name in group_names:
            if name in state:
                result_state[index] = state[name]
            indices.append(index)
            index += 1
        settings["params"] = indices
        if "param_names" in group:
            settings["param_names"] = list(group_names)
        groups.append(settings)
    return {
        **{k: v for k, v in saved.items() if k not in ("state", "param_groups")},
        "state": result_state,
        "param_groups": groups,
    }


def _by_name(saved: dict, names: list[list[str]], describe: str) -> dict[str, dict]:
    """``{name: per-parameter state}`` of a torch optimizer state dict whose groups hold ``names``."""
    index_name: dict[int, str] = {}
    for group, group_names in zip(saved["param_groups"], names):
        index_name.update(zip(group["params"], group_names))
    unknown = [index for index in saved["state"] if index not in index_name]
    if unknown:
        raise OptimizerStateError(
            f"The optimizer state dict has state for parameter index {unknown[0]}, which no param group lists "
            f"({describe}). Pass a state dict written by optimizer.state_dict()."
        )
    return {index_name[index]: value for index, value in saved["state"].items()}


def original_optimizer_state_dict(model, optimizer) -> dict[str, Any]:
    """``optimizer``'s state dict in the original layout: what the same optimizer over the *unpatched* model's
    parameters would return from ``state_dict()``, for a checkpoint an unpatched run resumes from (and
    :func:`load_original_optimizer_state_dict` loads into a patched model).

    Param groups keep their settings and order; each holds the unpatched parameters made from its own (in the
    unpatched model's ``named_parameters`` order, as ``torch.optim`` and the Trainer order them), indexed from 0
    across the groups as torch indexes. Per-element state (tensors of the parameter's shape and dtype: SGD
    ``momentum_buffer``, Adam/AdamW ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``) is converted by the weights'
    rules, e.g. ``exp_avg`` of a fused ``qkv_proj.weight`` ``[q+2kv, hidden]`` is split into three tensors of
    ``[q, hidden]``/``[kv, hidden]``, and per-expert ``[intermediate, hidden]`` tensors are stacked into
    ``[experts, 2 * intermediate, hidden]``; scalars (``step``) are copied (cloned where one becomes several).
    Converted tensors are new; state the layouts share is the optimizer's own tensor (as torch's
    ``state_dict()`` returns it: copy it before the next step if it must not change). A model without a layout
    of its own (no conversion state, no rule in effect) returns ``optimizer.state_dict()`` itself.

    Args:
        model: the (patched) ``PreTrainedModel`` whose parameters ``optimizer`` steps (unwrap DDP/FSDP first).
        optimizer: a ``torch.optim.Optimizer`` (or a wrapper with ``param_groups`` and ``state_dict()``, e.g.
            accelerate's) over parameters of ``model``.

    Returns:
        ``{"state": {index: {key: value}}, "param_groups": [...]}`` in the original layout.

    Raises:
        OptimizerStateError: a parameter of the optimizer is not the model's; the parameters of one conversion
            group are not all in the optimizer, or in different param groups; factored state (Adafactor's
            ``row_var``/``col_var``) or state of another shape on a converted parameter; parameters merged into
            one disagree on a scalar (``step``) or have state for some only; the model has PEFT adapters loaded
            through Transformers, or a parameter of one layout has no counterpart in the other. Each names the
            parameter, its layout and the way out. Nothing is changed.
        ModelpatchTypeError: ``model`` is not a ``PreTrainedModel``.
    """
    saved = optimizer.state_dict()
    layouts = _layouts(model)
    if layouts is None:
        return saved
    names = _optimizer_names(layouts, optimizer)
    targets = _original_groups(layouts, names)
    state = _by_name(saved, names, _describe(model, "model"))
    converted = _convert(layouts, "model", state, names, targets)
    return _assemble(saved, targets, converted, saved["param_groups"])


def _mismatch(saved: dict, names: list[list[str]]) -> str | None:
    """Why ``saved``'s param groups are not those of an optimizer over ``names`` (``None``: they fit)."""
    groups = saved["param_groups"]
    if len(groups) != len(names):
        return f"{len(groups)} param group(s), not {len(names)}"
    for g, (group, group_names) in enumerate(zip(groups, names)):
        if len(group["params"]) != len(group_names):
            return f"param group {g} has {len(group['params'])} parameters, not {len(group_names)}"
    return None


def _shape_misfits(saved: dict, names: list[list[str]], shapes: dict[str, torch.Size]) -> int:
    """How many state tensors of ``saved`` (groups holding ``names``) fit neither their parameter's shape nor factored
    state of it."""
    index_name: dict[int, str] = {}
    for group, group_names in zip(saved["param_groups"], names):
        index_name.update(zip(group["params"], group_names))
    misfits = 0
    for index, value in saved["state"].items():
        shape = shapes.get(index_name.get(index, ""))
        if shape is not None:
            misfits += sum(_kind(tensor, shape) == "wrong" for tensor in value.values())
    return misfits


def optimizer_state_dict_in_model_layout(model, optimizer, state_dict: dict) -> dict[str, Any]:
    """``state_dict`` (an optimizer state dict in the original layout, see :func:`original_optimizer_state_dict`,
    or in the model's own) as a state dict of ``optimizer`` over ``model``'s own parameters, ready for
    ``optimizer.load_state_dict``. Neither ``optimizer`` nor ``state_dict`` is changed.

    The layout is told from the param groups' sizes (and the state's shapes where both layouts have as many
    parameters): the original layout is converted (per-element state by the weights' rules, scalars copied to every
    parameter made from them, each its own tensor), the model's own is returned as it is. The param groups take
    their settings from ``state_dict`` (as ``load_state_dict`` does) and ``optimizer``'s parameters.

    Raises:
        OptimizerStateError: ``state_dict`` fits neither layout (its param groups or state shapes are another
            optimizer's); factored state or state of another shape on a converted parameter (Adafactor);
            parameters merged into one by the model disagree on a scalar, or have state for some only; the
            optimizer's own parameters do not form whole conversion groups in one param group. Each names the
            parameter, its layout and the way out.
        ModelpatchTypeError: ``model`` is not a ``PreTrainedModel``.
    """
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise OptimizerStateError(
            f"Not an optimizer state dict (keys {sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__}):"
            " pass what optimizer.state_dict() returns ({'state': ..., 'param_groups': ...})."
        )
    layouts = _layouts(model)
    if layouts is None:
        return state_dict
    names = _optimizer_names(layouts, optimizer)
    originals = _original_groups(layouts, names)
    as_original, as_own = _mismatch(state_dict, originals), _mismatch(state_dict, names)
    if as_original is None and as_own is None:  # as many parameters in both: the shapes tell
        own_misfits = _shape_misfits(state_dict, names, layouts.model_shapes)
        original = _shape_misfits(state_dict, originals, layouts.vanilla_shapes) <= own_misfits
    else:
        original = as_original is None
    if original:
        state = _by_name(state_dict, originals, _describe(model, "original"))
        converted = _convert(layouts, "original", state, originals, names)
        return _assemble(state_dict, names, converted, state_dict["param_groups"])
    if as_own is None:  # loaded as it is, as without modelpatch
        _by_name(state_dict, names, _describe(model, "model"))  # every state index listed
        return state_dict
    counts = [len(group["params"]) for group in state_dict["param_groups"]]
    raise OptimizerStateError(
        f"The optimizer state dict (param groups of {counts} parameters) is in neither layout of "
        f"{type(model).__name__}'s optimizer: as {_describe(model, 'original')} ({[len(g) for g in originals]}): "
        f"{as_original}; as {_describe(model, 'model')} ({[len(g) for g in names]}): {as_own}. Pass the state dict "
        "of the same optimizer over this model's parameters, or over the unpatched model's (same param groups)."
    )


def load_original_optimizer_state_dict(model, optimizer, state_dict: dict) -> None:
    """Load ``state_dict`` (in the original layout, as an unpatched run saved it, or in the model's own) into
    ``optimizer`` over the (patched) ``model``'s parameters: ``optimizer.load_state_dict`` of
    :func:`optimizer_state_dict_in_model_layout`. Every check runs before the optimizer is touched.

    Args:
        model: the (patched) ``PreTrainedModel`` whose parameters ``optimizer`` steps.
        optimizer: a ``torch.optim.Optimizer`` over parameters of ``model``, with the same param groups as the
            optimizer that wrote ``state_dict`` (the Trainer's decay / no-decay groups: the same on both sides).
        state_dict: ``{"state": ..., "param_groups": ...}`` as ``optimizer.state_dict()`` returns it.

    Raises:
        OptimizerStateError: see :func:`optimizer_state_dict_in_model_layout`; the optimizer is unchanged.
        ModelpatchTypeError: ``model`` is not a ``PreTrainedModel``.
    """
    optimizer.load_state_dict(optimizer_state_dict_in_model_layout(model, optimizer, state_dict))
