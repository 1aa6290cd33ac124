"""``patch_report(model)``: what modelpatch changed in a model, read from the model itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from .conflicts import Conflict, find_conflicts
from .integration import scopes_that_built
from .scope import provenance

__all__ = ["PatchRow", "PatchReport", "patch_report"]


@dataclass(frozen=True)
class PatchRow:
    """One replaced module: its path in the model, the original class and the replacement class."""

    path: str
    original: type
    replacement: type
    key: str


@dataclass
class PatchReport:
    """Rows of replaced modules, keys that replaced nothing, container/inner conflicts.

    ``conversion`` holds the weight conversion rows (rule -> checkpoint keys) when the conversion layer
    recorded any for this model.
    """

    rows: list[PatchRow] = field(default_factory=list)
    unmatched_keys: list[str] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    conversion: list = field(default_factory=list)

    def as_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "replaced": [
                {"path": r.path, "original": _qualname(r.original), "replacement": _qualname(r.replacement), "key": r.key}
                for r in self.rows
            ],
            "unmatched_keys": list(self.unmatched_keys),
            "conflicts": [c.message() for c in self.conflicts],
            "conversion": [getattr(row, "as_dict", lambda row=row: row)() for row in self.conversion],
        }

    def __str__(self) -> str:
        lines = [f"{len(self.rows)} module(s) replaced"]
        width = max((len(r.path) for r in self.rows), default=4)
        for r in self.rows:
            lines.append(f"  {r.path:<{width}}  {r.original.__name__} -> {_qualname(r.replacement)}  [{r.key}]")
        if self.unmatched_keys:
            lines.append(f"keys that replaced nothing: {', '.join(self.unmatched_keys)}")
        lines.extend(c.message() for c in self.conflicts)
        return "\n".join(lines)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def patch_report(model: nn.Module) -> PatchReport:
    """Report the class replacements in ``model``.

    Returns:
        A :class:`PatchReport` with one :class:`PatchRow` per replaced module (path as in
        ``model.named_modules()``), the keys of the mappings in force while the model was built that
        replaced nothing, and container/inner conflicts (see :mod:`modelpatch.conflicts`).
    """
    report = PatchReport()
    originals = {}
    for path, module in model.named_modules():
        found = provenance(module)
        if found is not None:
            report.rows.append(PatchRow(path or "<root>", found.original, found.replacement, found.key))
            originals[found.original] = True
    scopes = scopes_that_built(model)
    seen_keys: list[str] = []
    fired = {row.key for row in report.rows}
    for scope in scopes:
        for key in scope.mapping.keys:
            if key not in fired and key not in seen_keys:
                seen_keys.append(key)
        for conflict in find_conflicts(scope.resolved, list(originals)):
            if conflict not in report.conflicts:
                report.conflicts.append(conflict)
    report.unmatched_keys = seen_keys
    try:
        from .conversion import conversion_report  # the conversion layer, when present
    except ImportError:
        conversion_report = None
    if conversion_report is not None:
        report.conversion = list(conversion_report(model))
    return report
