"""The ``modelpatch`` console script: ``verify``, ``explain``, ``convert``, ``routing-check``, ``recipes``.

``main(argv=None) -> int`` parses ``argv`` (default ``sys.argv[1:]``), runs one subcommand and returns its exit
status: 0 when every check passed, 1 when a check failed (:data:`~.errors.EXIT_FAILED_CHECK`; also a patch that does
not load), 2 for a usage error,
a missing folder, a folder that is not a checkpoint (or already in the converted layout), unreadable checkpoint
files, an unusable cache folder, a patches file that raises or defines nothing, or an unknown recipe — printed as
one line ``modelpatch: error: ...`` on stderr, never a traceback. ``modelpatch`` alone is ``modelpatch verify``;
``modelpatch --version`` prints the installed version.

Each subcommand runs in a fresh ``contextvars`` context (no ``apply_patches`` block of an in-process caller applies)
inside a :class:`~.sandbox.CommandSandbox` (registries of its own: nothing the caller registered applies, what a
patches file registers is gone afterwards, other threads see theirs unchanged meanwhile), so ``verify``'s
reference load is always the unpatched model.

A subcommand imports what it runs (recipes, routing, conversion, Transformers' modeling code, safetensors) inside the
function that needs it: ``modelpatch --help`` and the parser stay fast and print nothing else, and each subcommand
pays only for its own imports. That is the only reason for the imports inside functions of this package.

Modules: the subcommands (each exposes ``add_parser(subparsers)`` and ``main(args) -> int``) and what they share:

``verify``      patched load vs unpatched reference: patches, loading, provenance, outputs, round trip
``paths``       ``verify``'s checks of padding, KV caches, ``generate`` and MoE routing against the reference
``explain``     dry run on the meta device: what would be replaced and converted, no weight read
``plan``        what ``verify`` fails on that shows without running the model, and the words both commands use
``convert``     :func:`~modelpatch.convert_checkpoint` from the command line
``routing_check`` an engine's MoE routes vs the model's own routing (R3's measures), replayed, ``--plot``
``sources``     where the patches come from: ``--recipe``, ``--patches FILE|MODULE`` (defined or registered)
``sandbox``     every command runs with registries of its own (per thread / asyncio task), empty at the start
``checkpoint``  reading a checkpoint folder (config, safetensors headers, index) with one-line errors
``inputs``      deterministic inputs and the generated default checkpoint (``$MODELPATCH_CACHE``)
``provenance``  every parameter compared by value with the checkpoint tensor it came from
``quantize``    ``verify --quantization``: quantizer names, what was quantized, the quantized save round trip
``train_check`` ``verify --train``: the same optimizer steps patched and unpatched, compared per checkpoint key
``render``      tables, JSON and plain-text help
``errors``      :class:`CliError` and the exit codes
"""

from __future__ import annotations

import argparse
import contextvars
import os
import sys
from collections.abc import Sequence
from contextlib import contextmanager

from ..undo import UndoStack
from . import convert, explain, routing_check, verify
from .checkpoint import trusting_remote_code
from .errors import EXIT_USAGE, CliError
from .render import report_to_stdout_only
from .sandbox import CommandSandbox

__all__ = ["main", "build_parser", "CliError"]


def _list_recipes(args: argparse.Namespace) -> int:
    from ..recipes import get_recipe, list_recipes
    from .render import emit, table

    emit(
        table(["recipe", "what it does"], [[name, get_recipe(name).description] for name in list_recipes()], indent="")
    )
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("modelpatch")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``modelpatch`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="modelpatch", description="Check, explain and convert patched Transformers models."
    )
    parser.add_argument("--version", action="version", version=f"modelpatch {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    verify.add_parser(subparsers)
    explain.add_parser(subparsers)
    convert.add_parser(subparsers)
    routing_check.add_parser(subparsers)
    recipes = subparsers.add_parser("recipes", help="list the ready-made recipes")
    recipes.set_defaults(handler=_list_recipes)
    return parser


@contextmanager
def _quiet_transformers():
    """Transformers' progress bars and Transformers'/modelpatch's warnings off while a command runs (the command
    reports its findings itself: unused keys, conflicts, rules that matched nothing); restored afterwards, so
    ``main()`` can be called in-process. Process-wide, unlike the registries (see :mod:`.sandbox`): logging levels
    and Transformers' progress-bar switch have no per-thread form, so other threads' warnings are quiet too while
    a command runs in-process."""
    import logging as std_logging

    from transformers.utils import logging

    ours = std_logging.getLogger("modelpatch")
    with UndoStack() as undo:
        undo.callback(logging.set_verbosity, logging.get_verbosity())
        if logging.is_progress_bar_enabled():
            undo.callback(logging.enable_progress_bar)
        undo.callback(ours.setLevel, ours.level)
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        ours.setLevel(std_logging.ERROR)
        yield


def _run(args: argparse.Namespace) -> int:
    with (
        report_to_stdout_only(),
        _quiet_transformers(),
        CommandSandbox(),
        trusting_remote_code(getattr(args, "trust_remote_code", False)),
    ):
        return args.handler(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["verify", *argv]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed its one-line usage error
        return int(exit_.code or 0) and EXIT_USAGE
    try:
        return contextvars.Context().run(_run, args)
    except CliError as error:
        print(f"modelpatch: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # output piped into `head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("modelpatch: interrupted", file=sys.stderr)
        return 130
