"""What ``verify`` fails on that can be seen without running the model, and the words both commands say it in.

``explain`` is ``verify``'s plan: the patched model is built on the ``meta`` device (no memory, no weight read) and
the checkpoint's safetensors headers are matched against it, through its conversion rules (the same analysis
``load_state_dict`` runs before writing a parameter, :func:`modelpatch.conversion.loaders.analyse_state_dict`):

* **patches**: keys of the patch mapping that replaced nothing (with the closest class names for a key that names no
  class), container/inner conflicts, classes both replaced and fused by Transformers (fusion conflicts);
* **loading**: parameters of the patched model no checkpoint key fills (``missing_keys``: a replacement's own
  parameters are left at their initial values), checkpoint keys it does not take (``unexpected_keys``), keys whose
  shape the checkpoint cannot fill (``mismatched_keys``, naming both shapes), rules that can match no checkpoint key.

Keys the unpatched model also misses or leaves (tied weights, buffers) do not count. :func:`problem_words` is the one
function that words these findings: ``verify`` says them in its ``patches`` and ``loading`` checks, from what the
real loads reported, and ``explain`` from the plan (exit status 1 on any).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint import model_class, remote_code_kwargs
from .errors import CliError

__all__ = [
    "Findings",
    "problem_words",
    "unmatched_key_hints",
    "static_findings",
    "reported_missing",
    "build_on_meta",
    "unfired_rules",
    "rule_text",
]


@dataclass
class Findings:
    """What is wrong with a patch for a checkpoint (every list empty: nothing).

    Attributes:
        unmatched_keys: keys of the patch mapping that replaced nothing.
        conflicts: container/inner conflict messages.
        fusion_conflicts: messages of classes both replaced by the patch and fused by Transformers (``explain
            --fusion``, or a ``fusion_config`` in the checkpoint's config): a load with that fusion refuses them.
        missing: model keys (of the patched model) no checkpoint key fills and the unpatched model's do.
        unexpected: checkpoint keys the patched model does not take and the unpatched model does.
        mismatched: ``(key, checkpoint shape, patched model shape)``: the checkpoint cannot fill the key (for a
            converted key, the checkpoint shape is the one the rule's operations produce).
        unfired: rules (as the conversion report names them) that matched no checkpoint key.
        other_types: the recipe's rules are all registered under names that are not the checkpoint's (another
            model type, e.g. ``mistral`` for a ``llama`` checkpoint): the message naming both (:func:`other_type_rules`).
        load_error: the loader's own message when a load failed for a reason none of the above names.
        replaced: modules the patch replaced (``None``: not counted here; ``verify`` states the count itself).
        build_error: why the patched model cannot be built at all (an exception of a replacement's ``__init__``).
        vanilla_missing: model keys of the *unpatched* model no checkpoint key fills (a checkpoint already in a
            recipe's converted layout leaves them random in the reference load).
    """

    unmatched_keys: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    fusion_conflicts: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    unfired: list[str] = field(default_factory=list)
    other_types: str | None = None
    load_error: str | None = None
    replaced: int | None = None
    vanilla_missing: list[str] = field(default_factory=list)
    build_error: str | None = None


def _few(items: list, n: int = 3) -> str:
    return f"{items[:n]}{' ...' if len(items) > n else ''}"


def problem_words(findings: Findings) -> dict[str, list[str]]:
    """``{"patches": [phrase, ...], "loading": [phrase, ...]}``: how ``verify`` (its checks of those names) and
    ``explain`` word each finding; an empty list for a check with nothing to report."""
    patches = []
    if findings.build_error:
        patches.append(f"the patched model cannot be built: {findings.build_error}")
    if findings.replaced == 0:
        patches.append("0 module(s) replaced")
    if findings.unmatched_keys:
        patches.append(
            f"keys that replaced nothing: {findings.unmatched_keys}{unmatched_key_hints(findings.unmatched_keys)}"
        )
    if findings.conflicts:
        patches.append(f"{len(findings.conflicts)} container/inner conflict(s)")
    if findings.fusion_conflicts:
        patches.append(
            f"{len(findings.fusion_conflicts)} fusion conflict(s) (a class replaced by the patch and fused by "
            "Transformers)"
        )
    loading = []
    if findings.mismatched:
        shown = [
            f"{key} has {tuple(ck)} in the checkpoint, {tuple(own)} in the patched model"
            for key, ck, own in findings.mismatched
        ]
        loading.append(f"mismatched_keys: {'; '.join(shown[:3])}{' ...' if len(shown) > 3 else ''}")
    if findings.missing:
        loading.append(f"missing_keys (left at their initial values): {_few(findings.missing)}")
    if findings.unexpected:
        loading.append(f"unexpected_keys: {_few(findings.unexpected)}")
    if findings.unfired:
        loading.append(f"rules that matched no checkpoint key: {_few(findings.unfired)}")
    if findings.other_types:
        loading.append(findings.other_types)
    if findings.load_error:
        loading.append(f"the patched load fails: {findings.load_error}")
    return {"patches": patches, "loading": loading}


def unmatched_key_hints(keys: list[str]) -> str:
    """``"; 'LlamaAttn': no module class of Transformers 5.23.0 is named so; did you mean 'LlamaAttention'?"`` for
    each of ``keys`` (patch keys that replaced nothing) that names or matches no module class Transformers (or loaded
    remote code) has; ``""`` when every key names a class that exists (of another family: not applicable here)."""
    from ..patching.registry import unknown_key_hint

    return "".join(f"; {key!r}: {hint}" for key in keys if (hint := unknown_key_hint(key)))


def model_names(model) -> set[str]:
    """The registry names rules for ``model`` may be registered under: the class name and ``model_type`` of it and
    each of its sub-models (what :func:`unfired_rules` counts too)."""
    from transformers import PreTrainedModel

    names: set[str] = set()
    for module in model.modules() if model is not None else ():
        if isinstance(module, PreTrainedModel):
            names.add(type(module).__name__)
            model_type = getattr(module.config, "model_type", None)
            if isinstance(model_type, str) and model_type:
                names.add(model_type)
    return names


def other_type_rules(recipe, names: set[str]) -> str | None:
    """When ``recipe`` has conversion rules but none registered under a name of the checkpoint (``names``: its model
    type, architectures, sub-models' types, from :func:`.sources.config_names`), the words naming both: rules
    registered for ``mistral`` never apply to a ``llama`` checkpoint. ``None`` otherwise."""
    groups = [name for name, rules in recipe.build_conversion_rules().items() if rules]
    if not groups or names & set(groups):
        return None
    types = sorted(n for n in names if not n[:1].isupper()) or sorted(names)
    return (
        f"conversion rules are registered for {', '.join(map(repr, groups))} and none for the checkpoint's model "
        f"type {', '.join(map(repr, types))}: they never apply to it (register them under {types[0]!r})"
    )


def build_on_meta(config):
    """The model of ``config`` (the class ``verify`` loads) built on the ``meta`` device, under whatever patch
    scopes are open."""
    import transformers

    cls: Any = model_class(config)
    with torch.device("meta"):
        if cls is transformers.AutoModel:
            return transformers.AutoModel.from_config(config, **remote_code_kwargs())
        return cls._from_config(config)


def rule_text(rule) -> str:
    """How the conversion report names ``rule``: the registries and blocks rebuild Transformers' own
    ``WeightConverter``/``WeightRenaming`` (and operations) as modelpatch's, and the rows name what actually ran."""
    from ..conversion.rules import as_modelpatch_rule

    try:
        return repr(as_modelpatch_rule(rule))
    except TypeError:
        return repr(rule)


def unfired_rules(recipe, model, fired: set[str]) -> list[str]:
    """The recipe's rules, for the names that apply to ``model`` (its ``model_type`` or a sub-model's class name or
    type), that are not in ``fired`` (rule texts, :func:`rule_text`): the checkpoint does not have the layout the
    recipe expects. A rule of an alternative checkpoint layout (per-expert or fused experts) the checkpoint is not in
    is not expected to fire: only the rules of the layout the checkpoint has are."""
    from transformers import PreTrainedModel

    from ..conversion.compose import settle_layouts

    names = set()
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            names |= {type(module).__name__, getattr(module.config, "model_type", None)}
    rules = [rule for name, group in recipe.build_conversion_rules().items() if name in names for rule in group]
    fired_ids = {id(rule) for rule in rules if rule_text(rule) in fired}
    expected = settle_layouts(rules, {id(rule) for rule in rules}, fired_ids)
    return [rule_text(rule) for rule in rules if id(rule) in expected and id(rule) not in fired_ids]


@dataclass
class _Analysis:
    missing: set[str]
    unexpected: set[str]
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
    error: str | None = None


def _analyse(model, headers: dict) -> _Analysis:
    """The checkpoint ``headers`` (``{key: (file, meta tensor)}``) against ``model``'s parameters, through its rules."""
    from ..conversion.errors import ConversionError, ConversionShapeError
    from ..conversion.loaders import analyse_state_dict
    from ..conversion.loading import model_key

    own = model.state_dict(keep_vars=True)
    base = model.base_model_prefix
    mismatched, items = [], []
    for key, (_, meta) in headers.items():
        name = model_key(key, own, base)
        if name is not None and tuple(meta.shape) != tuple(own[name].shape):
            mismatched.append((name, tuple(meta.shape), tuple(own[name].shape)))
        else:
            items.append((key, meta))
    try:
        analysis = analyse_state_dict(model, items, own)
    except ConversionShapeError as exc:
        mismatched.append((exc.key, exc.converted_shape, exc.expected_shape))
        return _Analysis(set(), set(), mismatched)
    except ConversionError as exc:
        return _Analysis(set(), set(), mismatched, str(exc).splitlines()[0])
    missing = reported_missing(model, set(analysis.missing)) - {name for name, _, _ in mismatched}
    return _Analysis(missing, set(analysis.unexpected), mismatched)


def reported_missing(model, missing: set[str]) -> set[str]:
    """The keys of ``missing`` (parameters and buffers of ``model`` no checkpoint key fills) that ``from_pretrained``
    reports in ``missing_keys``, decided as Transformers 5.23-5.25 decide it after loading:

    * a tied parameter is not missing when a key it is tied with is loaded: ``model.all_tied_weights_keys``
      (``{target: source}``, from ``_tied_weights_keys`` of each sub-model whose config ties, e.g.
      ``tie_word_embeddings=True``: ``lm_head.weight`` -> ``model.embed_tokens.weight``) read in order, as
      ``PreTrainedModel.tie_weights(missing_keys=...)`` reads it: the target is filled by a present source, a
      present target fills a missing source, and both missing are filled by a later pair with the same source whose
      target is present;
    * keys matching the model's ``_keys_to_ignore_on_load_missing`` patterns are not reported.

    Returns a new set; ``missing`` is not changed.
    """
    import re

    left = set(missing)
    pairs = list((getattr(model, "all_tied_weights_keys", None) or {}).items())
    for i, (target, source) in enumerate(pairs):
        if source in left and target not in left:
            left.discard(source)  # tied the other way round: the target that exists fills the source
        elif target in left and (source not in left or any(s == source and t not in left for t, s in pairs[i + 1 :])):
            left.discard(target)
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()  # noqa: SLF001 - what from_pretrained leaves out of missing_keys: no public accessor
    if patterns:
        ignored = re.compile("|".join(f"({pattern})" for pattern in patterns))
        left = {key for key in left if ignored.search(key) is None}
    return left


def has_weights(model_dir: str) -> bool:
    return any(
        os.path.isfile(os.path.join(model_dir, n)) for n in ("model.safetensors", "model.safetensors.index.json")
    )


def static_findings(recipe, config, model_dir: str | None = None) -> tuple[Any, Findings]:
    """Build the patched model of ``config`` on ``meta`` with ``recipe`` and find what :class:`Findings` names;
    the checkpoint parts (missing/unexpected/mismatched keys, rules that cannot fire) need ``model_dir`` with
    weights, read from the safetensors headers only. Returns ``(meta model, findings)``; the model is ``None`` when
    building it raises (``findings.build_error`` says why).

    Raises:
        CliError: unreadable checkpoint files (a truncated safetensors file, an index naming a missing shard).
    """
    from ..conversion.io import checkpoint_files
    from ..conversion.loaders import checkpoint_headers
    from ..conversion.rules import match_rule
    from ..patching.report import patch_report
    from .checkpoint import checkpoint_keys

    try:
        with recipe.apply():
            model = build_on_meta(config)
    except CliError:
        raise
    except Exception as exc:  # noqa: BLE001 - a replacement that cannot be built is a finding, not a crash
        text = str(exc).strip().splitlines()
        return None, Findings(build_error=f"{type(exc).__name__}: {text[0] if text else ''}")
    from .sources import config_names

    report = patch_report(model)
    findings = Findings(list(report.unmatched_keys), [c.message() for c in report.conflicts], replaced=len(report.rows))
    findings.other_types = other_type_rules(recipe, config_names(config) | model_names(model))
    if model_dir is None or not has_weights(model_dir):
        return model, findings
    checkpoint_keys(model_dir)  # unreadable files are a one-line error
    headers = checkpoint_headers(checkpoint_files(model_dir))
    patched = _analyse(model, headers)
    vanilla = _analyse(build_on_meta(config), headers)
    findings.mismatched = patched.mismatched
    findings.load_error = patched.error
    findings.vanilla_missing = sorted(vanilla.missing)
    if patched.error is None and not patched.mismatched:
        findings.missing = sorted(patched.missing - vanilla.missing)
        findings.unexpected = sorted(patched.unexpected - vanilla.unexpected)
    fired = {
        rule_text(rule)
        for group in recipe.build_conversion_rules().values()
        for rule in group
        if any(match_rule(rule, key) is not None for key in headers)
    }
    findings.unfired = unfired_rules(recipe, model, fired)
    return model, findings
