"""Which classes may be replaced: the ``nn.Module`` subclasses defined in Transformers' modeling modules.

A *modeling module* is ``transformers.models.<family>.modeling_<name>``, a remote-code module loaded
with ``trust_remote_code`` (``transformers_modules.*``), or one of the two shared modules of building
blocks that modeling code instantiates: ``transformers.pytorch_utils`` (``Conv1D``, a classic
quantisation target) and ``transformers.activations``. Only classes *defined* there (``cls.__module__``
is that module) and subclassing ``torch.nn.Module`` are candidates: never ``torch.nn``, never user code,
never TypedDicts, output dataclasses or attention functions.

Each module is scanned once. :meth:`ClassCatalog.refresh` finds modules imported since the last call;
it costs one ``len(sys.modules)`` comparison when nothing was imported, so it can run on every scope
entry (``transformers.monkey_patching`` instead walks every attribute of every Transformers module on
every load, ~0.9 s).
"""

from __future__ import annotations

import re
import sys
import threading
import types

import torch.nn as nn

__all__ = ["ClassCatalog", "CATALOG", "is_modeling_module_name"]

_MODELING_MODULE = re.compile(
    r"^transformers\.models\.\w+\.modeling_\w+$|^transformers_modules\.|^transformers\.(pytorch_utils|activations)$"
)


def is_modeling_module_name(name: str) -> bool:
    """Whether a module called ``name`` is a Transformers modeling module (including remote code)."""
    return _MODELING_MODULE.match(name) is not None


def _still_importing(module: types.ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class ClassCatalog:
    """An incrementally built index of replaceable classes, by class name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scanned: dict[str, types.ModuleType] = {}
        self._by_name: dict[str, list[type]] = {}
        self._sys_modules_len = -1
        self.version = 0

    def may_have_changed(self) -> bool:
        """Cheap check: has ``sys.modules`` changed size since the last scan?"""
        return len(sys.modules) != self._sys_modules_len

    def refresh(self) -> list[type]:
        """Scan modeling modules imported since the last call; return the classes found in them."""
        if len(sys.modules) == self._sys_modules_len:
            return []
        with self._lock:
            self._sys_modules_len = len(sys.modules)
            found: list[type] = []
            for name, module in list(sys.modules.items()):
                if module is None or self._scanned.get(name) is module or not is_modeling_module_name(name):
                    continue
                if _still_importing(module):
                    self._sys_modules_len = -1  # look again once it has finished
                    continue
                self._scanned[name] = module
                found.extend(self._scan(name, module))
            if found:
                self.version += 1
            return found

    def _scan(self, name: str, module: types.ModuleType) -> list[type]:
        found = []
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, nn.Module) and value.__module__ == name:
                bucket = self._by_name.setdefault(value.__name__, [])
                if value not in bucket:
                    bucket.append(value)
                    found.append(value)
        return found

    def classes_named(self, name: str) -> list[type]:
        """Every catalogued class whose ``__name__`` is ``name``."""
        return list(self._by_name.get(name, ()))

    def all_classes(self) -> list[type]:
        return [cls for bucket in list(self._by_name.values()) for cls in bucket]

    def names(self) -> list[str]:
        return list(self._by_name)


CATALOG = ClassCatalog()
