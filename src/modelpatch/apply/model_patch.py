"""``patch_model``: swap modules of a model that is already built, carry their weights into the new layout, revert.

Everything else in modelpatch happens while Transformers builds a model; this module patches an existing instance (a
trainer built it, it was loaded with ``device_map``, or patched and unpatched should be compared on the same weights
without loading twice). For each module whose class a patch key matches (the matching of ``apply_patches``: exact
class name or regex, Transformers' modeling classes only):

1. the replacement is built from the original instance: ``Replacement.from_module(original)`` when the replacement
   defines that classmethod, else ``Replacement(*args)`` with the original class's constructor arguments recovered
   from the instance (:func:`constructor_arguments`). It is built on the ``meta`` device: no memory, no
   initialisation;
2. the module's parameters and persistent buffers go through the same exact operations as a checkpoint load
   (:mod:`modelpatch.conversion.transfer`): Transformers' built-in conversions reversed (model layout -> checkpoint
   layout), then the conversion rules forward (checkpoint -> replacement layout). A tensor no rule changes is handed
   over as the same object (no copy: ties stay tied). Each new tensor keeps the dtype and device of its sources, and a
   new parameter ``requires_grad`` as its sources do (sources of mixed ``requires_grad`` are refused);
3. the replacement takes the original's place, and (unless ``keep_original=True``) the original's converted tensors
   are freed, one module at a time.

Everything is checked on ``meta`` tensors first (keys, shapes, constructor arguments, ties, wrappers): an error leaves
the model as it was. :meth:`ModelPatch.revert` (or the exit of its ``with`` block, also on an exception) runs the
inverse operations on the replacement's *current* values, writes them into the original parameter objects, and puts
the same module objects back.

Ideas from: composer's module surgery (``replace_module_classes``, optimizer parameter groups updated), PEFT's
``merge_and_unload`` / ``unload`` (patch a built model, take it back), llm-compressor's ``linearize_moe`` (fused experts
to per-expert Linears after load); unlike them, the weights move through declared, exactly invertible rules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from transformers.utils import logging

from ..conversion.compose import ResolvedRules, resolve_model_rules
from ..conversion.errors import ConversionError
from ..conversion.registry import rulesets_in_force, scoped_rulesets
from ..conversion.rules import rule_layout
from ..conversion.state import STATE_ATTR, ConversionState, get_state, set_state
from ..conversion.transfer import transfer_rules
from ..errors import ModelpatchError, ModelpatchRuntimeError, ModelpatchValueError
from ..patching.registry import build_patch_mapping, registered_patch_mapping
from ..undo import ABSENT, UndoStack
from .swap import (
    InstancePatchError,
    InstancePatchRow,
    Swap,
    constructor_arguments,
    find_targets,
    owned_tensors,
    refuse_dispatched,
    refuse_quantized,
    refuse_wrappers,
    shared_tensors,
    swap_module,
    validate_on_meta,
)

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightTransform

__all__ = [
    "patch_model",
    "ModelPatch",
    "InstancePatchRow",
    "InstancePatchError",
    "OptimizerGroupError",
    "constructor_arguments",
]

logger = logging.get_logger("modelpatch")

_PATCHES_ATTR = "_modelpatch_instance_patches"


class OptimizerGroupError(ModelpatchError, ValueError):
    """:meth:`ModelPatch.update_optimizer` would put one parameter in two parameter groups (its sources sit in
    different groups); the message names the parameter, its sources and their groups. The optimizer was not
    changed."""


@dataclass
class _ModelRecord:
    """Kept on the model while instance patches are active: its conversion state before the first one."""

    base: Any  # the ConversionState before the first active patch, or ABSENT
    patches: list[ModelPatch] = field(default_factory=list)


class ModelPatch:
    """The result of :func:`patch_model`: the swaps made in one model, revertible; also a context manager.

    Attributes:
        report: one :class:`InstancePatchRow` per replaced module (path, classes, key, key map).
        keep_original: whether the originals kept their tensors (revert is then a pointer swap).
        reverted: whether :meth:`revert` ran.
    """

    def __init__(self, model: nn.Module, keep_original: bool) -> None:
        self.model = model
        self.keep_original = keep_original
        self.reverted = False
        self._swaps: list[Swap] = []
        self._undo = UndoStack()
        self._bound: list[WeightTransform] = []  # user rules bound to the model for saving
        self._owner: dict[int, str | None] = {}
        self._recorded: dict[str, tuple[int, ...]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # ``_owner`` is keyed by ``id(rule)``, which a copy or another process does not keep: store the rules
        state = dict(vars(self))
        state["_owner"] = [(rule, self._owner.get(id(rule))) for rule in self._bound]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update({**state, "_owner": {id(rule): name for rule, name in state["_owner"]}})

    @staticmethod
    def of(model: nn.Module) -> list[ModelPatch]:
        """The active (not reverted) patches of ``model``, in patch order. A ``copy.deepcopy`` or unpickled copy of
        a patched model carries its own: their :meth:`revert` and :meth:`update_optimizer` work on the copy."""
        record = vars(model).get(_PATCHES_ATTR)
        return list(record.patches) if record is not None else []

    @property
    def report(self) -> list[InstancePatchRow]:
        return [swap.row for swap in self._swaps]

    def __len__(self) -> int:
        return len(self._swaps)

    def __repr__(self) -> str:
        state = "reverted" if self.reverted else "active"
        return f"<ModelPatch {state}: {len(self._swaps)} module(s) of {type(self.model).__name__} replaced>"

    def __str__(self) -> str:
        lines = [repr(self)]
        width = max((len(s.path) for s in self._swaps), default=4)
        for swap in self._swaps:
            row = swap.row
            moved = sum(len(v) for v in row.key_map.values())
            lines.append(
                f"  {row.path:<{width}}  {row.original.__name__} -> {row.replacement.__qualname__}  [{row.key}]  "
                f"{len(row.key_map)} tensor(s) -> {moved}"
            )
        return "\n".join(lines)

    # -- context manager ----------------------------------------------------------------------------------------
    def __enter__(self) -> ModelPatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.revert()

    # -- revert -------------------------------------------------------------------------------------------------
    def revert(self) -> None:
        """Put the original modules back (the same objects), holding the replacements' current values.

        Each replacement's parameters and buffers go through the inverse operations of the patch (the conversion
        rules reversed with the shapes recorded on the way in, then Transformers' built-in conversions forward) and
        are written into the original parameter objects: bit-identical to before when nothing was trained, else the
        trained values (an optimizer over the original parameters sees them). With ``keep_original=True`` the
        originals kept their own tensors and revert only swaps the modules back: what was trained on the patched
        model is dropped. The model's conversion state is restored (exactly as before once every instance patch of
        the model is reverted). Patches of one model revert in any order; a second call does nothing.

        Replacement tensors no rule provides (``__init__`` values) have no place in the original and are dropped;
        a module whose inverse rules do not give its tensors back (checked on ``meta`` when patching) kept its own
        tensors and is swapped back as it was.

        Raises:
            ModelpatchRuntimeError: a replaced module is no longer where the patch put it (something else swapped
                it), or its tensors are no longer the ones the patch made (keys added, removed or renamed inside it,
                e.g. PEFT's ``base_layer`` / ``lora_A`` wrapping a layer of the replacement: ``merge_and_unload()``
                or ``unload()`` first); nothing is reverted then, the model stays patched and unchanged.
            ConversionError: the replacement's tensors cannot go through the inverse operations (e.g. weights
                quantized after the patch: a quantized tensor cannot be stacked back into a fused parameter); the
                model stays patched.
        """
        if self.reverted:
            return
        moved = [s.path for s in self._swaps if s.parent._modules.get(s.name) is not s.replacement]
        if moved:
            raise ModelpatchRuntimeError(
                f"cannot revert: module(s) {moved} are no longer the replacements patch_model put there (replaced "
                "again by other code); put them back first"
            )
        self._refuse_changed_tensors()
        for swap in reversed(self._swaps):
            if not self.keep_original and swap.reversible:
                self._write_back(swap)
        self._undo.undo()
        for swap in self._swaps:
            swap.replacement = None
            swap.sources = {}
        self.reverted = True
        _forget(self.model, self)

    def _refuse_changed_tensors(self) -> None:
        """Raise :class:`ModelpatchRuntimeError` when a replacement's parameter and buffer keys are no longer the
        ones the patch filled (:attr:`ModuleMove.target_shapes`): the inverse rules would meet keys they do not
        know, or silently drop what was added."""
        for swap in self._swaps:
            assert swap.replacement is not None
            prefix = swap.path + "."
            keys = {prefix + k for k in swap.replacement.state_dict(keep_vars=True)}
            expected = set(swap.move.target_shapes)
            if keys == expected:
                continue
            added, gone = sorted(keys - expected), sorted(expected - keys)
            message = (
                f"cannot revert: the tensors of '{swap.path}' ({type(swap.replacement).__qualname__}) are no longer "
                f"the ones patch_model put there: unexpected keys {added[:4]}{' ...' if len(added) > 4 else ''}, "
                f"missing keys {gone[:4]}{' ...' if len(gone) > 4 else ''}"
            )
            if any(".base_layer." in k or ".lora_" in k for k in added):
                message += (
                    "; PEFT adapters wrap its layers: call merge_and_unload() (keep the trained adapters) or "
                    "unload() (drop them) on the PEFT model first, then revert"
                )
            else:
                message += "; put the layers patch_model built back first"
            raise ModelpatchRuntimeError(message + ". Nothing was reverted: the model is still patched, unchanged.")

    def _write_back(self, swap: Swap) -> None:
        assert swap.replacement is not None
        prefix = swap.path + "."
        current = {prefix + k: t for k, t in swap.replacement.state_dict(keep_vars=True).items()}
        with torch.no_grad():
            back = swap.move.inverse(current, f"revert of {swap.path} (the model was left patched)")
            values = owned_tensors(back, keep_ids={id(t) for t in swap.sources.values()})
            for key, value in values.items():
                target = swap.sources[key]
                if value is target:
                    continue
                stride = swap.strides[key]
                if tuple(value.stride()) != stride:
                    value = torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(
                        value
                    )
                target.data = value.detach()

    # -- optimizers ---------------------------------------------------------------------------------------------
    def update_optimizer(self, optimizer: torch.optim.Optimizer) -> int:
        """Point ``optimizer``'s parameter groups at the parameters the model holds now (as composer's module surgery
        does): while patched, each original parameter is replaced by the new parameters its key map names (in
        order, in the same group); after :meth:`revert`, the other way round. A parameter handed over unchanged
        (the same object) keeps its place and its state; the state of a replaced parameter (Adam moments, ...) is
        dropped, as it has another layout. Returns the number of parameters replaced.

        Call it right after :func:`patch_model` / :meth:`revert`. Without it, build a new optimizer over
        ``model.parameters()``; :attr:`report` maps old keys to new ones.

        Raises:
            OptimizerGroupError: a parameter would go into two parameter groups: the sources of one new parameter
                (``q_proj``, ``k_proj``, ``v_proj`` of one ``qkv_proj``; after revert, the per-expert parameters of
                one fused one) sit in different groups, whose settings (``lr``, ``weight_decay``, ...) one parameter
                cannot have both of. Put them in one group, or build the optimizer after patching. The optimizer is
                not changed then.
        """
        forward, names = self._optimizer_map()
        replaced = 0
        plan: list[list[nn.Parameter]] = []
        dropped: list[nn.Parameter] = []
        sources: dict[int, list[tuple[str, int]]] = {}  # id(new parameter) -> (source key, group index)
        for index, group in enumerate(optimizer.param_groups):
            params: list[nn.Parameter] = []
            for param in group["params"]:
                found = forward.get(id(param))
                if found is None or (len(found) == 1 and found[0][1] is param):
                    params.append(param)
                    continue
                dropped.append(param)
                for _, new in found:
                    sources.setdefault(id(new), []).append((names[id(param)], index))
                params.extend(p for _, p in found if all(p is not q for q in params))
                replaced += 1
            plan.append(params)
        _refuse_two_groups(optimizer, plan, sources, names)
        for param in dropped:
            optimizer.state.pop(param, None)
        for group, params in zip(optimizer.param_groups, plan, strict=True):
            group["params"] = params
        return replaced

    def _optimizer_map(self) -> tuple[dict[int, list[tuple[str, nn.Parameter]]], dict[int, str]]:
        """``({id(parameter to replace): [(key, parameter replacing it), ...]}, {id(parameter): its key})`` in the
        direction of the model's current state (patched: originals -> new; reverted: new -> originals)."""
        forward: dict[int, list[tuple[str, nn.Parameter]]] = {}
        names: dict[int, str] = {}
        for swap in self._swaps:
            for old_key, old_ref, new_refs in swap.pairs:
                old = old_ref()
                new = [(k, p) for k, p in ((k, r()) for k, r in new_refs) if p is not None]
                if old is None or not new:
                    continue
                names[id(old)] = old_key
                names.update((id(p), k) for k, p in new)
                if not self.reverted:
                    forward[id(old)] = new
                else:
                    for _, p in new:
                        forward.setdefault(id(p), []).append((old_key, old))
        return forward, names


