"""Carry one module's tensors of a *built* model between parameter layouts, through the rules of a checkpoint load.

What :func:`modelpatch.patch_model` moves weights with. A module's parameters are in the model's in-memory layout,
which may already differ from the checkpoint layout by Transformers' built-in conversions (an unpatched Qwen3-MoE
holds fused ``mlp.experts.gate_up_proj (E, 2I, H)`` where its checkpoint has ``mlp.experts.{e}.gate_proj.weight``).
So the tensors go through two stages, each run with the plan engine of loading and saving (:mod:`.plan`):

A. **built-in stage**: Transformers' transforms of the model, picked as ``revert_weight_conversion`` picks them
   (``model._weight_conversions`` after ``from_pretrained``, else ``get_model_conversion_mapping(model,
   add_legacy=False)`` without ``PrefixChange``), as modelpatch rules (exact inverses). Reversed: model layout ->
   checkpoint layout (what ``save_pretrained`` writes); forward: checkpoint -> model layout (what a load does).
B. **patch stage**: the user rules resolved for the model, the built-in converters they leave in place, and
   Transformers' key renamings applied first, exactly as :func:`~modelpatch.load_converted_state_dict` composes them.
   Forward: checkpoint layout -> replacement layout, recording the shapes each converter consumed; reversed (with
   those shapes, so a grouped-query ``qkv_proj`` splits back 64/32/32): replacement -> checkpoint layout.

:meth:`TransferRules.move` is the one value a caller holds per module: the forward result, the check that the inverse
gives the original keys and shapes back (:meth:`ModuleMove.round_trips`), and the inverse itself
(:meth:`ModuleMove.inverse`), so :func:`~modelpatch.patch_model` and its revert call this module once per direction.

Every call works on the keys of one module only (full model keys, so scoped rules match), so memory stays at one
module at a time. Each output comes with the input keys it was computed from (``origins``): the key map of the
patch report, and which sources' ``requires_grad`` a new parameter takes. A passed-through tensor comes out as the
very same object (no copy), which keeps tied parameters tied.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import core_model_loading as _tcml

from .compose import ResolvedRules
from .errors import ConversionError, ConversionShapeError
from .manual import builtin_transforms
from .plan import build_plan
from .reference import ReferenceShapes
from .rules import as_modelpatch_rule

__all__ = ["ModuleMove", "Moved", "TransferRules", "transfer_rules"]


class _Source:
    """An input tensor with its key: a plan hands passed-through inputs back unchanged, so the key survives."""

    __slots__ = ("key", "tensor")

    def __init__(self, key: str, tensor: torch.Tensor):
        self.key, self.tensor = key, tensor

    def __call__(self) -> torch.Tensor:  # :func:`.plan.load_tensor` calls zero-argument callables
        return self.tensor


@dataclass
class Moved:
    """Result of one stage: ``tensors`` ``{output key: tensor}``, ``origins`` ``{output key: input keys}``,
    ``fired`` (ids of the rules that matched), ``recorded`` (input key -> shape, for the inputs converters consumed)."""

    tensors: dict[str, torch.Tensor]
    origins: dict[str, tuple[str, ...]]
    fired: set[int] = field(default_factory=set)
    recorded: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def then(self, later: Moved) -> Moved:
        """``later`` (run on this result's tensors) with origins traced back to this result's inputs."""
        origins = {
            key: tuple(dict.fromkeys(k for source in sources for k in self.origins.get(source, (source,))))
            for key, sources in later.origins.items()
        }
        return Moved(later.tensors, origins, self.fired | later.fired, {**self.recorded, **later.recorded})


def _run(tensors: dict[str, torch.Tensor], rules: list, *, reverse: bool, key_renamings=(), references=None) -> Moved:
    items = [(key, _Source(key, tensor)) for key, tensor in tensors.items()]
    plan = build_plan(items, rules, reverse=reverse, key_renamings=list(key_renamings))
    recorded = {
        key: tuple(source.tensor.shape)
        for group in plan.groups.values()
        for pairs in group.sources.values()
        for key, source in pairs
    }
    result = plan.convert_all(references)
    out: dict[str, torch.Tensor] = {}
    origins: dict[str, tuple[str, ...]] = {}
    for name, value in result.items():
        if isinstance(value, _Source):
            out[name], origins[name] = value.tensor, (value.key,)
        else:
            out[name], origins[name] = value, plan.produced[name][2].source_keys()
    return Moved(out, origins, set(plan.fired), recorded)


def _reversed(converters: list, renamings: list) -> list:
    """Reverse transforms in save order: converters keep their load priority, renamings undo last-applied first
    (as :func:`~modelpatch.conversion.streaming.reversed_user_rules` orders them)."""
    return [c.reverse_transform() for c in converters] + [r.reverse_transform() for r in renamings[::-1]]


def _split(rules: Iterable) -> tuple[list, list]:
    rules = list(rules)
    converters = [r for r in rules if isinstance(r, _tcml.WeightConverter)]
    return converters, [r for r in rules if not isinstance(r, _tcml.WeightConverter)]


@dataclass
class TransferRules:
    """The two stages of one model (see the module docstring), computed once per :func:`~modelpatch.patch_model`.

    Attributes:
        builtins: stage A, Transformers' transforms as modelpatch rules, in load order.
        unsupported: Transformers transforms of the model that have no modelpatch equivalent (refused if they would
            touch a patched module's keys).
        rules: stage B rules: user rules, then the built-in converters they leave in place.
        key_renamings: Transformers' renamings applied to every key before ``rules`` (stage B).
        user: the user rules (owner names, strictness).
    """

    builtins: list
    unsupported: list
    rules: list
    key_renamings: list
    user: ResolvedRules
    references: ReferenceShapes

    # -- one module, both directions ----------------------------------------------------------------------------
    def move(self, tensors: dict[str, torch.Tensor], target_shapes: dict, model) -> ModuleMove:
        """Move one module's ``{full model key: tensor}`` into the replacement layout (:meth:`to_replacement`) and
        keep what the way back needs. ``target_shapes``: ``{full key: shape}`` of the replacement; ``model``: the model
        the module belongs to (reference shapes of its built-in conversions).

        Raises:
            ConversionError: as :meth:`to_replacement`.
        """
        moved = self.to_replacement(tensors, target_shapes)
        return ModuleMove(
            tensors=moved.tensors,
            origins=moved.origins,
            fired=moved.fired,
            recorded=moved.recorded,
            source_shapes={k: tuple(t.shape) for k, t in tensors.items()},
            extra=set(target_shapes) - set(moved.tensors),
            target_shapes=dict(target_shapes),
            rules=self,
            model=model,
        )

    # -- patch: model layout -> replacement layout -------------------------------------------------------------
    def to_replacement(self, tensors: dict[str, torch.Tensor], target_shapes: dict) -> Moved:
        """Move ``{full model key: tensor}`` of one module from the model layout to the replacement layout.

        ``target_shapes``: ``{full key: shape}`` of the replacement (reference sizes for ``Chunk``).

        Raises:
            ConversionError: a built-in transform of the model that modelpatch cannot run touches these keys, or an
                operation cannot be applied.
        """
        self._refuse_unsupported(tensors)
        converters, renamings = _split(self.builtins)
        backward = _reversed(converters, renamings)
        stage_a = _run(tensors, backward, reverse=True, references=self.references)
        # which forward built-ins fired: their reverses did
        stage_a.fired = {
            id(rule) for rule, rev in zip(converters + renamings[::-1], backward) if id(rev) in stage_a.fired
        }
        stage_a.recorded = {}
        stage_b = _run(
            stage_a.tensors,
            self.rules,
            reverse=False,
            key_renamings=self.key_renamings,
            references=ReferenceShapes(dict(target_shapes)),
        )
        stage_b.fired |= {id(r) for r in self.key_renamings if any(_renames(r, key) for key in stage_a.tensors)}
        return stage_a.then(stage_b)

    # -- revert: replacement layout -> model layout ------------------------------------------------------------
    def to_model(
        self, tensors: dict[str, torch.Tensor], fired: set[int], recorded: dict, model_shapes: dict, model
    ) -> Moved:
        """Inverse of :meth:`to_replacement` for one module: the reverse of the stage-B rules that ``fired`` then the
        stage-A built-ins that ``fired``, forward. ``recorded``: shapes stage B consumed (exact splits);
        ``model_shapes``: ``{full key: shape}`` of the original module (references of the built-ins)."""
        user_converters, user_renamings = _split(r for r in self.rules if id(r) in fired)
        renamings = [r for r in self.key_renamings if id(r) in fired] + user_renamings
        stage_b = _run(
            tensors,
            _reversed(user_converters, renamings),
            reverse=True,
            references=ReferenceShapes(dict(recorded), model),
        )
        # the built-in converters that fired, and every built-in renaming: stage B's reverse may have produced the
        # checkpoint names they rename (Mixtral's recipe renames block_sparse_moe -> mlp as its built-ins do)
        builtins = [r for r in self.builtins if id(r) in fired or not isinstance(r, _tcml.WeightConverter)]
        undone = [r for r in self.key_renamings if id(r) in fired]  # stage B's reverse undid them: apply them again
        stage_a = _run(
            stage_b.tensors,
            builtins,
            reverse=False,
            key_renamings=undone,
            references=ReferenceShapes(dict(model_shapes)),
        )
        return stage_b.then(stage_a)

    def _refuse_unsupported(self, tensors: dict) -> None:
        for transform in self.unsupported:
            try:
                reverse = transform.reverse_transform()
            except Exception:  # noqa: BLE001 - a transform that cannot even be reversed: test its own patterns
                reverse = transform
            hit = next((key for key in tensors if reverse._scoped_match(key) is not None), None)
            if hit is not None:
                raise ConversionError(
                    f"Transformers' built-in transform {transform!r} of this model touches '{hit}' and has no exact "
                    "modelpatch equivalent; patch_model cannot move this module's weights (load the model patched "
                    "instead: `with apply_patches(...): from_pretrained(...)`). The model was not modified."
                )

    def user_rule_ids(self) -> set[int]:
        return {id(r) for r in self.user.rules}


@dataclass
class ModuleMove:
    """One module carried from the model layout to a replacement's layout, with everything its inverse needs.

    Made by :meth:`TransferRules.move`. ``tensors`` and ``origins`` are the forward result (see :class:`Moved`; the
    caller takes the tensors and may :meth:`release` them); :meth:`inverse` takes the replacement's tensors back to
    the original keys, shapes and layout; :meth:`round_trips` tells, on ``meta`` stand-ins, whether it can.

    Attributes:
        fired: ids of the rules that matched (only they are reversed).
        recorded: ``{input key: shape}`` the converters consumed (exact splits on the way back: a grouped-query
            ``qkv_proj`` splits 64/32/32, not in equal thirds).
        source_shapes: ``{full original key: shape}``.
        extra: replacement keys no rule provides (``__init__`` values): the inverse drops them.
        target_shapes: ``{full replacement key: shape}``: the keys a replacement holding exactly the tensors of the
            move has (a caller compares them with the replacement's keys before :meth:`inverse`).

    ``fired`` holds ids, which another process or a ``copy.deepcopy`` does not keep: ``__getstate__`` stores the
    rule objects themselves (copied or pickled with the rest), ``__setstate__`` takes their ids again.
    """

    tensors: dict[str, torch.Tensor]
    origins: dict[str, tuple[str, ...]]
    fired: set[int]
    recorded: dict[str, tuple[int, ...]]
    source_shapes: dict[str, tuple[int, ...]]
    extra: set[str]
    target_shapes: dict[str, tuple[int, ...]]
    rules: TransferRules = field(repr=False)
    model: object = field(repr=False)

    def inverse(self, tensors: dict[str, torch.Tensor], context: str) -> dict[str, torch.Tensor]:
        """``{full original key: tensor}`` from the replacement's ``{full key: tensor}``: the inverse of the move.

        Tensors the rules pass through come back as the same objects. ``context`` starts the error messages.

        Raises:
            ConversionError: the inverse rules do not give exactly the original keys, or an operation fails.
            ConversionShapeError: a key comes back with another shape than the original's.
        """
        back = self.rules.to_model(tensors, self.fired, self.recorded, self.source_shapes, self.model)
        out = {k: v for k, v in back.tensors.items() if k not in self.extra}
        if out.keys() != self.source_shapes.keys():
            raise ConversionError(
                f"{context}: the inverse rules gave {sorted(out)}, expected the original keys {sorted(self.source_shapes)}"
            )
        for key, value in out.items():
            if tuple(value.shape) != self.source_shapes[key]:
                raise ConversionShapeError(key, value.shape, self.source_shapes[key], context)
        return out

    def round_trips(self) -> bool:
        """Whether :meth:`inverse` takes ``meta`` tensors of the replacement's shapes back to exactly the original
        keys and shapes (checked before anything is changed)."""
        stand_ins = {k: torch.empty(shape, device="meta") for k, shape in self.target_shapes.items()}
        stand_ins.update({k: t for k, t in self.tensors.items() if t.device.type == "meta"})
        try:
            self.inverse(stand_ins, "round trip")
        except Exception:  # noqa: BLE001 - any failure means: not reversible
            return False
        return True

    def release(self) -> None:
        """Drop the forward tensors (the replacement holds them now); the inverse keeps working."""
        self.tensors = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        state["fired"] = [r for r in _all_rules(self.rules) if id(r) in self.fired]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update({**state, "fired": {id(r) for r in state["fired"]}})


def _all_rules(rules: TransferRules) -> list:
    """Every rule object whose id a :class:`ModuleMove` may record as fired, each once."""
    seen: dict[int, Any] = {}
    for rule in [*rules.builtins, *rules.rules, *rules.key_renamings, *rules.user.rules]:
        seen.setdefault(id(rule), rule)
    return list(seen.values())


def _renames(renaming, key: str) -> bool:
    return renaming._scoped_match(key) is not None


def transfer_rules(model, user: ResolvedRules | None) -> TransferRules:
    """The stages for ``model`` with the user rules ``user`` (see :func:`~.compose.resolve_model_rules`).

    Raises:
        ConversionError: a built-in converter the user rules leave in place cannot be applied outside
            ``from_pretrained`` (as for :func:`~modelpatch.load_converted_state_dict`).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping

    user = user or ResolvedRules()
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # as revert_weight_conversion picks them for a model not loaded by from_pretrained
        conversions = get_model_conversion_mapping(model, add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, _tcml.PrefixChange)]
    builtins, unsupported = [], []
    for transform in conversions:
        try:
            builtins.append(as_modelpatch_rule(transform))
        except TypeError:
            unsupported.append(transform)
    converters, renamings = builtin_transforms(model, user)
    return TransferRules(
        builtins=builtins,
        unsupported=unsupported,
        rules=list(user.rules) + converters,
        key_renamings=renamings,
        user=user,
        references=ReferenceShapes({}, model),
    )
