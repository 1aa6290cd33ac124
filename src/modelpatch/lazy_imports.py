"""Acting on a module of another library right after it is imported, without importing it ourselves.

:class:`PostImportHook` is a :data:`sys.meta_path` finder that answers for one module name only (``None`` for every
other name, so other imports are untouched): it finds the module's spec with the finders after it and wraps the
spec's loader so that, once the module has executed, a callback runs on it (e.g. wrapping two of its functions).
Used by :mod:`.peft` (``peft.utils.transformers_weight_conversion``) and :mod:`.trainer` (``transformers.trainer``),
which both wrap lazily imported modules that importing modelpatch must not import.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel

__all__ = ["PostImportHook", "pretrained_model_class"]


def pretrained_model_class() -> type[PreTrainedModel]:
    """``transformers.PreTrainedModel``, imported at the first call rather than when modelpatch is imported:
    ``transformers.modeling_utils`` costs seconds to import and imports torchao, bitsandbytes, ... when installed
    (log lines on stderr)."""
    from transformers.modeling_utils import PreTrainedModel  # import cost: at first use

    return PreTrainedModel


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader; runs the callbacks on the module once it has been executed."""

    def __init__(self, loader, on_import: list[Callable[[ModuleType], None]]):
        self._loader = loader
        self._on_import = on_import

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in self._on_import:
            callback(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...
        return getattr(self._loader, name)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Runs ``on_import(module)`` right after the module named ``target`` is imported (while :meth:`arm` ed).

    Several hooks may be armed for one module: the first on :data:`sys.meta_path` answers for all of them (each
    callback runs once, in the order the hooks were armed).

    Args:
        target: the full module name (``"transformers.trainer"``).
        on_import: called with the executed module, before the import statement returns.
    """

    def __init__(self, target: str, on_import: Callable[[ModuleType], None]):
        self.target = target
        self.on_import = on_import

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        spec = None
        finders = list(sys.meta_path)
        for finder in finders:
            find_spec = getattr(finder, "find_spec", None)
            if isinstance(finder, PostImportHook) or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        hooks = [f for f in reversed(finders) if isinstance(f, PostImportHook) and f.target == fullname]
        spec.loader = _Loader(spec.loader, [h.on_import for h in hooks])
        return spec

    def now_or_on_import(self) -> None:
        """Run the callback now if the module is imported already, else :meth:`arm` the hook."""
        module = sys.modules.get(self.target)
        if module is not None:
            self.on_import(module)
        else:
            self.arm()

    def arm(self) -> None:
        """Put the hook first on :data:`sys.meta_path` (idempotent)."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def disarm(self) -> None:
        """Take the hook off :data:`sys.meta_path`."""
        while self in sys.meta_path:
            sys.meta_path.remove(self)

    @property
    def armed(self) -> bool:
        return self in sys.meta_path
