"""The :class:`Recipe` type: a patch mapping plus the checkpoint conversion rules it needs.

A recipe is applied either for one block (``with recipe.apply(): ...``, nothing left behind on exit, also on
error), for the process (``recipe.register()`` / ``recipe.unregister()``), or to a model already built
(``recipe.patch(model)``, revertible). Two recipes combine with ``+``
(mappings merged, rules of the same ``model_type`` concatenated), e.g. the full example (per-expert experts and
fused QKV on qwen2_moe) is ``get_recipe("qwen2_moe-fused-qkv") + get_recipe("qwen2_moe-linear-experts")``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..apply.blocks import apply_patches
from ..apply.model_patch import ModelPatch, patch_model
from ..conversion import register_checkpoint_conversion_mapping, unregister_checkpoint_conversion_mapping
from ..errors import ModelpatchTypeError, ModelpatchValueError
from ..patching.registry import register_patch_mapping, unregister_patch_mapping
from ..undo import UndoStack

if TYPE_CHECKING:
    import torch.nn as nn
    from transformers.core_model_loading import WeightTransform

    from ..patching.scopes import PatchScope

__all__ = ["Recipe", "RuleSpec"]


@dataclass(frozen=True)
class RuleSpec:
    """Conversion rules registered under one ``model_type`` or class name.

    Attributes:
        factory: builds fresh :class:`~modelpatch.conversion.WeightConverter` / ``WeightRenaming`` instances
            (rules carry per-load state, so each application gets new ones).
        overwrite: drop every built-in Transformers rule of that name (``overwrite=True`` in
            ``register_checkpoint_conversion_mapping``), e.g. to keep per-expert checkpoint keys per-expert.
    """

    factory: Callable[[], Sequence[WeightTransform]]
    overwrite: bool = False

    def rules(self) -> list[WeightTransform]:
        return list(self.factory())


def _copies(rules: tuple[WeightTransform, ...]) -> list[WeightTransform]:
    return [copy.deepcopy(rule) for rule in rules]


@dataclass(frozen=True)
class Recipe:
    """A ready-made patch: ``{class name or pattern: replacement class}`` plus conversion rules.

    Attributes:
        name: registry name (``"llama-fused-qkv"``).
        description: one line for ``list_recipes()`` / ``modelpatch explain``.
        patch_mapping: keys and replacement classes, as given to :func:`modelpatch.apply_patches`.
        conversion: ``{model_type or class name: RuleSpec}``; a plain list of rules is accepted for a name and
            becomes a :class:`RuleSpec` handing out deep copies of them (``overwrite=False``).
        model_types: the ``model_type`` values the recipe is written for (informative, used by the CLI to pick
            a demo config).
    """

    name: str
    description: str
    patch_mapping: Mapping[str, type]
    conversion: Mapping[str, RuleSpec] = field(default_factory=dict)
    model_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.conversion, Mapping):
            raise ModelpatchTypeError(
                f"Recipe {self.name!r}: conversion must be a dict {{model_type or class name: RuleSpec or [rules]}}, "
                f"got {type(self.conversion).__name__}"
            )
        specs: dict[str, RuleSpec] = {}
        for name, spec in self.conversion.items():
            if isinstance(spec, RuleSpec):
                specs[name] = spec
            elif isinstance(spec, Sequence) and not isinstance(spec, (str, bytes)):
                specs[name] = RuleSpec(functools.partial(_copies, tuple(spec)))
            else:
                raise ModelpatchTypeError(
                    f"Recipe {self.name!r}: conversion[{name!r}] must be a RuleSpec or a list of WeightConverter / "
                    f"WeightRenaming, got {type(spec).__name__}"
                )
        object.__setattr__(self, "conversion", specs)

    def build_conversion_rules(self) -> dict[str, list[WeightTransform]]:
        """Fresh rules per registry name: ``{name: [WeightConverter | WeightRenaming, ...]}``."""
        return {name: spec.rules() for name, spec in self.conversion.items()}

    @contextmanager
    def apply(self, *, strict: bool = False) -> Iterator[PatchScope]:
        """Context manager: models built or loaded inside the block get the replacements and conversion rules.

        Yields the :class:`~modelpatch.PatchScope` (``scope.fired``, ``scope.unmatched_keys``). Only the calling
        thread / asyncio task sees the recipe; on exit (normal or exception) nothing remains registered. A model
        loaded inside the block keeps its rules, so its ``save_pretrained`` writes the original layout later too.

        Raises:
            UnmatchedPatchKeyError: ``strict=True`` and a key replaced no module in the block.
            ConversionError: ``strict=True`` and a conversion rule matched no key of a checkpoint loaded in the block.
        """
        overwritten = [name for name, spec in self.conversion.items() if spec.overwrite]
        with apply_patches(
            dict(self.patch_mapping),
            strict=strict,
            conversion_rules=self.build_conversion_rules(),
            overwrite=overwritten,
        ) as scope:
            yield scope

    def patch(self, model: nn.Module, *, strict: bool = False, keep_original: bool = False) -> ModelPatch:
        """Apply the recipe to a model that is already built: :func:`modelpatch.patch_model` with the recipe's
        mapping, rules and ``overwrite`` names (the same composition as :meth:`apply` for a load).

        Returns the :class:`~modelpatch.ModelPatch` (``revert()``, ``report``; a context manager that reverts on
        exit). Raises what :func:`~modelpatch.patch_model` raises; the model is unchanged then.
        """
        overwritten = [name for name, spec in self.conversion.items() if spec.overwrite]
        return patch_model(
            model,
            dict(self.patch_mapping),
            conversion_rules=self.build_conversion_rules(),
            overwrite=overwritten,
            strict=strict,
            keep_original=keep_original,
        )

    def register(self) -> None:
        """Register the mapping and the rules process-wide (every later ``from_pretrained``).

        Raises:
            ValueError: a key or a conversion name is already registered (nothing of this recipe is left
                registered then).
        """
        register_patch_mapping(dict(self.patch_mapping))
        registered = UndoStack()  # undone only if a later registration raises
        registered.callback(unregister_patch_mapping, list(self.patch_mapping))
        try:
            for name, spec in self.conversion.items():
                register_checkpoint_conversion_mapping(name, spec.rules(), overwrite=spec.overwrite)
                registered.callback(unregister_checkpoint_conversion_mapping, name)
        except BaseException:
            registered.undo()
            raise

    def unregister(self) -> None:
        """Undo :meth:`register` (the built-in conversion rules of each name apply again)."""
        unregister_patch_mapping(list(self.patch_mapping))
        for name in self.conversion:
            unregister_checkpoint_conversion_mapping(name)

    def __add__(self, other: Recipe) -> Recipe:
        """Both recipes at once. Rules registered under the same name are concatenated (``overwrite`` if either
        asks for it).

        Raises:
            ValueError: both recipes map the same key to different classes.
        """
        if not isinstance(other, Recipe):
            return NotImplemented
        clash = [
            k
            for k in other.patch_mapping
            if k in self.patch_mapping and self.patch_mapping[k] is not other.patch_mapping[k]
        ]
        if clash:
            raise ModelpatchValueError(f"recipes {self.name!r} and {other.name!r} both patch {clash}")
        conversion = dict(self.conversion)
        for name, spec in other.conversion.items():
            mine = conversion.get(name)
            if mine is None:
                conversion[name] = spec
            else:
                conversion[name] = RuleSpec(_chain(mine.factory, spec.factory), mine.overwrite or spec.overwrite)
        return Recipe(
            name=f"{self.name}+{other.name}",
            description=f"{self.description}; {other.description}",
            patch_mapping={**self.patch_mapping, **other.patch_mapping},
            conversion=conversion,
            model_types=tuple(dict.fromkeys(self.model_types + other.model_types)),
        )


def _chain(
    first: Callable[[], Sequence[WeightTransform]], second: Callable[[], Sequence[WeightTransform]]
) -> Callable[[], list[WeightTransform]]:
    return lambda: list(first()) + list(second())
