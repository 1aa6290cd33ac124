"""Plain-text tables for people (``--json`` prints the result's ``as_dict()`` instead)."""

from __future__ import annotations

import re

__all__ = ["table", "section", "plain"]

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
