"""Patch keys against classes: which classes a mapping replaces, and the messages for keys that replace nothing.

Shared by the scopes (:mod:`.scopes`, a mapping in force while a model is built) and
:func:`~modelpatch.patch_model` (a model already built).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from .catalog import CATALOG, known_class_names
from .registry import PatchMapping, PatchRule

__all__ = ["Resolution", "names_a_known_class", "resolve_classes", "unmatched_key_hint"]

# ``{class: (winning rule, every key that matches it)}``, see :func:`resolve_classes`
Resolution = dict[type, tuple[PatchRule, tuple[str, ...]]]


def names_a_known_class(rule: PatchRule) -> bool:
    """Whether ``rule`` names (exact key) or matches (pattern) a class that exists: a catalogued class, or a
    class of a Transformers modeling module not imported yet (read from its source, see
    :func:`~modelpatch.patching.catalog.source_class_names`)."""
    if rule.is_exact:
        return bool(CATALOG.classes_named(rule.key)) or rule.key in known_class_names()
    if any(rule.matches(name) for name in CATALOG.names()):
        return True
    return any(rule.matches(name) for name in known_class_names())


def unmatched_key_hint(key: str, built: set[str]) -> str:
    """A suggestion for an identifier key that replaced nothing, naming a class it would then match; ``""`` when
    no suggestion would match a class.

    Candidates are the classes built in the scope (``built``), or the catalogued classes when the scope built
    no model (layers constructed directly). In order: the same name in another case; the pattern
    ``'.*<key>'``, which :func:`re.search` matches against exactly the names containing ``key``; a close
    spelling (:func:`difflib.get_close_matches`)."""
    if not key.isidentifier():
        return ""
    names = sorted(built or CATALOG.names())
    same_but_case = [name for name in names if name.lower() == key.lower() and name != key]
    if same_but_case:
        return f"; {key!r}: did you mean {same_but_case[0]!r}? (class names are case-sensitive)"
    containing = [name for name in names if key in name and name != key]
    if containing:
        shown = ", ".join(containing[:3]) + (f" and {len(containing) - 3} more" if len(containing) > 3 else "")
        where = "built here" if built else "known"
        return (
            f"; {key!r} is an exact class name: to match the classes {where} whose names contain it ({shown}), "
            f"write '.*{key}'"
        )
    close = [name for name in difflib.get_close_matches(key, names, n=2, cutoff=0.8) if name != key]
    return f"; {key!r}: did you mean {close[0]!r}?" if close else ""


def resolve_classes(mapping: PatchMapping, classes: Iterable[type]) -> Resolution:
    """``{class: (winning rule, every key that matches it)}`` for the classes ``mapping`` replaces."""
    found: Resolution = {}
    for cls in classes:
        rule = mapping.resolve(cls.__name__)
        if rule is not None and rule.replacement is not cls:
            found[cls] = (rule, tuple(r.key for r in mapping.rules if r.matches(cls.__name__)))
    return found
