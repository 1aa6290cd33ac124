"""Which rules apply to a model: user rules per sub-model (class name before ``model_type``, scoped to the
sub-model's prefix, like Transformers' ``get_model_conversion_mapping``) and the built-in rules they leave in place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..lazy_imports import pretrained_model_class
from ..patching.provenance import build_record
from . import registry
from .errors import ConversionError
from .overlap import drop_replaced_builtins, has_target_layout, overlaps
from .rules import original_patterns, rule_layout
from .state import get_state, owner_by_id, owner_by_rule

__all__ = [
    "ResolvedRules",
    "resolve_model_rules",
    "compose_builtins",
    "drop_replaced_builtins",
    "rules_fitting_model",
    "settle_layouts",
    "layout_settled",
    "has_target_layout",
    "overlaps",
    "built_by_modelpatch",
    "transforms_in_force",
]


@dataclass
class ResolvedRules:
    """User rules resolved for one model. ``rules`` are fresh instances with ``scope_prefix`` set for sub-models;
    ``owner[id(rule)]`` is the registry name it came from; ``entries`` is ``(ruleset, scope_prefix, module)``."""

    rules: list = field(default_factory=list)
    owner: dict = field(default_factory=dict)
    entries: list = field(default_factory=list)

    @property
    def strict(self) -> bool:
        return any(ruleset.strict for ruleset, _, _ in self.entries)

    def __getstate__(self) -> dict[str, Any]:  # ids do not survive a copy: see ConversionState
        return {**vars(self), "owner": owner_by_rule(self.owner, self.rules)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update({**state, "owner": owner_by_id(state["owner"])})


def _submodels(model):
    pretrained = pretrained_model_class()
    for name, module in model.named_modules():
        if isinstance(module, pretrained):
            yield name, module


def _scope_of(model, module_name: str) -> str | None:
    if module_name == "":
        return None
    return module_name.removeprefix(model.base_model_prefix).removeprefix(".")


def _covers(ancestor: str, module_name: str) -> bool:
    """Whether the sub-model at ``ancestor`` holds the one at ``module_name`` (or is it)."""
    return ancestor == "" or ancestor == module_name or module_name.startswith(ancestor + ".")


def _where(model, module_name: str) -> str:
    if module_name == "":
        return f"the root model ({type(model).__name__})"
    return f"sub-model '{module_name}' ({type(model.get_submodule(module_name)).__name__})"


def _check_no_conflict(model, resolved: ResolvedRules, placed: list, module_name: str, ruleset, rules: list) -> list:
    """``rules`` (of ``ruleset``, for the sub-model at ``module_name``) without exact copies of an enclosing entry's
    rules; raises when one touches the same parameters as a different rule of an enclosing entry: only one of them
    can read a checkpoint key (renamings chain, then the first matching converter wins), so the other would lose
    silently."""
    kept = []
    for rule in rules:
        duplicate = False
        for outer_name, outer_ruleset, outer_scope in placed:
            if outer_name == module_name or not _covers(outer_name, module_name):
                continue
            mine = (r for r in resolved.rules if resolved.owner[id(r)] == outer_ruleset.name)
            for outer in (r for r in mine if r.scope_prefix == outer_scope):
                if not overlaps(outer, rule):
                    continue
                if repr(outer) == repr(rule):
                    duplicate = True
                    continue
                raise ConversionError(
                    f"conflicting conversion rules for {_where(model, module_name)}: {rule!r} registered under "
                    f"{ruleset.name!r} and {outer!r} registered under {outer_ruleset.name!r} (for "
                    f"{_where(model, outer_name)}, which holds it) touch the same parameters, and only one of them "
                    "can read a checkpoint key; register the rules under one name, or unregister one of them"
                )
        if not duplicate:
            kept.append(rule)
    return kept


def resolve_model_rules(model) -> ResolvedRules | None:
    """User rules in effect for ``model`` and its sub-models, or ``None`` when there are none.

    Walks the ``PreTrainedModel`` sub-modules like Transformers' ``get_model_conversion_mapping``: each is looked up
    by class name, then by ``model_type``; a sub-model's rules only apply under its prefix. An entry covers the
    subtree of its sub-model: a class name (and, when found by ``model_type`` or by class name, that
    ``model_type``) is not looked up again below it. A sub-model's *class-name* entry still applies below an
    ancestor's ``model_type`` entry (``LlamaModel`` rules inside a ``LlamaForCausalLM`` loaded with ``llama``
    rules), as in Transformers.

    Raises:
        ConversionError: a rule of a sub-model's class-name entry and a different rule of an enclosing entry touch
            the same parameters (naming both rules and both registry names). Exact copies are applied once.
    """
    if not registry.has_rules():
        return None
    resolved = ResolvedRules()
    claimed: dict[str, list[str]] = {}
    placed: list = []  # (module_name, ruleset, scope) in walk order
    for module_name, sub in _submodels(model):
        class_name: str = type(sub).__name__
        model_type: str | None = getattr(sub.config, "model_type", None)

        def covered(ident: str | None, module_name: str = module_name) -> bool:
            return ident is not None and any(_covers(seen, module_name) for seen in claimed.get(ident, []))

        if covered(class_name):
            continue  # an ancestor of the same class already brought its rules for this subtree
        ruleset = registry.lookup(class_name)
        if ruleset is None:
            if covered(model_type):
                continue  # an ancestor's rules (class-name or model_type entry) already cover this subtree
            ruleset = registry.lookup(model_type)
        if ruleset is None:
            continue
        # A class-name entry wins over the model_type entry for the whole subtree of that model.
        for ident in [i for i in {ruleset.name, class_name, model_type} if i is not None]:
            claimed.setdefault(ident, []).append(module_name)
        scope = _scope_of(model, module_name)
        rules = []
        for rule in ruleset.fresh_rules():
            if scope is not None:
                rule.scope_prefix = scope
                rule.base_model_prefix = model.base_model_prefix
            rules.append(rule)
        for rule in _check_no_conflict(model, resolved, placed, module_name, ruleset, rules):
            resolved.rules.append(rule)
            resolved.owner[id(rule)] = ruleset.name
        resolved.entries.append((ruleset, scope, sub))
        placed.append((module_name, ruleset, scope))
    return resolved if resolved.entries else None


def _has_builtin_layout(sub, names) -> bool:
    """Whether the model has parameters named like the targets of a built-in Transformers converter of ``sub``."""
    from transformers import core_model_loading as _tcml

    rules = registry.builtin_rules(type(sub).__name__)
    if rules is None:
        rules = registry.builtin_rules(getattr(sub.config, "model_type", None)) or []
    return any(isinstance(rule, _tcml.WeightConverter) and has_target_layout(rule, names) for rule in rules)


def rules_fitting_model(model, resolved: ResolvedRules | None, names=None) -> ResolvedRules | None:
    """``resolved`` without the converters whose target layout ``model`` does not have (e.g. per-expert rules in
    effect while an unpatched model with fused experts is saved), without the registry entries whose converters all
    went, and without ``overwrite`` entries while the model still has the layout of the built-in rules they replace;
    ``None`` when nothing is left. Saving such a model must reverse Transformers' own rules only. ``names``: the
    model's state-dict keys, when the caller has them."""
    from transformers import core_model_loading as _tcml

    if resolved is None:
        return None
    names = list(model.state_dict()) if names is None else list(names)

    fitting = ResolvedRules()
    for ruleset, scope, sub in resolved.entries:
        mine = [r for r in resolved.rules if resolved.owner[id(r)] == ruleset.name and r.scope_prefix == scope]
        # of alternative checkpoint layouts, a model that was not loaded has the default one
        mine = [r for r in mine if getattr(rule_layout(r), "default", True)]
        converters = {id(r) for r in mine if isinstance(r, _tcml.WeightConverter)}
        kept = [r for r in mine if id(r) not in converters or has_target_layout(r, names)]
        if converters and not any(id(r) in converters for r in kept):
            continue
        if ruleset.overwrite and _has_builtin_layout(sub, names):
            continue  # the entry replaces built-in rules whose layout the model still has (an unpatched model)
        fitting.rules.extend(kept)
        fitting.owner.update({id(r): ruleset.name for r in kept})
        fitting.entries.append((ruleset, scope, sub))
    return fitting if fitting.entries else None