def _refuse_two_groups(
    optimizer: torch.optim.Optimizer,
    plan: list[list[nn.Parameter]],
    sources: dict[int, list[tuple[str, int]]],
    names: dict[int, str],
) -> None:
    """Raise :class:`OptimizerGroupError` when a parameter appears in two of the groups of ``plan`` (the groups'
    new parameter lists); ``sources``: the (key, group) each new parameter comes from."""
    groups: dict[int, list[int]] = {}
    by_id: dict[int, nn.Parameter] = {}
    for index, params in enumerate(plan):
        for param in params:
            groups.setdefault(id(param), []).append(index)
            by_id[id(param)] = param
    clashes = [pid for pid, where in groups.items() if len(set(where)) > 1]
    if not clashes:
        return
    pid = clashes[0]

    def label(index: int) -> str:
        settings = {k: v for k, v in optimizer.param_groups[index].items() if k in ("lr", "weight_decay")}
        return f"group {index} ({', '.join(f'{k}={v}' for k, v in settings.items())})"

    origin = sources.get(pid, [])
    described = ", ".join(f"'{key}' in {label(index)}" for key, index in origin)
    kept = [index for index in groups[pid] if index not in {i for _, i in origin}]
    if kept:
        described += f"; it is also in {', '.join(label(i) for i in kept)} itself"
    raise OptimizerGroupError(
        f"update_optimizer cannot place '{names.get(pid, tuple(by_id[pid].shape))}': its sources sit in different "
        f"parameter groups ({described}), and one parameter cannot be stepped with the settings of two groups (it "
        f"would be stepped once per group). Put {[key for key, _ in origin]} in one parameter group, or build the "
        "optimizer after patching (over model.parameters()). The optimizer was not changed."
    )


