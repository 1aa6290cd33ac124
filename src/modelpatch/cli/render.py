"""Plain-text tables for people (``--json`` prints the result's ``as_dict()`` instead)."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from contextvars import ContextVar
from typing import TextIO

from ..undo import UndoStack

__all__ = ["table", "section", "plain", "emit", "report_to_stdout_only"]

# The stream a running command's report goes to: the stdout it was started with (see report_to_stdout_only).
_REPORT: ContextVar[TextIO | None] = ContextVar("modelpatch_cli_report", default=None)


def emit(text: str) -> None:
    """Print ``text`` (a report, a table, a JSON document) to the command's report stream: the stdout the command
    was started with, even while :func:`report_to_stdout_only` sends other output to stderr."""
    print(text, file=_REPORT.get() or sys.stdout)


@contextmanager
def report_to_stdout_only() -> Iterator[None]:
    """While a command runs, stdout carries its report alone (:func:`emit`): what libraries print there (DeepSpeed
    logs "Setting accelerator to CPU" to stdout when Transformers imports it; torchao, bitsandbytes) goes to stderr,
    so ``--json`` output parses. ``sys.stdout`` is process-wide: another thread's prints also go to stderr while a
    command runs in-process, as its logging levels are (:func:`modelpatch.cli._quiet_transformers`). Logging
    handlers that already write to stdout (DeepSpeed's binds ``sys.stdout`` when it is imported, which may be before
    the command) write to stderr until the command returns."""
    with UndoStack() as undo:
        undo.set_context(_REPORT, sys.stdout)
        for handler in _handlers_writing_to(sys.stdout):
            undo.setattr(handler, "stream", sys.stderr)
        undo.enter_context(redirect_stdout(sys.stderr))
        yield


def _handlers_writing_to(stream: object) -> list[logging.StreamHandler]:
    """Every ``logging.StreamHandler`` of the root logger or a named logger whose stream is ``stream``."""
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    return [
        h
        for lg in loggers
        for h in lg.handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and h.stream is stream
    ]


_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(?P<short>~?)\.?(?P<target>[^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """Docstring text (reST) as plain text for ``--help``: double-backtick literals without their backticks, a role
    such as ``:func:`~a.b``` as the name it shows (``b``; ``a.b`` without the tilde), lines joined by one space."""

    def role(match: re.Match) -> str:
        target = match.group("target")
        return target.rsplit(".", 1)[-1] if match.group("short") else target

    return " ".join(_LITERAL.sub(r"\1", _ROLE.sub(role, text)).split())


def table(headers: list[str], rows: list[list[object]], indent: str = "  ") -> str:
    """Left-aligned columns separated by two spaces; ``headers`` first, then a dashed rule."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(indent + line for line in lines)


def section(title: str, body: str = "") -> str:
    return f"\n== {title}\n{body}" if body else f"\n== {title}"


def strict_json(document: object) -> str:
    """``document`` as JSON that strict parsers read: non-finite floats (a NaN max abs diff of a broken patch)
    become the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` instead of the bare tokens ``json`` writes."""
    import json
    import math

    def clean(value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(document), indent=2, allow_nan=False)
