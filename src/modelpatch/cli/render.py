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
