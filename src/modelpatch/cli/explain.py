"""``modelpatch explain``: what a recipe or patches file would do to a model, before any weight is read.

The model is built from its config on the ``meta`` device (no memory, no checkpoint access) inside the recipe's
block, and the report lists: for each key, the classes it replaced and how many modules; keys that matched nothing;
container/inner conflicts (:func:`modelpatch.conflicts.find_conflicts`, e.g. ``.*Attention`` on BERT); the
conversion rules in force for the model and its sub-models (the recipe's and the built-in ones they leave), and with
``--model DIR`` how many checkpoint keys each rule matches (read from the safetensors headers only).

It is ``verify``'s plan: what ``verify`` would fail on that shows without running the model (keys that replace
nothing, conflicts, and with ``--model DIR`` shapes the checkpoint cannot fill, parameters left at their initial
values, keys not taken, rules that match no key: :mod:`.plan`) is listed in ``verify``'s words, and the exit status
is then 1.
"""

from __future__ import annotations

import argparse
import os

from .checkpoint import add_trust_remote_code, checkpoint_keys, model_class, read_config
from .errors import EXIT_FAILED_CHECK, CliError
from .plan import has_weights, problem_words, rule_text, static_findings
from .render import emit, plain, section, strict_json, table
from .sources import check_model_type, check_recipe_fits, config_names, resolve_patches

__all__ = ["add_parser", "main", "explain"]


def _config(model_dir: str | None, model_type: str | None):
    from transformers import AutoConfig

    if model_dir is not None:
        if not os.path.isdir(model_dir):
            raise CliError(f"model folder '{model_dir}' does not exist")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise CliError(f"'{model_dir}' is not a checkpoint: no config.json")
        return read_config(model_dir)
    if model_type is None:
        raise CliError("give --model DIR or --model-type TYPE")
    check_model_type(model_type)
    try:
        return AutoConfig.for_model(model_type)
    except ValueError:
        raise CliError(f"unknown model type '{model_type}'") from None


def explain(
    recipe,
    *,
    model_dir: str | None = None,
    model_type: str | None = None,
    fusion_config: dict | None = None,
    source_args: str | None = None,
) -> dict:
    """The dry run as a JSON-ready dict: ``replaced`` (key → {class: modules}), ``unmatched_keys``,
    ``conflicts`` (messages), ``conversion_rules`` (the rules in force for the model and its sub-models, each with
    the name it is registered under, ``registered_as``, and the checkpoint keys it matches, or ``null`` without a
    folder), ``upstream_fusions`` (the modules Transformers itself fuses: ``fusion_config``, given here or in the
    config), and ``problems``: ``{check: [phrase]}``, what ``verify``'s checks of those names would fail on, in its
    words (:func:`.plan.problem_words`; with a folder, from the safetensors headers: shapes the checkpoint cannot
    fill, parameters left at their initial values, keys not taken, rules that match no key).

    ``fusion_config`` (``{"patch_embeddings": True}``; default: the config's own) lists what a
    ``from_pretrained(..., fusion_config=...)`` would fuse, and a class the recipe replaces that a fusion would
    also replace among the ``conflicts``.

    ``source_args``: how the recipe was given on the command line (default ``--recipe <recipe.name>``), used in the
    advice for a folder already in the recipe's converted layout.

    Raises:
        CliError: missing folder / unknown model type / unreadable checkpoint files (a truncated safetensors file, an
            index naming a missing shard) / a folder already in the recipe's converted layout (``verify``'s message).
    """
    from ..conversion.manual import resolve_transforms
    from ..conversion.rules import match_rule
    from ..patching.provenance import provenance

    config = _config(model_dir, model_type)
    if fusion_config is None:  # a checkpoint saved from a fused load keeps it in its config
        fusion_config = getattr(config, "fusion_config", None)
    check_recipe_fits(recipe, config_names(config), f"'{model_dir}'" if model_dir else f"model type {model_type!r}")
    model, findings = static_findings(recipe, config, model_dir)
    if model_dir is not None and findings.vanilla_missing:
        from .verify import converted_layout_error

        problem = converted_layout_error(
            model_dir,
            recipe,
            config,
            {"missing_keys": findings.vanilla_missing},
            source_args or f"--recipe {recipe.name}",
        )
        if problem is not None:
            raise CliError(problem)
    replaced: dict[str, dict[str, int]] = {key: {} for key in recipe.patch_mapping}
    for module in model.modules() if model is not None else ():
        found = provenance(module)
        if found is not None:
            classes = replaced.setdefault(found.key, {})
            name = f"{found.original.__name__} -> {found.replacement.__name__}"
            classes[name] = classes.get(name, 0) + 1
    # a class both replaced and fused by Transformers is a conflict: verify's load would refuse it
    fusions = (
        _upstream_fusions(model, fusion_config, findings.fusion_conflicts)
        if fusion_config and model is not None
        else []
    )
    keys = checkpoint_keys(model_dir) if model_dir is not None and has_weights(model_dir) else None
    resolved = resolve_transforms(model, None)[0] if model is not None else None
    conversion = []
    for rule in resolved.rules if resolved is not None else ():
        matched = None if keys is None else [k for k in keys if match_rule(rule, k) is not None]
        owner = resolved.owner.get(id(rule)) if resolved is not None else None
        conversion.append({"rule": rule_text(rule), "registered_as": owner, "checkpoint_keys": matched})
    problems = problem_words(findings)
    return {
        "model_type": config.model_type,
        "model_class": type(model).__name__ if model is not None else model_class(config).__name__,
        "recipe": recipe.name,
        "replaced": replaced,
        "unmatched_keys": findings.unmatched_keys,
        "conflicts": findings.conflicts + findings.fusion_conflicts,
        "conversion_rules": conversion,
        "problems": problems,
        "mismatched_keys": [
            {"key": key, "checkpoint_shape": list(ck), "model_shape": list(own)} for key, ck, own in findings.mismatched
        ],
        "missing_keys": findings.missing,
        "unexpected_keys": findings.unexpected,
        "rules_that_matched_nothing": findings.unfired,
        "rules_of_other_model_types": findings.other_types,
        "parameters_on_meta": sum(p.numel() for p in model.parameters()) if model is not None else 0,
        # what Transformers itself would replace in a load with fusion_config (given, or in the config)
        "upstream_fusions": fusions,
    }


