"""Where the patches come from: a recipe name, or a patches module / ``.py`` file.

A **patches file** (``--patches path/to/patches.py``) or **module** (``--patches mypkg.patches``) defines:

``PATCH_MAPPING``         ``{class name or regex: replacement class}`` (as for ``apply_patches``)
``CONVERSION_RULES``      optional, ``{model_type or class name: [WeightConverter | WeightRenaming, ...]}``
                          (modelpatch's rule classes or Transformers' own)
``CONVERSION_OVERWRITE``  optional, ``True`` (every name) or a collection of names whose built-in Transformers
                          rules are dropped (``register_checkpoint_conversion_mapping(..., overwrite=True)``)

or, instead of all three, ``RECIPE = modelpatch.recipes.Recipe(...)``; or it registers its patches when imported
(``register_patch_mapping(...)``, ``register_checkpoint_conversion_mapping(...)`` at module level, the way scripts
written for Transformers' own registries do it).
What it registers is read back (the registries before and after the import are compared), taken as patches under
test together with what it defines, and removed from the registries again: the command's reference load stays
unpatched (see :mod:`.sandbox`). A file that defines nothing and registers nothing is an error.

The file is executed once per command (a module already imported is reloaded), with its own folder first on
``sys.path`` as ``python file.py`` has it, so ``from my_helpers import MyAttention`` finds ``my_helpers.py`` beside
it. The folder stays on ``sys.path`` until the command ends (imports inside the file's functions run while models are
built and run), then it is removed and the modules imported from it are forgotten: ``sys.path`` and ``sys.modules``
are left as they were.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import os
import sys
import uuid
from collections.abc import Collection, Mapping

from ..conversion.rules import as_modelpatch_rule
from ..recipes import Recipe, RuleSpec, UnknownRecipeError, UnsupportedExpertsError, get_recipe
from ..undo import UndoStack
from .errors import CliError
from .sandbox import (
    Registrations,
    TransformersRegistries,
    active_sandbox,
    current_registrations,
    registered_between,
    set_registrations,
)

__all__ = ["resolve_patches", "recipe_from_namespace"]


def _load_module(source: str):
    """Import the patches file or module ``source``; returns ``(module, what it registered)`` and leaves the
    registries (modelpatch's and Transformers' own) as they were before the import, also when the import raises.

    Raises:
        CliError: the import raised, or it registered into Transformers' own registries (which Transformers applies
            to every load, the unpatched reference included, and modelpatch does not read): the message names the
            calls and the import to write instead.
    """
    before, transformers_before = current_registrations(), TransformersRegistries.read()
    with UndoStack() as undo:  # both registries as they were, also when the import raises
        undo.callback(transformers_before.restore)
        undo.callback(set_registrations, before)
        try:
            module = _import(source)
        finally:  # what the import registered, read before the undo removes it
            after, transformers_after = current_registrations(), TransformersRegistries.read()
    foreign = transformers_after.changes_since(transformers_before)
    if foreign:
        raise CliError(
            f"{source} registers into Transformers' own registries ({', '.join(foreign)}), which Transformers applies "
            "to every load, the unpatched reference included: write `from modelpatch import register_patch_mapping, "
            "register_checkpoint_conversion_mapping` instead of the transformers.monkey_patching / "
            "transformers.conversion_mapping imports (the rule classes may stay Transformers' WeightConverter, "
            "Concatenate, ...)"
        )
    return module, registered_between(before, after)


def _import(source: str):
    if source.endswith(".py") or os.sep in source or "/" in source:
        if not os.path.isfile(source):
            raise CliError(f"patches file '{source}' does not exist")
        stem = os.path.splitext(os.path.basename(source))[0]
        # reports name the replacement classes as the user knows them (``my_patches.ScaledAttention``); a stem that
        # is not an identifier or is taken by an imported module gets a unique suffix
        name = stem if stem.isidentifier() and stem not in sys.modules else f"{stem}_{uuid.uuid4().hex[:8]}"
        spec = importlib.util.spec_from_file_location(name, source)
        if spec is None or spec.loader is None:
            raise CliError(f"patches file '{source}' cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up
        sandbox = active_sandbox()
        if sandbox is not None:
            sandbox.forget_module_on_exit(name)
        try:
            with _on_sys_path(os.path.dirname(os.path.abspath(source))):
                spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - any error in user code becomes one line
            sys.modules.pop(name, None)
            raise CliError(f"patches file '{source}' raised {type(exc).__name__}: {exc}") from None
        return module
    try:
        with _on_sys_path(os.getcwd(), only_if_absent=("",)):
            return _import_by_name(source)
    except ModuleNotFoundError as exc:
        if exc.name and source.startswith(exc.name):
            raise CliError(f"patches module '{source}' not found (give a module name or a .py file)") from None
        raise CliError(f"patches module '{source}' raised ModuleNotFoundError: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any error in user code becomes one line
        raise CliError(f"patches module '{source}' raised {type(exc).__name__}: {exc}") from None


def _import_by_name(name: str):
    """Import module ``name``, executing it again if it was imported before (its import-time registrations are
    read back per command, see the module docstring)."""
    module = sys.modules.get(name)
    if module is not None:
        return importlib.reload(module)
    return importlib.import_module(name)


class _on_sys_path:
    """``folder`` first on ``sys.path``: until the command ends inside a :class:`~.sandbox.CommandSandbox`, else for
    the ``with`` block only. Nothing is added when ``folder`` (or an entry of ``only_if_absent``, e.g. ``""`` for the
    current directory) is already there. A console script has neither the current directory (``python -m`` has it)
    nor the file's folder (``python file.py`` has it) on ``sys.path``."""

    def __init__(self, folder: str, only_if_absent: tuple[str, ...] = ()):
        self.folder = folder
        self.skip = folder in sys.path or any(entry in sys.path for entry in only_if_absent)
        self.added = False

    def __enter__(self) -> None:
        if self.skip:
            return
        sandbox = active_sandbox()
        if sandbox is not None:
            sandbox.add_import_path(self.folder)
        else:
            sys.path.insert(0, self.folder)
            self.added = True

    def __exit__(self, *exc_info) -> None:
        if self.added and self.folder in sys.path:
            sys.path.remove(self.folder)


