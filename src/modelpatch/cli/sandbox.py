"""One command runs against a clean process and leaves it as it found it.

``verify`` compares a patched load with an *unpatched* reference load, so nothing registered process-wide may be in
force while the command runs: not what the caller registered before calling :func:`modelpatch.cli.main` in-process,
and not what a patches file registers when it is imported (a file that calls
``register_patch_mapping(...)`` / ``register_checkpoint_conversion_mapping(...)`` at import instead of defining
``PATCH_MAPPING``; left in the registry, those registrations patched the reference load too and ``verify`` compared
the patched model with itself).

* :func:`current_registrations` / :func:`set_registrations` read and set the global patch mapping and the global user
  conversion rules as one value; :func:`registered_between` is what changed between two readings (what a patches
  file registered).
* :class:`TransformersRegistries` does the same for Transformers' own registries
  (``transformers.monkey_patching.register_patch_mapping``, ``transformers.conversion_mapping.
  register_checkpoint_conversion_mapping``), which Transformers applies to every ``from_pretrained`` by itself.
* :class:`CommandSandbox` (entered by :func:`modelpatch.cli.main` around every subcommand) gives the command's
  context (its thread / asyncio task) registries of its own, empty and with registry-wide strict mode off
  (:func:`~modelpatch.patching.registry.isolated_patch_registry`,
  :func:`~modelpatch.conversion.registry.isolated_conversion_registry`, ``ContextVar`` s like the patch scopes):
  what the caller registered is not in force for the command, what the command registers is gone after it, and
  every other thread or task sees its registrations unchanged while the command runs (a second thread loading a
  model meanwhile gets the caller's patches). Folders it put on ``sys.path`` for a patches file are removed again
  and the modules imported from them are forgotten, so a second command in the same process imports them afresh.

Two things stay process-wide, because there is no per-context version of them: ``sys.path`` / ``sys.modules`` (the
import system has one of each per process; a patches file must be importable, and importable afresh by the next
command), and Transformers' own registries (``transformers.monkey_patching``'s patch mapping and
``transformers.conversion_mapping``'s table are module globals that every ``from_pretrained`` of every thread reads):
what a user registered *there* is out of force for every thread while a command runs (nothing changes when nothing
was registered there, the usual case). (Logging levels, which :func:`modelpatch.cli.main` lowers around the
command, are process-wide too.)
"""

from __future__ import annotations

import os
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field

from ..conversion import register_checkpoint_conversion_mapping, unregister_checkpoint_conversion_mapping
from ..conversion.registry import isolated_conversion_registry, registered_conversion_mappings
from ..patching.registry import (
    get_patch_mapping,
    isolated_patch_registry,
    register_patch_mapping,
    unregister_patch_mapping,
)
from ..undo import UndoStack

__all__ = [
    "Registrations",
    "current_registrations",
    "set_registrations",
    "registered_between",
    "TransformersRegistries",
    "CommandSandbox",
    "active_sandbox",
]


@dataclass(frozen=True)
class Registrations:
    """The global registries at one moment: ``patch_mapping`` (``{key: replacement class}`` in registration order)
    and ``conversion`` (``{model_type or class name: RuleSet}`` of user rules registered globally)."""

    patch_mapping: dict = field(default_factory=dict)
    conversion: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.patch_mapping or self.conversion)


def current_registrations() -> Registrations:
    """What is registered process-wide now (scoped ``apply_patches`` blocks are not part of it)."""
    return Registrations(get_patch_mapping(), registered_conversion_mappings())


def registered_between(before: Registrations, after: Registrations) -> Registrations:
    """The entries of ``after`` that ``before`` did not have, or had with another value (registered with
    ``overwrite=True``)."""
    return Registrations(
        {key: cls for key, cls in after.patch_mapping.items() if before.patch_mapping.get(key) is not cls},
        {name: rules for name, rules in after.conversion.items() if before.conversion.get(name) is not rules},
    )


def set_registrations(target: Registrations) -> None:
    """Make the global registries hold exactly ``target`` (through the public register/unregister functions)."""
    now = current_registrations()
    if list(now.patch_mapping.items()) != list(target.patch_mapping.items()):
        if now.patch_mapping:
            unregister_patch_mapping(list(now.patch_mapping))
        if target.patch_mapping:
            register_patch_mapping(dict(target.patch_mapping))
    for name, ruleset in now.conversion.items():
        if target.conversion.get(name) is not ruleset:
            unregister_checkpoint_conversion_mapping(name)
    for name, ruleset in target.conversion.items():
        if now.conversion.get(name) is not ruleset:
            register_checkpoint_conversion_mapping(
                name, list(ruleset.rules), overwrite=ruleset.overwrite, strict=ruleset.strict
            )