def settle_layouts(rules, kept: set, fired: set) -> set:
    """``kept`` (rule ids) without the rules of the alternative :class:`~.rules.Layout` s the checkpoint was not in:
    per layout group, the layouts with a rule in ``fired`` stay (all their rules), or the default layout when none
    fired; rules without a layout are untouched."""
    chosen: dict[str, set] = {}
    for rule in rules:
        layout = rule_layout(rule)
        if layout is not None and id(rule) in fired:
            chosen.setdefault(layout.group, set()).add(layout.name)
    settled = set()
    for rule in rules:
        layout = rule_layout(rule)
        if id(rule) not in kept:
            continue
        if layout is None or layout.name in chosen.get(layout.group, {layout.name} if layout.default else set()):
            settled.add(id(rule))
    return settled


def layout_settled(rule, rules, fired: set) -> bool:
    """Whether ``rule`` matching no checkpoint key is expected: it belongs to one of several alternative
    :class:`~.rules.Layout` s, and a checkpoint is in one of them at most (another layout's rules fired, or it is in
    the default layout, whose keys may not even be recognisable, e.g. the ``_weight_qdata`` / ``_weight_scale``
    pieces of a torchao pre-quantized per-expert save). Keys the checkpoint lacks are still reported as missing."""
    return rule_layout(rule) is not None


