"""``patch_report(model)``: what modelpatch changed in a model, read from the model itself."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from .conflicts import Conflict
from .provenance import KernelDecision, build_record, hub_kernel_forward, kernel_decision, provenance
from .upstream import UpstreamFusion, upstream_fusions

__all__ = ["PatchRow", "PatchReport", "patch_report", "add_conversion_reader"]


@dataclass(frozen=True)
class PatchRow:
    """One replaced module: its path in the model, the original class and the replacement class."""

    path: str
    original: type
    replacement: type
    key: str
    via: str = "build"
    """``"build"`` (replaced while the model was built) or ``"patch_model"`` (swapped into the built model)."""
    kernel: str | None = None
    """A hub kernel that met this module (Transformers' ``use_kernels``): which forward runs, the replacement's or
    the kernel's (see :mod:`modelpatch.integrations.kernels`); ``None`` when no kernel is involved."""


@dataclass
class PatchReport:
    """Rows of replaced modules, keys that replaced nothing, container/inner conflicts.

    ``unmatched_keys`` name no class that exists (typos); ``not_applicable_keys`` name classes that exist but
    that this model did not build (keys of another model family in a shared registry). ``conversion`` holds
    the weight conversion rows (rule -> checkpoint keys) when the conversion layer recorded any for this model.
    ``upstream`` lists the modules Transformers itself replaced while it built the model (the fusions of
    ``fusion_config``, Transformers 5.24+; see :mod:`modelpatch.patching.upstream`).
    """

    rows: list[PatchRow] = field(default_factory=list)
    unmatched_keys: list[str] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    conversion: list[Any] = field(default_factory=list)  # rows of the conversion layer (duck-typed ``as_dict``)
    not_applicable_keys: list[str] = field(default_factory=list)
    upstream: list[UpstreamFusion] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "replaced": [
                {
                    "path": r.path,
                    "original": _qualname(r.original),
                    "replacement": _qualname(r.replacement),
                    "key": r.key,
                    "via": r.via,
                    "kernel": r.kernel,
                }
                for r in self.rows
            ],
            "unmatched_keys": list(self.unmatched_keys),
            "not_applicable_keys": list(self.not_applicable_keys),
            "conflicts": [c.message() for c in self.conflicts],
            "conversion": [getattr(row, "as_dict", lambda row=row: row)() for row in self.conversion],
            "upstream": [
                {
                    "path": u.path,
                    "original": _qualname(u.original),
                    "replacement": _qualname(u.fused),
                    "fusion": u.fusion,
                }
                for u in self.upstream
            ],
        }

    def __str__(self) -> str:
        lines = [f"{len(self.rows)} module(s) replaced"]
        width = max((len(r.path) for r in self.rows), default=4)
        for r in self.rows:
            via = "  (patch_model)" if r.via == "patch_model" else ""
            lines.append(f"  {r.path:<{width}}  {r.original.__name__} -> {_qualname(r.replacement)}  [{r.key}]{via}")
            if r.kernel is not None:
                lines.append(f"  {'':<{width}}  {r.kernel}")
        if self.unmatched_keys:
            lines.append(f"keys that replaced nothing: {', '.join(self.unmatched_keys)}")
        if self.not_applicable_keys:
            lines.append(f"keys of classes this model does not build: {', '.join(self.not_applicable_keys)}")
        lines.extend(c.message() for c in self.conflicts)
        if self.upstream:
            lines.append(f"{len(self.upstream)} module(s) fused by Transformers (fusion_config)")
            width = max(len(u.path) for u in self.upstream)
            for u in self.upstream:
                lines.append(f"  {u.path:<{width}}  {u.original.__name__} -> {u.fused.__name__}  [{u.fusion}]")
        return "\n".join(lines)


def _kernel_note(module: nn.Module) -> str | None:
    """Which forward runs where a hub kernel met ``module``: read live (a ``kernels.kernelize`` called directly, past
    Transformers, shows too), else what modelpatch decided when Transformers kernelized the model."""
    if hub_kernel_forward(module) is not None:
        layer = getattr(type(module), "kernel_layer_name", "?")
        repo = vars(module).get("_kernel_repo")
        return KernelDecision(str(layer), str(repo) if repo is not None else "unknown repository", "kernel").describe()
    decision = kernel_decision(module)
    return decision.describe() if decision is not None and decision.winner == "patch" else None


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def patch_report(model: nn.Module) -> PatchReport:
    """Report the class replacements in ``model``.

    Returns:
        A :class:`PatchReport` with one :class:`PatchRow` per replaced module (path as in
        ``model.named_modules()``; ``via="patch_model"`` for modules swapped into the built model by
        :func:`~modelpatch.patch_model`, listed until that patch is reverted), the keys of the mappings in force while the model was built that
        matched no class built, split into ``unmatched_keys`` (they name no class that exists) and
        ``not_applicable_keys`` (they name classes of another model family, or classes this model does not
        use), container/inner conflicts (see :mod:`modelpatch.patching.conflicts`), and the
        weight conversion rows (rule -> checkpoint keys) when rules converted its checkpoint. The
        records live on the modules, so the report survives ``copy.deepcopy`` and ``pickle``.
    """
    report = PatchReport()
    for path, module in model.named_modules():
        found = provenance(module)
        if found is not None:
            via = getattr(found, "via", "build")
            row = PatchRow(path or "<root>", found.original, found.replacement, found.key, via, _kernel_note(module))
            report.rows.append(row)
    record = build_record(model)
    if record is not None:
        if record.unmatched is not None:
            report.unmatched_keys = list(record.unmatched)
            # getattr: a record pickled by an earlier release has no such field
            report.not_applicable_keys = list(getattr(record, "not_applicable", ()))
            report.conflicts = list(record.conflicts)
        else:  # the scopes that built the model are still open: read them live
            unmatched = set().union(*(scope.unmatched_keys for scope in record.scopes))
            not_applicable = set().union(*(scope.not_applicable_keys for scope in record.scopes))
            report.unmatched_keys = [k for k in record.keys if k in unmatched]
            report.not_applicable_keys = [k for k in record.keys if k in not_applicable - unmatched]
            report.conflicts = [c for scope in record.scopes for c in scope.conflicts()]
    for reader in _CONVERSION_READERS:
        report.conversion.extend(reader(model))
    report.upstream = upstream_fusions(model)
    return report


_ConversionReader = Callable[[nn.Module], Iterable[Any]]

_CONVERSION_READERS: list[_ConversionReader] = []


def add_conversion_reader(reader: _ConversionReader) -> None:
    """Have :func:`patch_report` fill ``PatchReport.conversion`` with ``reader(model)`` (a list of rows).

    The conversion layer registers :func:`modelpatch.conversion.conversion_report` here when it is imported;
    this module does not import it (dependencies point from conversion to patching, never back).
    """
    if reader not in _CONVERSION_READERS:
        _CONVERSION_READERS.append(reader)
