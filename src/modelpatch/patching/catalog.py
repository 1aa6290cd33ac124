"""Which classes may be replaced: the ``nn.Module`` subclasses defined in Transformers' modeling modules.

A *modeling module* is ``transformers.models.<family>.modeling_<name>``, a remote-code module loaded
with ``trust_remote_code`` (``transformers_modules.*``), or one of the two shared modules of building
blocks that modeling code instantiates: ``transformers.pytorch_utils`` (``Conv1D``, a classic
quantisation target) and ``transformers.activations``. Only classes *defined* there (``cls.__module__``
is that module) and subclassing ``torch.nn.Module`` are candidates: never ``torch.nn``, never user code,
never TypedDicts, output dataclasses or attention functions.

Each module is scanned once per execution. :meth:`ClassCatalog.refresh` finds modules imported since the
last call, and modules that ran again: a module object replaced under the same name (a ``trust_remote_code``
model loaded with ``force_download=True``) or re-executed in place (``importlib.reload``, a remote-code file
whose content changed). Counting ``sys.modules`` catches neither, so each scanned module has a *witness*: the
last class it defines (else its last function, else its ``__spec__``), which any new execution of its code
binds to a new object. :meth:`ClassCatalog.may_have_changed` compares ``len(sys.modules)`` and its newest key, then looks the
witness up in the module ``sys.modules`` holds now, for the catalogued modules it is asked about:

* a scope entry asks about the modules defining the classes its exact keys name (0.4 µs for one module on a
  2-core VM, against 0.07 µs for the count alone), or about all of them when it has a pattern or a key naming
  no catalogued class (3.9 µs for 33 modules: 30 families plus the shared ones);
* every ``PreTrainedModel`` built inside a scope asks about all of them.

(``transformers.monkey_patching`` instead walks every attribute of every Transformers module on every load,
~0.9 s.) A later rebinding of a witness by other code (a monkey-patcher) costs one rescan (a walk of
``sys.modules``, a few ms) that finds nothing new.

Classes of a module that ran again stay catalogued beside the new ones (instances of the old classes may
still be built through references held elsewhere).

:func:`source_class_names` answers "does Transformers define a class of that name anywhere?" without
importing every modeling module (it reads their source text once per process, lazily); the scopes use it
to tell a key of another model family (not applicable to this model) from a typo.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Iterable

import torch.nn as nn

__all__ = ["ClassCatalog", "CATALOG", "is_modeling_module_name", "source_class_names", "known_class_names"]

_MODELING_MODULE = re.compile(
    r"^transformers\.models\.\w+\.modeling_\w+$|^transformers_modules\.|^transformers\.(pytorch_utils|activations)$"
)


def is_modeling_module_name(name: str) -> bool:
    """Whether a module called ``name`` is a Transformers modeling module (including remote code)."""
    return _MODELING_MODULE.match(name) is not None


def _still_importing(module: types.ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _witness(name: str, module: types.ModuleType) -> tuple[str, object]:
    """``(attribute, value)`` of ``module`` that a new execution of its code rebinds to a new object.

    The last class defined by the module (or else the last function); a module defining neither is watched
    through its ``__spec__`` (which ``importlib.reload`` replaces)."""
    last_function = None
    last_class = None
    for attr, value in list(vars(module).items()):
        if not isinstance(value, (type, types.FunctionType)) or value.__module__ != name:
            continue
        if isinstance(value, type):
            last_class = (attr, value)
        elif isinstance(value, types.FunctionType):
            last_function = (attr, value)
    return last_class or last_function or ("__spec__", vars(module).get("__spec__"))


class ClassCatalog:
    """An incrementally built index of replaceable classes, by class name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scanned: dict[str, tuple[types.ModuleType, str, object]] = {}  # name -> (module, witness attr, value)
        self._by_name: dict[str, list[type]] = {}
        self._sys_modules_len = -1
        self._last_module: str | None = None  # the newest key of sys.modules at the last scan
        # what may_have_changed() compares, rebuilt by refresh(): module names, witness attributes, Nones,
        # witness values (parallel tuples, so the full check runs in C via map())
        self._watch: tuple[tuple, tuple, tuple, list] = ((), (), (), [])
        self.version = 0
        # what a stale catalogue needs beyond a rescan: the scopes set it to their refresh, which also extends
        # every live scope to the new classes (the registry cannot import the scopes: they import it)
        self.on_stale: Callable[[], None] | None = None

    def refresh_if_stale(self) -> None:
        """Rescan if :meth:`may_have_changed` says so, through :attr:`on_stale` when it is set."""
        if not self.may_have_changed():
            return
        if self.on_stale is not None:
            self.on_stale()
        else:
            self.refresh()

    def may_have_changed(self, modules: Iterable[str] | None = None) -> bool:
        """Cheap check: was a modeling module imported, removed, replaced or re-executed since the last scan?

        Args:
            modules: watch only these catalogued modules (the ones defining the classes a scope targets), plus
                ``len(sys.modules)`` for imports; ``None`` watches every catalogued module.

        ``len(sys.modules)`` first, then, per watched module, one lookup of its witness attribute (see the
        module docstring) in the module ``sys.modules`` holds now: a module replaced under the same name, or
        re-executed in place, binds a new object there.
        """
        # the count alone misses imports offset by removals (the CLI's sandbox drops a patches file's modules):
        # sys.modules keeps insertion order, so a new import also changes its newest key
        if len(sys.modules) != self._sys_modules_len or next(reversed(sys.modules), None) != self._last_module:
            return True
        if modules is None:
            names, attrs, nones, values = self._watch
            return list(map(getattr, map(sys.modules.get, names), attrs, nones)) != values
        scanned = self._scanned
        for name in modules:
            entry = scanned.get(name)
            module = sys.modules.get(name)
            if entry is None:
                if module is not None:
                    return True  # removed and imported again between two looks
            elif getattr(module, entry[1], None) is not entry[2]:
                return True
        return False

    def refresh(self) -> list[type]:
        """Scan modeling modules imported, replaced or re-executed since the last call; return the classes
        found in them that were not catalogued yet (a class object is catalogued once).

        Walks ``sys.modules`` (about 1 ms): call it when :meth:`may_have_changed` says so."""
        with self._lock:
            self._sys_modules_len = len(sys.modules)
            self._last_module = next(reversed(sys.modules), None)
            found: list[type] = []
            seen: dict[str, tuple[types.ModuleType, str, object]] = {}
            for name, module in list(sys.modules.items()):
                if module is None or not is_modeling_module_name(name):
                    continue
                entry = self._scanned.get(name)
                if entry is not None and entry[0] is module and getattr(module, entry[1], None) is entry[2]:
                    seen[name] = entry
                    continue
                if _still_importing(module):
                    self._sys_modules_len = -1  # look again once it has finished
                    continue
                found.extend(self._scan(name, module))
                seen[name] = (module, *_witness(name, module))
            self._scanned = seen
            names = tuple(seen)
            self._watch = (names, tuple(seen[n][1] for n in names), (None,) * len(names), [seen[n][2] for n in names])
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
        """Every catalogued class (classes of modules that ran again included)."""
        return [cls for bucket in list(self._by_name.values()) for cls in bucket]

    def names(self) -> list[str]:
        """The names of the catalogued classes."""
        return list(self._by_name)

    def scanned_modules(self) -> set[str]:
        """Names of the modeling modules scanned so far."""
        return set(self._scanned)


