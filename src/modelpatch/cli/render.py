"""Plain-text tables for people (``--json`` prints the result's ``as_dict()`` instead)."""

from __future__ import annotations

__all__ = ["table", "section"]


def table(headers: list[str], rows: list[list[object]], indent: str = "  ") -> str:
    """Left-aligned columns separated by two spaces; ``headers`` first, then a dashed rule."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(indent + line for line in lines)


def section(title: str, body: str = "") -> str:
    return f"\n== {title}\n{body}" if body else f"\n== {title}"
