"""Where the patches come from: a recipe name, or a patches module / ``.py`` file.

A **patches file** (``--patches path/to/patches.py``) or **module** (``--patches mypkg.patches``) defines:

``PATCH_MAPPING``         required, ``{class name or regex: replacement class}`` (as for ``apply_patches``)
``CONVERSION_RULES``      optional, ``{model_type or class name: [WeightConverter | WeightRenaming, ...]}``
``CONVERSION_OVERWRITE``  optional, ``True`` (every name) or a collection of names whose built-in Transformers
                          rules are dropped (``register_checkpoint_conversion_mapping(..., overwrite=True)``)

or, instead of all three, ``RECIPE = modelpatch.recipes.Recipe(...)``. The file is executed once per command.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import sys
import uuid
from collections.abc import Mapping

from ..recipes import Recipe, RuleSpec, UnknownRecipeError, get_recipe
from .errors import CliError

__all__ = ["resolve_patches", "recipe_from_namespace"]


def _load_module(source: str):
    if source.endswith(".py") or os.sep in source or "/" in source:
        if not os.path.isfile(source):
            raise CliError(f"patches file '{source}' does not exist")
        name = f"modelpatch_patches_{uuid.uuid4().hex}"
        spec = importlib.util.spec_from_file_location(name, source)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - any error in user code becomes one line
            sys.modules.pop(name, None)
            raise CliError(f"patches file '{source}' raised {type(exc).__name__}: {exc}") from None
        return module
    try:
        return _import_from_cwd(source)
    except ModuleNotFoundError as exc:
        if exc.name and source.startswith(exc.name):
            raise CliError(f"patches module '{source}' not found (give a module name or a .py file)") from None
        raise CliError(f"patches module '{source}' raised ModuleNotFoundError: {exc}") from None
    except Exception as exc:  # noqa: BLE001
        raise CliError(f"patches module '{source}' raised {type(exc).__name__}: {exc}") from None


def _import_from_cwd(name: str):
    """Import a module by name with the current directory on ``sys.path``, as ``python -m`` has it (a console
    script does not, so ``--patches my_patches`` would not find ``./my_patches.py``)."""
    cwd = os.getcwd()
    if cwd in sys.path or "" in sys.path:
        return importlib.import_module(name)
    sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(cwd)


def recipe_from_namespace(namespace: Mapping, label: str) -> Recipe:
    """Build a :class:`Recipe` from a patches module's globals (see the module docstring).

    Raises:
        CliError: no ``PATCH_MAPPING``/``RECIPE``, or values of the wrong type.
    """
    recipe = namespace.get("RECIPE")
    if recipe is not None:
        if not isinstance(recipe, Recipe):
            raise CliError(f"{label}: RECIPE must be a modelpatch.recipes.Recipe, got {type(recipe).__name__}")
        return recipe
    mapping = namespace.get("PATCH_MAPPING")
    if not isinstance(mapping, Mapping) or not mapping:
        raise CliError(f"{label} defines no PATCH_MAPPING dict (or RECIPE)")
    rules = namespace.get("CONVERSION_RULES") or {}
    if not isinstance(rules, Mapping):
        raise CliError(f"{label}: CONVERSION_RULES must be a dict {{model_type: [rules]}}")
    overwrite = namespace.get("CONVERSION_OVERWRITE", False)
    if overwrite is True:
        overwrite_names = set(rules)
    else:
        overwrite_names = {overwrite} if isinstance(overwrite, str) else set(overwrite or ())
    conversion = {
        name: RuleSpec(lambda rules=tuple(value): [copy.deepcopy(r) for r in rules], name in overwrite_names)
        for name, value in rules.items()
    }
    return Recipe(name=label, description=f"patches from {label}", patch_mapping=dict(mapping), conversion=conversion)


def resolve_patches(recipe: str | None, patches: str | None) -> Recipe:
    """The recipe named ``recipe``, or the one a patches module/file defines.

    Raises:
        CliError: unknown recipe, missing/raising patches file, or neither given.
    """
    if recipe is not None:
        try:
            return get_recipe(recipe)
        except UnknownRecipeError as exc:
            raise CliError(str(exc)) from None
    if patches is not None:
        module = _load_module(patches)
        recipe = recipe_from_namespace(vars(module), patches)
        try:  # validates the mapping and the rules (types, regexes) before anything is loaded
            with recipe.apply():
                pass
        except (TypeError, ValueError) as exc:
            raise CliError(f"{patches}: invalid patches: {str(exc).splitlines()[0]}") from None
        return recipe
    raise CliError("give --recipe NAME or --patches MODULE_OR_FILE")