# -- the conversion state of the model ----------------------------------------------------------------------------
def _remember(model: nn.Module, patch: ModelPatch) -> None:
    record = vars(model).get(_PATCHES_ATTR)
    if record is None or not record.patches:
        record = _ModelRecord(vars(model).get(STATE_ATTR, ABSENT))
        object.__setattr__(model, _PATCHES_ATTR, record)
    record.patches.append(patch)
    _bind(model, record)


def _forget(model: nn.Module, patch: ModelPatch) -> None:
    record = vars(model).get(_PATCHES_ATTR)
    if record is None:
        return
    record.patches = [p for p in record.patches if p is not patch]
    _bind(model, record)
    if not record.patches:
        vars(model).pop(_PATCHES_ATTR, None)


def _bind(model: nn.Module, record: _ModelRecord) -> None:
    """The model's conversion state: the one before the first active instance patch, plus the rules each active
    patch bound; exactly the one before once no instance patch is active (``save_pretrained`` reads it)."""
    base = record.base
    rules = [rule for patch in record.patches for rule in patch._bound]  # noqa: SLF001 - same module: a model's record of its patches
    if not rules:
        if base is ABSENT:
            vars(model).pop(STATE_ATTR, None)
        elif get_state(model) is not base:
            set_state(model, base)
        return
    owner: dict[int, str | None] = {}
    recorded: dict[str, tuple[int, ...]] = {}
    for patch in record.patches:
        owner.update(patch._owner)  # noqa: SLF001 - same module: a model's record of its patches
        recorded.update(patch._recorded)  # noqa: SLF001 - same module: a model's record of its patches
    if base is not ABSENT and base is not None:
        state = ConversionState(
            list(base.rules) + rules,
            {**base.owner, **owner},
            {**base.recorded_shapes, **recorded},
            list(base.load_rows),
            list(base.save_rows),
        )
    else:
        state = ConversionState(rules, owner, recorded)
    set_state(model, state)


