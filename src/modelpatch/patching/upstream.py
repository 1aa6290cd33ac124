"""What Transformers itself replaces while it builds a model: the fusions of ``fusion_config``.

Transformers 5.24 and later fuse modules while they build a model when ``from_pretrained(...,
fusion_config={"patch_embeddings": True})`` (or a config's ``fusion_config``) asks for it
(``transformers.fusion_mapping``): a discovery step builds the model class once on the ``meta`` device, finds the
module classes a fusion spec (``ModuleFusionSpec``) accepts, caches ``{class name: Fused<Class>}`` per model class
(``_FUSION_DISCOVERY_CACHE``) and rebinds those names while the real model is built. Transformers 5.23 has no
``fusion_config``.

modelpatch coexists with it:

* the discovery build sees Transformers' own classes (:func:`in_fusion_discovery`: a scope replaces nothing there),
  so its cache holds what Transformers alone computes and later fused loads in the process are fused;
* a module class that a modelpatch patch and a fusion both replace is refused after the build
  (:class:`FusionConflictError`), never silently left to one of them;
* :func:`upstream_fusions` lists the fused modules of a model for :func:`~modelpatch.patch_report` and
  ``modelpatch explain``.

Nothing here changes Transformers' caches or registries; it only reads them.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from types import FrameType

import torch.nn as nn

from ..errors import ModelpatchError
from ..undo import context_set

__all__ = [
    "FusionConflictError",
    "UpstreamFusion",
    "fusion_available",
    "fused_original",
    "in_fusion_discovery",
    "is_upstream_fused",
    "record_fusion_conflict",
    "fusion_conflicts_checked",
    "upstream_fusions",
]

_FUSION_MODULE = "transformers.fusion_mapping"


class FusionConflictError(ModelpatchError, ValueError):
    """A module class is replaced both by a modelpatch patch and by a Transformers fusion (``fusion_config``)."""


@dataclass(frozen=True)
class UpstreamFusion:
    """One module of a model that Transformers fused.

    Attributes:
        path: the module's name in ``model.named_modules()``.
        original: the class Transformers' modeling code builds there (``PatchEmbed``).
        fused: the class Transformers built instead (``FusedPatchEmbed``).
        fusion: the ``fusion_config`` key that asked for it (``"patch_embeddings"``).
    """

    path: str
    original: type
    fused: type
    fusion: str


def _fusion_module():
    return sys.modules.get(_FUSION_MODULE)


def fusion_available() -> bool:
    """Whether the installed Transformers has ``fusion_config`` (5.24 and later)."""
    try:
        import transformers.fusion_mapping as fm
    except ImportError:
        return False
    return hasattr(fm, "_FUSION_REGISTRY") and hasattr(fm, "_discover_fusable_modules")


def in_fusion_discovery() -> bool:
    """Whether the caller runs inside Transformers' fusion discovery build (``_discover_fusable_modules``, which
    builds the model class on the ``meta`` device to find the fusable module classes and caches them per model
    class). Read from the call stack; ``False`` when ``transformers.fusion_mapping`` was never imported."""
    module = _fusion_module()
    discover = getattr(module, "_discover_fusable_modules", None)
    if discover is None:
        return False
    code = getattr(inspect.unwrap(discover), "__code__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _fused_classes() -> dict[type, str]:
    """``{fused class: fusion name}`` of every fusion Transformers discovered in this process."""
    module = _fusion_module()
    cache = getattr(module, "_FUSION_DISCOVERY_CACHE", None) or {}
    return {
        fused: name for name, per_model in cache.items() for mapping in per_model.values() for fused in mapping.values()
    }


def is_upstream_fused(cls: type) -> bool:
    """Whether ``cls`` is a class a Transformers fusion built (``Fused<Class>``, made by ``make_fused_class``)."""
    return cls.__module__ == _FUSION_MODULE and cls in _fused_classes()


def fused_original(cls: type) -> type:
    """The Transformers class a fused class replaces (its base that the fusion did not add)."""
    return next((b for b in cls.__mro__[1:] if b.__module__ != _FUSION_MODULE), cls)


def upstream_fusions(model: nn.Module) -> list[UpstreamFusion]:
    """The modules of ``model`` that Transformers fused (``fusion_config``), in ``named_modules()`` order; ``[]``
    on a release without ``fusion_config`` or for a model loaded without it."""
    fused = _fused_classes()
    if not fused:
        return []
    return [
        UpstreamFusion(path or "<root>", fused_original(type(m)), type(m), fused[type(m)])
        for path, m in model.named_modules()
        if type(m) in fused
    ]


# (original, modelpatch replacement, fused class) met while the current build runs; None outside a build
_CONFLICTS: ContextVar[list[tuple[type, type, type]] | None] = ContextVar("modelpatch_fusion_conflicts", default=None)


def record_fusion_conflict(original: type, replacement: type, fused: type) -> None:
    """Note that Transformers built ``fused`` where a modelpatch scope replaces ``original`` with ``replacement``
    (called by the construction hook of ``original``); the build that is running raises it when it ends."""
    found = _CONFLICTS.get()
    if found is not None and (original, replacement, fused) not in found:
        found.append((original, replacement, fused))


@contextlib.contextmanager
def fusion_conflicts_checked() -> Iterator[None]:
    """Around one ``from_pretrained`` / ``_from_config``: raise :class:`FusionConflictError` after it returns if a
    fusion took the place of a class a modelpatch scope replaces (the outermost build raises, once Transformers has
    left its own contexts, so that nothing of Transformers is left rebound).

    Raises:
        FusionConflictError: names the class, the replacement, the fused class and what to drop.
    """
    if _CONFLICTS.get() is not None:  # a build inside a build (a composite's sub-model): the outer one checks
        yield
        return
    found: list[tuple[type, type, type]] = []
    with context_set(_CONFLICTS, found):
        yield
    if found:
        original, replacement, fused = found[0]
        fusion = _fused_classes().get(fused, "?")
        raise FusionConflictError(
            f"{original.__qualname__} is replaced both by modelpatch ({replacement.__qualname__}) and by "
            f"Transformers' fusion {fusion!r} of fusion_config ({fused.__qualname__}); Transformers built "
            f"{fused.__qualname__}, so the patch would be silently lost: load without fusion_config={{{fusion!r}: "
            f"True}} or without the patch of {original.__name__}"
        )