def _same_rules(mine, theirs) -> bool:
    try:
        return [repr(as_modelpatch_rule(r)) for r in mine] == [repr(as_modelpatch_rule(r)) for r in theirs]
    except TypeError:
        return False


def _registered_recipe(registered: Registrations, label: str) -> Recipe:
    conversion = {
        name: RuleSpec(ruleset.fresh_rules, ruleset.overwrite) for name, ruleset in registered.conversion.items()
    }
    return Recipe(
        name=label,
        description=f"patches registered by {label}",
        patch_mapping=dict(registered.patch_mapping),
        conversion=conversion,
    )


def recipe_from_namespace(namespace: Mapping, label: str, registered: Registrations | None = None) -> Recipe:
    """Build a :class:`Recipe` from a patches module's globals and what it registered (see the module docstring).

    Args:
        namespace: the module's globals.
        label: the ``--patches`` argument (the recipe's name).
        registered: what the module registered when imported (:func:`~.sandbox.registered_between`).

    Raises:
        CliError: nothing defined and nothing registered; values of the wrong type; a key or a rule name both defined
            and registered with different values.
    """
    registered = registered if registered is not None else Registrations()
    recipe = namespace.get("RECIPE")
    if recipe is not None:
        if not isinstance(recipe, Recipe):
            raise CliError(f"{label}: RECIPE must be a modelpatch.recipes.Recipe, got {type(recipe).__name__}")
        if not registered:
            return recipe
        try:
            return recipe + _registered_recipe(registered, label)
        except ValueError as exc:
            raise CliError(f"{label}: RECIPE and the patches it registers disagree: {exc}") from None
    mapping = namespace.get("PATCH_MAPPING")
    rules = namespace.get("CONVERSION_RULES")
    mapping = {} if mapping is None else mapping
    if not isinstance(mapping, Mapping):
        raise CliError(
            f"{label}: PATCH_MAPPING must be a dict {{class name or regex: replacement class}}, got "
            f"{type(mapping).__name__}"
        )
    rules = {} if rules is None else rules
    if not isinstance(rules, Mapping):
        raise CliError(f"{label}: CONVERSION_RULES must be a dict {{model_type: [rules]}}")
    overwrite = namespace.get("CONVERSION_OVERWRITE", False)
    if overwrite is True:
        overwrite_names = set(rules)
    else:
        overwrite_names = {overwrite} if isinstance(overwrite, str) else set(overwrite or ())
    mapping = dict(mapping)
    for key, cls in registered.patch_mapping.items():
        if key in mapping and mapping[key] is not cls:
            raise CliError(
                f"{label}: PATCH_MAPPING[{key!r}] is {getattr(mapping[key], '__name__', mapping[key])} but "
                f"the file registers {cls.__name__} for it; keep one"
            )
        mapping[key] = cls
    conversion = {
        name: RuleSpec(functools.partial(_fresh_rules, tuple(value)), name in overwrite_names)
        for name, value in rules.items()
    }
    for name, ruleset in registered.conversion.items():
        if name in conversion:
            if not _same_rules(rules[name], ruleset.rules):
                raise CliError(
                    f"{label}: CONVERSION_RULES[{name!r}] and the rules the file registers for {name!r} "
                    "differ; keep one"
                )
            conversion[name] = RuleSpec(conversion[name].factory, conversion[name].overwrite or ruleset.overwrite)
        else:
            conversion[name] = RuleSpec(ruleset.fresh_rules, ruleset.overwrite)
    if not mapping and not conversion:
        raise CliError(
            f"{label} defines no PATCH_MAPPING dict (or RECIPE) and registers nothing "
            "(register_patch_mapping / register_checkpoint_conversion_mapping)"
        )
    return Recipe(name=label, description=f"patches from {label}", patch_mapping=mapping, conversion=conversion)