# -- patch_model --------------------------------------------------------------------------------------------------
def patch_model(
    model: nn.Module,
    mapping: Mapping[str, type] | None = None,
    *,
    conversion_rules: Mapping[str, Sequence[WeightTransform]] | None = None,
    overwrite: bool | Collection[str] = False,
    strict: bool = False,
    keep_original: bool = False,
) -> ModelPatch:
    """Replace modules of an already built model, moving their weights into the replacements' layout.

    Args:
        model: the model (a ``PreTrainedModel``, or any ``nn.Module`` holding Transformers modules); its tensors must
            be materialised (not ``meta``).
        mapping: ``{key: replacement class}``, keys as for :func:`~modelpatch.apply_patches` (exact class name or
            regex, Transformers' modeling classes only); ``None``: the registry as it is now.
        conversion_rules: ``{model_type_or_class_name: [WeightConverter | WeightRenaming, ...]}`` as for
            ``apply_patches``, in force for this call only, composed with the registered rules and Transformers'
            built-in rules exactly as a load composes them. ``None``: the registered rules.
        overwrite: as for ``apply_patches``: drop Transformers' built-in rules of the names in ``conversion_rules``.
        strict: raise instead of warning when a key matches no module class of the model, a rule moves nothing, or a
            replacement tensor is not provided by the rules (it then gets the value its ``__init__`` gives it).
        keep_original: keep the originals' tensors (more memory): :meth:`ModelPatch.revert` is then a pointer swap
            that drops what was trained on the patched model. Default: each original's converted tensors are freed
            after its module is converted, and revert writes the replacement's current values back.

    Returns:
        A :class:`ModelPatch` (``report``, ``revert()``, context manager: ``with patch_model(m, ...):`` reverts on
        exit, also on an exception).

    The replacement of each module is built with ``Replacement.from_module(original)`` when the class defines that
    classmethod (called under ``torch.device("meta")``: create the submodules, modelpatch fills their tensors),
    otherwise with the original class's constructor arguments (see :func:`constructor_arguments`). Tensors pass
    model layout -> (Transformers' built-in rules reversed) -> checkpoint layout -> (conversion rules) -> replacement
    layout, one module at a time; see :mod:`modelpatch.conversion.transfer`. New tensors keep the dtype and device of
    their sources; a new parameter made from frozen sources (``requires_grad=False``) is frozen, one made from
    trainable sources trains, and one made from both is refused (it cannot be frozen in part: training it would change
    the frozen values, written back on revert); a tensor no rule changes is the same
    object (parameters tied to others stay tied; one tied outside the module whose layout changes is refused). The
    model's conversion state is extended with the rules that fired, so ``save_pretrained`` writes the original
    layout. Gradients (``.grad``) are not carried over. Replaced modules are marked (:func:`~modelpatch.replacement_of`,
    :func:`~modelpatch.patch_report` lists them with ``via='patch_model'``).

    Raises:
        InstancePatchError: the model is wrapped (PEFT, DDP, FSDP, ``torch.compile``) or was loaded quantized by
            Transformers (``hf_quantizer``: load it with ``quantization_config`` inside the recipe instead), a module
            to replace holds quantized layers or weights, or is already a replacement, carries accelerate hooks or offloaded (meta) tensors, has a constructor argument that
            cannot be recovered, has a parameter tied outside it whose layout changes, or would get a new parameter made
            from frozen and trainable sources (the message names the new key and which sources are frozen); or the
            model itself matches.
        UnmatchedPatchKeyError: ``strict`` and a key matches no module class of the model.
        ConversionError, ConversionShapeError: the rules produce keys or shapes the replacement does not have, an
            operation cannot be applied, or (``strict``) a rule moved nothing / a replacement tensor is not provided.
        TypeError, ValueError: ``mapping`` or ``conversion_rules`` are invalid (as for ``apply_patches``).
        Everything is checked before the first module is swapped: on these errors the model is unchanged.
    """
    refuse_wrappers(model)
    resolved_mapping = registered_patch_mapping() if mapping is None else build_patch_mapping(mapping)
    scope: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if conversion_rules is not None:
        scope = rulesets_in_force(scoped_rulesets(conversion_rules, overwrite=overwrite, strict=strict))
    elif overwrite:
        raise ModelpatchValueError("patch_model(overwrite=...) applies to conversion_rules, and none were given")
    targets = find_targets(model, resolved_mapping, strict)
    patch = ModelPatch(model, keep_original)
    if not targets:
        return patch
    refuse_quantized(model, targets)
    with scope:
        user = resolve_model_rules(model) or ResolvedRules()
        strict_rules = strict or user.strict
        transfer = transfer_rules(model, user)
    ties = shared_tensors(model)
    fired: set[int] = set()
    for target in targets:
        refuse_dispatched(target.path, target.module)
        fired |= validate_on_meta(model, target, transfer, ties, strict_rules, keep_original)
    # a rule of one checkpoint Layout (e.g. the fused experts tensors) is an alternative reader: when no rule of its
    # layout fired, the tensors came in another layout of its group (possibly one needing no rule at all)
    fired_layouts = {id(rule_layout(r)) for r in user.rules if id(r) in fired and rule_layout(r) is not None}
    unused = [
        r for r in user.rules if id(r) not in fired and (rule_layout(r) is None or id(rule_layout(r)) in fired_layouts)
    ]
    for rule in unused:
        message = f"Conversion rule {rule!r} (registered as {user.owner.get(id(rule))!r}) moved no tensor of the modules patch_model replaces"
        if strict_rules:
            raise ConversionError(message + " (strict). The model was not modified.")
        logger.warning(message)
    try:
        for target in targets:
            swap = swap_module(model, target, transfer, keep_original, patch._undo)  # noqa: SLF001 - same module: patch_model fills the ModelPatch it returns
            patch._swaps.append(swap)  # noqa: SLF001 - same module: patch_model fills the ModelPatch it returns
            patch._recorded.update(swap.move.recorded)  # noqa: SLF001 - same module: patch_model fills the ModelPatch it returns
    except BaseException:
        patch.revert()
        raise
    patch._bound = [r for r in user.rules if id(r) in fired]  # noqa: SLF001 - same module: patch_model fills the ModelPatch it returns
    patch._owner = {id(r): user.owner.get(id(r)) for r in patch._bound}  # noqa: SLF001 - same module: patch_model fills the ModelPatch it returns
    _remember(model, patch)
    return patch
