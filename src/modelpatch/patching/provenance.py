"""What modelpatch remembers on the modules it builds, stored on the instances themselves.

Kept in each instance's ``__dict__`` (not in side tables keyed by object identity), so the record
follows the module through ``copy.deepcopy`` and ``pickle`` (EMA copies, PEFT wrappers, spawn-based
multiprocessing) and dies with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MethodType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .conflicts import Conflict

__all__ = [
    "replacement_of",
    "Replacement",
    "BuildRecord",
    "provenance",
    "set_provenance",
    "build_record",
    "set_build_record",
    "KernelDecision",
    "kernel_decision",
    "set_kernel_decision",
    "hub_kernel_forward",
]

_PROVENANCE_ATTR = "_modelpatch_replaced"
_BUILD_ATTR = "_modelpatch_build"
_KERNEL_ATTR = "_modelpatch_kernel"


class _LiveScope(Protocol):
    """What a :class:`BuildRecord` reads from the still-open scopes that built a model (a
    :class:`~modelpatch.PatchScope`; described here because :mod:`.scopes` imports this module)."""

    @property
    def unmatched_keys(self) -> tuple[str, ...]: ...

    @property
    def not_applicable_keys(self) -> tuple[str, ...]: ...

    def conflicts(self) -> list[Conflict]: ...


@dataclass(frozen=True)
class Replacement:
    """How one module was built: ``replacement`` in place of ``original``, chosen by ``key``."""

    original: type
    replacement: type
    key: str
    arguments: tuple[tuple[Any, ...], dict[str, Any]] = field(default=((), {}), compare=False, repr=False)
    """``(args, kwargs)`` the replacement was built with (the original's constructor arguments): what rebuilding
    its initial values needs when a checkpoint does not provide some of its parameters."""
    via: str = field(default="build", compare=False)
    """``"build"``: built in place of the original while the model was built (``apply_patches``, the registry);
    ``"patch_model"``: swapped into a built model by :func:`~modelpatch.patch_model` (revertible)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("via", "build")  # pickled by a release without the field
        self.__dict__.update(state)


@dataclass
class BuildRecord:
    """The patch keys in force while a ``PreTrainedModel`` was built, and what became of them.

    ``unmatched`` (keys naming no class that exists), ``not_applicable`` (keys naming classes that exist but
    were not built: another model family) and ``conflicts`` are filled when the scopes that built the model
    finish; until then :func:`~modelpatch.patch_report` computes them from the live scopes.
    """

    keys: tuple[str, ...]
    unmatched: tuple[str, ...] | None = None
    conflicts: tuple[Conflict, ...] = ()
    not_applicable: tuple[str, ...] = ()
    scopes: tuple[_LiveScope, ...] = field(default=(), repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["scopes"] = ()  # live scopes are process-local
        return state


def provenance(module: object) -> Replacement | None:
    """How ``module`` was built, if modelpatch built it as a replacement; else ``None``."""
    return getattr(module, "__dict__", {}).get(_PROVENANCE_ATTR)


def replacement_of(module: object) -> Replacement | None:
    """Which replacement ``module`` is: a :class:`Replacement` (``original`` class, ``replacement`` class, the
    patch ``key`` that chose it) when modelpatch built it in place of an original class, else ``None``.

    The answer is stored on the module itself, so it survives ``copy.deepcopy`` and ``pickle``.
    """
    return provenance(module)


def set_provenance(module: object, record: Replacement) -> None:
    object.__setattr__(module, _PROVENANCE_ATTR, record)


def build_record(model: object) -> BuildRecord | None:
    """The :class:`BuildRecord` of a model built while patch scopes were active; else ``None``."""
    return getattr(model, "__dict__", {}).get(_BUILD_ATTR)


def set_build_record(model: object, record: BuildRecord) -> None:
    object.__setattr__(model, _BUILD_ATTR, record)


@dataclass(frozen=True)
class KernelDecision:
    """A hub kernel (the ``kernels`` library's ``kernelize``, run by Transformers' ``use_kernels``) that met a
    replaced module: the kernel for ``layer`` (the class's ``kernel_layer_name``) from ``repo``, and which forward
    runs: ``"patch"`` (the replacement's own forward, kept by modelpatch) or ``"kernel"``."""

    layer: str
    repo: str
    winner: str

    def describe(self) -> str:
        if self.winner == "patch":
            return f"hub kernel {self.layer!r} ({self.repo}) not applied: the replacement's forward runs"
        return f"hub kernel {self.layer!r} ({self.repo}) runs in place of the forward"


def kernel_decision(module: object) -> KernelDecision | None:
    """The :class:`KernelDecision` modelpatch took for ``module`` when Transformers kernelized its model, if any."""
    return getattr(module, "__dict__", {}).get(_KERNEL_ATTR)


def set_kernel_decision(module: object, decision: KernelDecision) -> None:
    object.__setattr__(module, _KERNEL_ATTR, decision)


def hub_kernel_forward(module: object) -> Any:
    """The forward a hub kernel put on ``module`` itself, or ``None`` when the class's own forward runs.

    ``kernels.kernelize`` assigns ``module.forward = MethodType(kernel.forward, module)`` and records the kernel's
    repository in ``module._kernel_repo`` (kernels 0.18 and 0.19); other instance forwards (accelerate's hooks, a
    fallback to the class's forward) are not kernels."""
    own = getattr(module, "__dict__", {})
    forward = own.get("forward")
    if forward is None or "_kernel_repo" not in own or not isinstance(forward, MethodType):
        return None
    return None if forward.__func__ is getattr(type(module), "forward", None) else forward
