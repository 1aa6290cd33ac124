"""Which rules touch the same parameters, and whether keys are already in a rule's target layout.

Patterns are compared on module-path boundaries (:func:`~modelpatch.conversion.rules.pattern_regex`), sources and
targets alike; the registry uses this to let a user rule replace only the built-in rules producing the same
parameters, and loading/saving use it to recognise a checkpoint or model already in a rule's target layout.
"""

from __future__ import annotations

import re

from .rules import original_patterns, pattern_regex

__all__ = ["drop_replaced_builtins", "has_target_layout", "overlaps"]


def has_target_layout(rule, names) -> bool:
    """Whether any of ``names`` (state-dict or checkpoint keys) is named like a target pattern of ``rule``: the keys
    are already in the layout the rule converts to."""
    targets = _texts(rule)[len(original_patterns(rule)[0]) :]
    return any(_search(target, name) for target in targets for name in names)


def _texts(rule) -> list[str]:
    sources, targets = original_patterns(rule)
    patterns = sources + targets
    return [p.removeprefix("^").replace(r"\.", ".") for p in patterns]


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern_regex(pattern), text) is not None
    except re.error:
        return pattern == text


def overlaps(rule_a, rule_b) -> bool:
    """Whether two rules touch the same parameters: a pattern of one matches (on module-path boundaries) a pattern of
    the other, sources and targets alike."""
    texts_a, texts_b = _texts(rule_a), _texts(rule_b)
    return any(_search(p, q) or _search(q, p) for p in texts_a for q in texts_b)


def drop_replaced_builtins(builtins: list, user_rules: list) -> list:
    """The built-in rules that no user rule replaces."""
    return [b for b in builtins if not any(overlaps(b, u) for u in user_rules)]