@dataclass(frozen=True)
class TransformersRegistries:
    """Transformers' own process-wide registries at one moment: its patch mapping, its conversion table (``None``
    until first built; entries compared by identity) and the names users registered in it.

    Transformers has no function to unregister a conversion mapping, so :meth:`restore` writes the module globals
    of ``transformers.conversion_mapping`` back (only the entries that differ)."""

    patch_mapping: dict
    conversion_table: dict | None
    user_names: frozenset

    @classmethod
    def read(cls) -> TransformersRegistries:
        """The registries now."""
        from transformers import conversion_mapping, monkey_patching

        table = conversion_mapping._checkpoint_conversion_mapping_cache
        return cls(
            monkey_patching.get_patch_mapping(),
            None if table is None else dict(table),
            frozenset(conversion_mapping.USER_REGISTERED_MAPPINGS),
        )

    def without_user_entries(self) -> TransformersRegistries:
        """This state with no user patch and the built-in conversion rules back under every name a user registered."""
        if not self.user_names or self.conversion_table is None:
            return TransformersRegistries({}, self.conversion_table, frozenset())
        from transformers import conversion_mapping

        builtins = conversion_mapping._build_checkpoint_conversion_mapping()  # noqa: SLF001 - Transformers' built-in conversion table, rebuilt as from_pretrained builds it
        table = {name: entry for name, entry in self.conversion_table.items() if name not in self.user_names}
        table.update({name: builtins[name] for name in self.user_names if name in builtins})
        return TransformersRegistries({}, table, frozenset())

    def changes_since(self, before: TransformersRegistries) -> list[str]:
        """What was registered between ``before`` and this state, as the calls that did it (for messages)."""
        changed = [
            f"register_patch_mapping({key!r})"
            for key, value in self.patch_mapping.items()
            if before.patch_mapping.get(key) is not value
        ]
        old_table = before.conversion_table or {}
        changed += [
            f"register_checkpoint_conversion_mapping({name!r})"
            for name in sorted(self.user_names)
            if (self.conversion_table or {}).get(name) is not old_table.get(name)
        ]
        return changed

    def restore(self) -> None:
        """Make Transformers' registries hold exactly this state again."""
        from transformers import conversion_mapping, monkey_patching

        now = TransformersRegistries.read()
        if list(now.patch_mapping.items()) != list(self.patch_mapping.items()):
            monkey_patching.clear_patch_mapping()
            if self.patch_mapping:
                monkey_patching.register_patch_mapping(dict(self.patch_mapping))
        if self.conversion_table is None:
            conversion_mapping._checkpoint_conversion_mapping_cache = None
        elif conversion_mapping._checkpoint_conversion_mapping_cache is None:
            conversion_mapping._checkpoint_conversion_mapping_cache = dict(self.conversion_table)  # type: ignore[assignment]
        else:
            table = conversion_mapping._checkpoint_conversion_mapping_cache
            for name in set(table) - set(self.conversion_table):
                del table[name]
            for name, entry in self.conversion_table.items():
                if table.get(name) is not entry:
                    table[name] = entry
        if now.user_names != self.user_names:
            conversion_mapping.USER_REGISTERED_MAPPINGS.clear()
            conversion_mapping.USER_REGISTERED_MAPPINGS.update(self.user_names)


_ACTIVE: ContextVar[tuple[CommandSandbox, ...]] = ContextVar("modelpatch_cli_sandboxes", default=())


def active_sandbox() -> CommandSandbox | None:
    """The innermost :class:`CommandSandbox` open in the current thread / asyncio task, or ``None``."""
    active = _ACTIVE.get()
    return active[-1] if active else None


class CommandSandbox:
    """Context manager around one command (see the module docstring)."""

    def __init__(self) -> None:
        self._saved_transformers: TransformersRegistries | None = None
        self._paths: list[str] = []
        self._modules_before: set[str] = set()
        self._forget: set[str] = set()
        self._undo = UndoStack()

    def __enter__(self) -> CommandSandbox:
        self._saved_transformers = TransformersRegistries.read()
        self._modules_before = set(sys.modules)
        # modelpatch's registries: per context, so other threads / tasks keep theirs
        self._undo.enter_context(isolated_patch_registry())
        self._undo.enter_context(isolated_conversion_registry())
        self._undo.callback(_ACTIVE.reset, _ACTIVE.set((*_ACTIVE.get(), self)))
        # Transformers' registries are module globals read by every thread's loads (see the module docstring); put
        # back first at exit, before the command's own registries go
        self._undo.callback(self._saved_transformers.restore)
        self._saved_transformers.without_user_entries().restore()
        return self

    def add_import_path(self, folder: str) -> None:
        """Put ``folder`` first on ``sys.path`` for the rest of the command (as ``python file.py`` does for the file's
        folder), so the file's imports, also those run later inside functions, find modules beside it."""
        folder = os.path.abspath(folder)
        if folder not in sys.path:
            sys.path.insert(0, folder)
            self._paths.append(folder)

    def forget_module_on_exit(self, name: str) -> None:
        """Drop ``sys.modules[name]`` when the command ends (the patches file's own module)."""
        self._forget.add(name)

    def __exit__(self, *exc_info) -> None:
        try:
            self._undo.undo()  # Transformers' registries back, then what the command registered goes with its own
        finally:
            self._forget_imports()

    def _forget_imports(self) -> None:
        # sys.modules and sys.path are process-wide by nature (one import system per process): the patches file's
        # modules are forgotten for every thread, so that the next command imports the file afresh.
        # This is its own bookkeeping, not an UndoStack: what it takes back is not a change this class made but
        # whatever the import system added while the command ran (modules found by comparing sys.modules before and
        # after, and kept when they come from a folder that was on sys.path already).
        for name in self._forget:
            sys.modules.pop(name, None)
        for folder in self._paths:
            while folder in sys.path:
                sys.path.remove(folder)
        if self._paths:
            # a module counts as imported from one of our folders when that folder is the most specific sys.path
            # entry holding its file (a patches file in a folder above site-packages must not unload Transformers)
            entries = [os.path.abspath(entry or os.curdir) for entry in sys.path] + self._paths
            for name in set(sys.modules) - self._modules_before:
                file = getattr(sys.modules.get(name), "__file__", None)
                if not file:
                    continue
                holders = [entry for entry in entries if _inside(file, entry)]
                if holders and max(holders, key=len) in self._paths:
                    sys.modules.pop(name, None)
        self._paths, self._forget = [], set()


def _inside(path: str, folder: str) -> bool:
    try:
        return os.path.commonpath([os.path.abspath(path), folder]) == folder
    except ValueError:  # different drives
        return False
