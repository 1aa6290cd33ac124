"""``modelpatch convert SRC DST``: write a converted copy of a checkpoint (or, with ``--reverse``, the original
layout back), streaming tensor by tensor through :func:`modelpatch.conversion.convert_checkpoint`.

The rules are those a recipe or patches file brings for the checkpoint's ``model_type`` (``--model-type`` or
``config.json``), composed with the built-in Transformers rules they do not replace.
"""

from __future__ import annotations

import argparse
import json
import os

from .checkpoint import add_trust_remote_code
from .errors import CliError
from .render import emit, plain, table
from .sources import check_model_type, check_recipe_fits, resolve_patches

__all__ = ["add_parser", "main"]


def _model_type(src: str, given: str | None) -> str:
    if given:
        return given
    folder = src if os.path.isdir(src) else os.path.dirname(src)
    try:
        with open(os.path.join(folder, "config.json")) as fh:
            return json.load(fh)["model_type"]
    except (OSError, KeyError, ValueError):
        raise CliError(f"cannot read model_type from '{folder}/config.json'; pass --model-type") from None


def _already_converted(src: str, recipe) -> tuple[str, str] | None:
    """``(a converted key, the source patterns)`` when the folder ``src`` is already in ``recipe``'s converted
    layout (:func:`.verify.converted_layout_rule`), else ``None`` (also for a source that is not a readable folder)."""
    from .checkpoint import read_config
    from .verify import converted_layout_rule

    if not os.path.isfile(os.path.join(src, "config.json")):
        return None
    try:
        return converted_layout_rule(src, recipe, read_config(src))
    except Exception:  # noqa: BLE001 - only a better message is at stake: the conversion error stands otherwise
        return None


def _nothing_to_convert(args: argparse.Namespace, recipe, model_type: str, exc: Exception) -> str:
    """The one-line error when no rule of ``recipe`` matches a key of the source: already converted (and the reverse
    would apply), or a checkpoint the recipe loads as it is."""
    from ..conversion.offline import rules_matching

    source_args = f"--patches {args.patches}" if args.patches is not None else f"--recipe {recipe.name}"
    converted = None if args.reverse else _already_converted(args.src, recipe)
    if converted is not None:
        with recipe.apply():
            back = rules_matching(args.src, model_type, reverse=True)
        if back:
            key, sources = converted
            return (
                f"'{args.src}' is already in the converted layout of {recipe.name} (it has '{key}' and no key "
                f"matching {sources}); nothing was written. To write it back to the original layout: "
                f"`modelpatch convert {args.src} DST {source_args} --reverse`"
            )
    if args.reverse:
        return (
            f"no rule of {recipe.name} matches a key of '{args.src}' in reverse: it is not in the layout "
            f"{recipe.name} converts to (a folder written by `modelpatch convert SRC DST {source_args}`); nothing "
            "was written"
        )
    return (
        f"no rule of {recipe.name} changes a key of '{args.src}': its keys already are the layout the recipe loads, "
        f"so there is nothing to convert (load it as it is, e.g. `modelpatch verify --model {args.src} "
        f"{source_args}`); nothing was written"
    )


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert", help="write a converted checkpoint (or the reverse)", description=plain(__doc__.split("\n\n")[0])
    )
    parser.add_argument("src", metavar="SRC", help="checkpoint folder or .safetensors file")
    parser.add_argument("dst", metavar="DST", help="output folder")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--recipe", metavar="NAME")
    source.add_argument("--patches", metavar="MODULE_OR_FILE")
    parser.add_argument("--model-type", metavar="NAME", help="registry name of the rules (default: config.json)")
    parser.add_argument("--reverse", action="store_true", help="converted layout -> original layout")
    parser.add_argument("--json", action="store_true")
    add_trust_remote_code(parser)
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    from ..conversion import ConversionError, NothingToConvertError, convert_checkpoint
    from .plan import other_type_rules

    if not os.path.exists(args.src):
        raise CliError(f"source '{args.src}' does not exist")
    recipe = resolve_patches(args.recipe, args.patches)
    model_type = _model_type(args.src, args.model_type)
    if args.model_type and not args.model_type[:1].isupper():  # a class name is a registry name too
        check_model_type(args.model_type, set(recipe.build_conversion_rules()))
    check_recipe_fits(recipe, {model_type}, f"'{args.src}'" + (" (--model-type)" if args.model_type else ""))
    try:
        with recipe.apply():
            rows = convert_checkpoint(args.src, args.dst, model_type, reverse=args.reverse)
    except NothingToConvertError as exc:
        raise CliError(_nothing_to_convert(args, recipe, model_type, exc)) from None
    except ConversionError as exc:
        other = other_type_rules(recipe, {model_type})
        raise CliError(str(exc).splitlines()[0] + (f"; {other}" if other else "")) from None
    except (OSError, ValueError, SafetensorError) as exc:  # unwritable DST, truncated file, broken index.json
        raise CliError(
            f"cannot convert {args.src} -> {args.dst}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from None
    if args.json:
        emit(
            json.dumps(
                [
                    {"rule": r.rule, "source_keys": list(r.source_keys), "target_keys": list(r.target_keys)}
                    for r in rows
                ],
                indent=2,
            )
        )
    else:
        emit(
            f"converted {args.src} -> {args.dst} ({model_type}, {'reverse' if args.reverse else 'forward'}): "
            f"{len(rows)} group(s)"
        )
        emit(table(["from", "to"], [[", ".join(r.source_keys), ", ".join(r.target_keys)] for r in rows]))
    return 0