def _fresh_rules(rules: tuple) -> list:
    """New modelpatch rule instances (a recipe hands out fresh rules per application)."""
    return [as_modelpatch_rule(copy.deepcopy(r)) for r in rules]


def config_names(config) -> set[str]:
    """Registry names that can hold rules for a model of ``config``: its ``model_type``, its architectures and the
    ``model_type`` of its sub-configs."""
    names = {getattr(config, "model_type", None), *(getattr(config, "architectures", None) or ())}
    for key in getattr(config, "sub_configs", None) or {}:
        names.add(getattr(getattr(config, key, None), "model_type", None))
    return names - {None, ""}


def check_model_type(model_type: str, also: Collection[str] = ()) -> None:
    """Refuse a ``--model-type`` the installed Transformers does not know (a key of its ``CONFIG_MAPPING``) and that is
    not in ``also`` (names the recipe has rules for: a remote-code model type).

    Raises:
        CliError: one line naming ``model_type`` and the closest known model types, when any are close.
    """
    import difflib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES or model_type in also:
        return
    close = difflib.get_close_matches(model_type, sorted(CONFIG_MAPPING_NAMES), n=3, cutoff=0.6)
    hint = f": did you mean {' or '.join(map(repr, close))}?" if close else " (see transformers.CONFIG_MAPPING)"
    raise CliError(f"unknown model type {model_type!r}{hint}")


def check_recipe_fits(recipe: Recipe, names: set[str], where: str) -> None:
    """Refuse a named recipe written for other model types than the checkpoint's (``names``: its model type, its
    sub-configs' types, its architectures): converting or loading with it would apply Transformers' own rules, or
    none, and report nothing about the recipe. Recipes from a patches file (no ``model_types``) are not checked.

    Raises:
        CliError: one line naming the recipe, its model types and the checkpoint's.
    """
    if not recipe.model_types or names & set(recipe.model_types):
        return
    model_types = ", ".join(recipe.model_types[:8]) + (" ..." if len(recipe.model_types) > 8 else "")
    raise CliError(
        f"recipe {recipe.name} is for model type(s) {model_types}, and {where} is of model type(s) "
        f"{', '.join(sorted(n for n in names if not n[:1].isupper()))}: use the recipe of its family "
        "(`modelpatch recipes` lists them)"
    )


def resolve_patches(recipe: str | None, patches: str | None) -> Recipe:
    """The recipe named ``recipe``, or the one a patches module/file defines.

    Raises:
        CliError: unknown recipe, a linear-experts recipe refused on this Transformers release (the measured
            reason), missing/raising patches file, or neither given.
    """
    if recipe is not None:
        try:
            return get_recipe(recipe)
        except (UnknownRecipeError, UnsupportedExpertsError) as exc:
            raise CliError(str(exc)) from None
    if patches is not None:
        module, registered = _load_module(patches)
        from_file = recipe_from_namespace(vars(module), patches, registered)
        try:  # validates the mapping and the rules (types, regexes) before anything is loaded
            with from_file.apply():
                pass
        except (TypeError, ValueError) as exc:
            raise CliError(f"{patches}: invalid patches: {str(exc).splitlines()[0]}") from None
        return from_file
    raise CliError("give --recipe NAME or --patches MODULE_OR_FILE")