CATALOG = ClassCatalog()


# -- classes Transformers defines, imported or not ---------------------------------------------------

_CLASS_STATEMENT = re.compile(rb"\nclass (\w+)\(([^)]*)\)")
# bases of classes in modeling files that are never modules (output dataclasses, typed dicts, configs, enums)
_NOT_A_MODULE_BASE = re.compile(rb"ModelOutput|TypedDict|Config\b|Enum\b|Exception\b|NamedTuple|Protocol\b")


def _is_dataclass(text: bytes, start: int) -> bool:
    """Whether the class statement at ``start`` is decorated with ``@dataclass`` (an output dataclass, whatever its
    base is called: ``MultimodalCausalLMOutputWithPast`` in Transformers 5.24): the decorator block is the text
    between the previous blank line and the statement."""
    block_start = text.rfind(b"\n\n", 0, start)
    return b"@dataclass" in text[block_start if block_start >= 0 else 0 : start]


@functools.lru_cache(maxsize=1)
def source_class_names() -> dict[str, frozenset[str]]:
    """``{module name: names of the classes it defines}`` for every modeling module shipped with Transformers
    (``transformers/models/*/modeling_*.py``, ``pytorch_utils.py``, ``activations.py``), read from the source
    text without importing anything.

    A class whose base names an output dataclass, a typed dict, a config or an enum is left out. Computed
    once per process, on first use (~0.1 s with a warm file cache for ~530 files, 24 MB).
    """
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return {}
    root = os.path.dirname(spec.origin)
    paths: list[tuple[str, str]] = [
        ("transformers.pytorch_utils", os.path.join(root, "pytorch_utils.py")),
        ("transformers.activations", os.path.join(root, "activations.py")),
    ]
    models = os.path.join(root, "models")
    for family in sorted(os.listdir(models)) if os.path.isdir(models) else ():
        folder = os.path.join(models, family)
        if not os.path.isdir(folder):
            continue
        for filename in sorted(os.listdir(folder)):
            if filename.startswith("modeling_") and filename.endswith(".py"):
                paths.append((f"transformers.models.{family}.{filename[:-3]}", os.path.join(folder, filename)))
    found: dict[str, frozenset[str]] = {}
    for module_name, path in paths:
        try:
            with open(path, "rb") as handle:
                text = b"\n" + handle.read()
        except OSError:
            continue
        found[module_name] = frozenset(
            match.group(1).decode()
            for match in _CLASS_STATEMENT.finditer(text)
            if not _NOT_A_MODULE_BASE.search(match.group(2)) and not _is_dataclass(text, match.start())
        )
    return found


def known_class_names() -> frozenset[str]:
    """Names of the classes a patch key may legitimately name: the catalogue's, plus those that Transformers'
    modeling modules not scanned yet define (:func:`source_class_names`; a scanned module's catalogue entry is
    exact: it holds only its ``nn.Module`` classes). Reads the source files on first use; cached until the
    catalogue changes."""
    state = (CATALOG.version, len(CATALOG.scanned_modules()))
    cached = _KNOWN.get(state)
    if cached is not None:
        return cached
    scanned = CATALOG.scanned_modules()
    known = set(CATALOG.names())
    for module_name, names in source_class_names().items():
        if module_name not in scanned:
            known |= names
    result = frozenset(known)
    _KNOWN.clear()
    _KNOWN[state] = result
    return result


_KNOWN: dict[tuple[int, int], frozenset[str]] = {}