def _signature(rule) -> tuple:
    sources, targets = original_patterns(rule)
    return (type(rule).__name__, tuple(sources), tuple(targets))


def _builtin_signatures(sub) -> set:
    rules = registry.builtin_rules(type(sub).__name__)
    if rules is None:
        rules = registry.builtin_rules(getattr(sub.config, "model_type", None)) or []
    return {_signature(rule) for rule in rules}


def compose_builtins(model, builtins: list, resolved: ResolvedRules) -> list:
    """Filter the Transformers transforms computed for ``model`` (``get_model_conversion_mapping``): drop those of a
    sub-model registered with ``overwrite=True`` and those replaced by a user rule of the same scope."""
    kept = list(builtins)
    for ruleset, scope, sub in resolved.entries:
        mine = [r for r in resolved.rules if resolved.owner[id(r)] == ruleset.name and r.scope_prefix == scope]
        if ruleset.overwrite:
            signatures = _builtin_signatures(sub)
            kept = [b for b in kept if not (b.scope_prefix == scope and _signature(b) in signatures)]
        else:
            kept = [b for b in kept if not (b.scope_prefix == scope and any(overlaps(b, u) for u in mine))]
    return kept


def built_by_modelpatch(model) -> bool:
    """Whether modelpatch loaded or built ``model`` or one of its sub-models (conversion rules bound, or built
    inside a patch block): what modelpatch knows of its layout is then on the instance."""
    modules = model.modules() if hasattr(model, "modules") else ()
    return any(get_state(m) is not None or build_record(m) is not None for m in modules)


def transforms_in_force(transforms, names) -> list:
    """``transforms`` (Transformers' rules, e.g. of ``get_model_conversion_mapping``) without the converters whose
    target layout is not among ``names`` (the model's state-dict keys): such a converter produces keys the model does
    not have (the built-in expert fusion on a model with per-expert ``nn.Linear`` experts), so it is not in force for
    that model. Renamings and other transforms are kept, in order."""
    from transformers import core_model_loading as _tcml

    transforms = list(transforms)
    converters = [t for t in transforms if isinstance(t, _tcml.WeightConverter)]
    if not converters:
        return transforms
    names = list(names)
    absent = {id(c) for c in converters if not has_target_layout(c, names)}
    return [t for t in transforms if id(t) not in absent]