def _upstream_fusions(model, fusion_config, conflicts: list[str]) -> list[dict[str, str]]:
    """The modules Transformers' fusions of ``fusion_config`` would replace in ``model`` (read only: what
    ``transformers.fusion_mapping`` discovers, one class at a time, by its specs' ``target_modules_patterns`` and
    ``is_fusable``), in ``named_modules()`` order; a class that the recipe also replaces goes to ``conflicts``
    (``from_pretrained`` refuses it, see :class:`~modelpatch.patching.upstream.FusionConflictError`)."""
    import re

    from ..patching.provenance import provenance

    try:
        import transformers.fusion_mapping as fm

        names = fm._iter_enabled_fusions(fusion_config)  # noqa: SLF001 - Transformers' fusion_config has no public list of the fusions it enables
    except ImportError:
        raise CliError("this Transformers release has no fusion_config") from None
    except ValueError as exc:
        raise CliError(f"{exc} (Transformers has {sorted(fm._FUSION_REGISTRY)})") from None  # noqa: SLF001 - Transformers' fusion registry: no public accessor
    out: list[dict[str, str]] = []
    for name in names:
        spec = fm._FUSION_REGISTRY[name]  # noqa: SLF001 - Transformers' fusion registry: no public accessor
        pattern = re.compile("|".join(spec.target_modules_patterns)) if spec.target_modules_patterns else None
        modules = [(path, m, provenance(m)) for path, m in model.named_modules()]
        fusable = {
            found.original if found is not None else type(m)
            for path, m, found in modules
            if (pattern is None or pattern.search(path)) and spec.is_fusable(m)
        }
        for path, m, found in modules:
            original = found.original if found is not None else type(m)
            if original not in fusable:
                continue
            if found is not None:
                conflicts.append(
                    f"{path}: {original.__name__} is replaced by the recipe ({found.replacement.__name__}) and fused "
                    f"by Transformers' {name!r}: a load with fusion_config refuses it"
                )
                continue
            out.append({"path": path, "original": original.__name__, "replacement": f"Fused{original.__name__}"})
            out[-1]["fusion"] = name
    return out


def render(report: dict) -> str:
    out = [
        f"modelpatch explain: {report['model_class']} ({report['model_type']}), recipe {report['recipe']}, "
        f"built on meta ({report['parameters_on_meta']:,} parameters, none read)"
    ]
    rows = [[key, cls, n] for key, classes in report["replaced"].items() for cls, n in classes.items()]
    out.append(
        section(
            "replacements",
            table(["key", "original -> replacement", "modules"], rows) if rows else "  nothing would be replaced",
        )
    )
    if report["unmatched_keys"]:
        out.append(f"  keys that match nothing: {', '.join(report['unmatched_keys'])}")
    out.append(section("conflicts", "\n".join(f"  {c}" for c in report["conflicts"]) or "  none"))
    if report["upstream_fusions"]:
        fused = [[u["path"], f"{u['original']} -> {u['replacement']}", u["fusion"]] for u in report["upstream_fusions"]]
        out.append(
            section("fused by Transformers (fusion_config)", table(["module", "original -> fused", "fusion"], fused))
        )
    conversion = [
        [
            r["registered_as"] or "transformers",
            r["rule"],
            "-" if r["checkpoint_keys"] is None else len(r["checkpoint_keys"]),
        ]
        for r in report["conversion_rules"]
    ]
    out.append(
        section(
            f"conversion rules for '{report['model_type']}' and its sub-models",
            table(["rules of", "rule", "checkpoint keys"], conversion) if conversion else "  none",
        )
    )
    lines = [f"  {check}: {phrase}" for check, phrases in report["problems"].items() for phrase in phrases]
    out.append(section("what verify would fail on", "\n".join(lines) or "  nothing seen without running the model"))
    return "\n".join(out)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="dry run on the meta device: what a patch would replace",
        description=plain(__doc__.split("\n\n")[0]),
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", metavar="DIR", help="checkpoint folder (only config.json and headers are read)")
    where.add_argument("--model-type", metavar="NAME", help="a model_type with its default config (e.g. llama)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--recipe", metavar="NAME")
    source.add_argument("--patches", metavar="MODULE_OR_FILE")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--fusion",
        metavar="NAME",
        action="append",
        help="list what Transformers' fusion NAME would fuse, as fusion_config={NAME: True} (e.g. patch_embeddings)",
    )
    add_trust_remote_code(parser)
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    recipe = resolve_patches(args.recipe, args.patches)
    fusion = dict.fromkeys(args.fusion, True) if getattr(args, "fusion", None) else None
    source_args = f"--patches {args.patches}" if args.patches is not None else f"--recipe {recipe.name}"
    report = explain(
        recipe, model_dir=args.model, model_type=args.model_type, fusion_config=fusion, source_args=source_args
    )
    emit(strict_json(report) if args.json else render(report))
    return EXIT_FAILED_CHECK if any(report["problems"].values()) else 0
