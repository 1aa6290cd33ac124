"""``modelpatch verify``: load a checkpoint as is and patched, and check that nothing changed but the classes.

Checks (each one line in the summary; any failure → exit status 1):

``patches``     at least one module replaced, every key of the mapping replaced something, no container/inner conflict
``loading``     the patched load reports no missing/unexpected/mismatched key the vanilla load does not also report
``provenance``  every parameter's values come from the checkpoint (see :mod:`.provenance`)
``outputs``     max abs difference of the outputs (logits, or mean-pooled embeddings for encoders) ≤ ``--atol``
``padding``, ``cache (dynamic)``, ``cache (static)``, ``generate``, ``routing``
                the paths patches break, against the unpatched model (see :mod:`.paths`; ``--checks`` chooses,
                ``--new-tokens`` sizes the decoding); a check that cannot run on the model is skipped, with its reason
``round trip``  patched → ``save_pretrained`` → plain Transformers load equals the vanilla load bit for bit

A patched load that raises fails the ``loading`` check (exit status 1, not a usage error): it names what the
checkpoint's headers show (a key whose shape the checkpoint cannot fill, both shapes; :mod:`.plan`), else the
loader's message, and the checks that need the patched model are skipped. The ``patches`` and ``loading`` details
are worded by :func:`.plan.problem_words`, as ``explain`` words the same findings; the ``--json`` document's
``loading`` then holds ``failed: true``, the loader's ``error`` and the ``mismatched_keys`` (key, both shapes).

With ``--quantization NAME`` (see :mod:`.quantize`) two more: ``quantized`` (every expert Linear quantized, no fused
experts parameter left in full precision, outputs within the quantizer's usual error of the full-precision patched
model) and ``quantized save`` (saved, reloaded pre-quantized with the recipe: the same outputs bit for bit).

With ``--train`` (see :mod:`.train_check`) two more, after ``--steps`` steps of ``--optimizer`` on both models
(float32) with generated tokens: ``training`` (every checkpoint key of the patched model within the optimizer's
fp32-noise bound of the unpatched one, and the steps moved the weights beyond it) and ``gradients`` (no trainable
parameter left with ``grad=None`` where the unpatched model has a gradient).

With no ``--model`` and no ``--recipe``/``--patches`` it runs the full example (recipe ``qwen2_moe-full-example``:
per-expert experts + fused QKV + a ``Concatenate`` rule) on the built-in tiny Qwen2-MoE checkpoint (see :mod:`.checkpoint`).

The reference ("vanilla") load runs with nothing registered process-wide in force (see :mod:`.sandbox`). A folder
already in the layout the recipe converts to (written by ``modelpatch convert``) is a one-line error, not four
failed checks: the reference load would leave parameters random there (:func:`converted_layout_error`).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ..conversion.unloaded import allow_init_values
from ..recipes import FULL_EXAMPLE, Recipe
from .checkpoint import (
    add_trust_remote_code,
    checkpoint_dir,
    checkpoint_keys,
    example_checkpoint,
    model_class,
    read_config,
    remote_code_kwargs,
)
from .errors import EXIT_FAILED_CHECK, CliError
from .inputs import model_inputs, model_output
from .paths import DEFAULT_NEW_TOKENS, PATH_CHECKS, PathCheck, run_path_checks
from .plan import Findings, model_names, other_type_rules, problem_words, static_findings, unfired_rules
from .provenance import ParamSource, first_difference, parameter_provenance
from .quantize import QUANTIZATIONS, QuantizedResult, quantization_config, run_quantized
from .render import emit, plain, section, strict_json, table
from .sources import check_recipe_fits, config_names, resolve_patches
from .train_check import DEFAULT_STEPS, DEFAULT_TOKENS, OPTIMIZERS, TrainResult, run_train_check
from .train_check import render as render_training

__all__ = [
    "Check",
    "VerifyResult",
    "TrainSettings",
    "run_verify",
    "converted_layout_error",
    "converted_layout_rule",
    "add_parser",
    "DTYPES",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DEFAULT_ATOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}
"""``--atol``'s default per ``--dtype``: the tolerance of ``outputs``, ``padding`` and the ``cache`` checks (README.md
states them beside the checks table)."""


@dataclass(frozen=True)
class Check:
    """One line of the checks table; a ``skipped`` check (``ok`` False) could not run on the model and neither
    passes nor fails the run."""

    name: str
    ok: bool
    detail: str
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else "ok" if self.ok else "FAIL"


@dataclass(frozen=True)
class TrainSettings:
    """What ``--train`` runs (see :func:`.train_check.run_train_check`): ``optimizer`` a name of
    :data:`.train_check.OPTIMIZERS`, ``lr`` ``None`` for the optimizer's default."""

    optimizer: str = "adamw"
    steps: int = DEFAULT_STEPS
    lr: float | None = None
    tokens: int = DEFAULT_TOKENS
    seed: int = 0


@dataclass
class VerifyResult:
    """Everything ``verify`` measured; ``as_dict()`` is the ``--json`` document."""

    model_dir: str
    recipe: str
    model_class: str
    dtype: str
    input: str = ""
    patch: dict = field(default_factory=dict)
    conversion: list = field(default_factory=list)
    loading: dict = field(default_factory=dict)
    provenance: list[ParamSource] = field(default_factory=list)
    output_kind: str = ""
    max_abs_diff: float = float("nan")
    atol: float = 0.0
    load_seconds: dict = field(default_factory=dict)
    round_trip: str | None = "not run"
    unfired_rules: list = field(default_factory=list)
    other_type_rules: str | None = None
    quantization: QuantizedResult | None = None
    training: TrainResult | None = None
    paths: list[PathCheck] = field(default_factory=list)
    new_tokens: int = DEFAULT_NEW_TOKENS
    load_failure: Findings | None = None
    output_error: str | None = None
    save_error: str | None = None
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        ran = [c for c in self.checks if not c.skipped]
        return bool(ran) and all(c.ok for c in ran)

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "model_dir": self.model_dir,
            "recipe": self.recipe,
            "model_class": self.model_class,
            "dtype": self.dtype,
            "input": self.input,
            "patch_report": self.patch,
            "conversion_report": self.conversion,
            "rules_that_matched_nothing": self.unfired_rules,
            "rules_of_other_model_types": self.other_type_rules,
            "loading": self.loading,
            "provenance": [p.as_dict() for p in self.provenance],
            "output": {"kind": self.output_kind, "max_abs_diff": self.max_abs_diff, "atol": self.atol},
            "load_seconds": self.load_seconds,
            "round_trip": {"bit_exact": self.round_trip is None, "first_difference": self.round_trip},
            "quantization": None if self.quantization is None else self.quantization.as_dict(),
            "training": None if self.training is None else self.training.as_dict(),
            "paths": [
                {
                    "name": p.name,
                    "status": p.status,
                    "figure": p.figure,
                    "first_divergence": p.where,
                    "detail": p.detail,
                }
                for p in self.paths
            ],
            "new_tokens": self.new_tokens,
            "checks": [
                {"name": c.name, "ok": None if c.skipped else c.ok, "status": c.status, "detail": c.detail}
                for c in self.checks
            ],
        }


def _timed_load(cls, path: str, dtype, recipe: Recipe | None, **kwargs):
    start = time.perf_counter()
    if recipe is None:
        model, info = cls.from_pretrained(path, dtype=dtype, output_loading_info=True, **remote_code_kwargs(), **kwargs)
    else:
        # parameters the patch's rules leave unfilled are an error of a plain load; verify loads anyway to report
        # them (the "loading" and "provenance" checks fail, naming them)
        with allow_init_values(), recipe.apply():
            model, info = cls.from_pretrained(
                path, dtype=dtype, output_loading_info=True, **remote_code_kwargs(), **kwargs
            )
    return model.eval(), info, time.perf_counter() - start


def _new_loading_issues(patched_info: dict, vanilla_info: dict) -> dict:
    return {
        kind: sorted(str(k) for k in set(patched_info.get(kind) or ()) - set(vanilla_info.get(kind) or ()))
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }


def run_verify(
    model_dir: str,
    recipe: Recipe,
    *,
    dtype: str = "float32",
    atol: float | None = None,
    progress: bool | None = None,
    source_args: str | None = None,
    quantization: str | None = None,
    train: TrainSettings | None = None,
    checks: tuple[str, ...] = PATH_CHECKS,
    new_tokens: int = DEFAULT_NEW_TOKENS,
) -> VerifyResult:
    """Run every check of ``verify`` on ``model_dir`` with ``recipe``; returns the result (never exits).

    ``checks``: the path checks to run (names of :data:`.paths.PATH_CHECKS`; the others always run), decoding
    ``new_tokens`` tokens. A patched load that raises is a failed ``loading`` check, naming what the checkpoint's
    headers show (a key whose shape the checkpoint cannot fill, with both shapes: :func:`.plan.static_findings`), or
    else the loader's message; the checks that need the patched model are then skipped.

    ``source_args`` is how the recipe was given on the command line (``--recipe NAME``, ``--patches FILE``; default
    ``--recipe <recipe.name>``), used in the advice of :func:`converted_layout_error`. ``quantization``: a name of
    :data:`.quantize.QUANTIZATIONS`; the quantized patched load is then measured too (:func:`.quantize.run_quantized`).
    ``train``: also train both models and compare them (:func:`.train_check.run_train_check`; in float32: the
    models of the other checks when ``dtype`` is float32, else two more loads).

    Raises:
        CliError: the folder is not a checkpoint, is already in the layout the recipe converts to (the unpatched
            reference would be random there), or the unpatched load fails (message of the error); an unknown
            quantization or one whose backend is not installed; bad ``train`` settings (before any load), or a
            training step that fails.
    """
    from ..conversion import conversion_report
    from ..patching.report import patch_report

    model_dir = checkpoint_dir(model_dir)
    if quantization is not None:
        quantization_config(quantization)  # an unknown name or a missing backend, before any load
    if train is not None:
        _check_train_settings(train)
    unknown = [name for name in checks if name not in PATH_CHECKS]
    if unknown or new_tokens < 1:
        raise CliError(
            f"--checks: unknown check(s) {unknown}; known: {', '.join(PATH_CHECKS)}"
            if unknown
            else f"--new-tokens: must be an integer >= 1, got {new_tokens}"
        )
    torch_dtype = DTYPES[dtype]
    atol = atol if atol is not None else DEFAULT_ATOL[dtype]
    config = read_config(model_dir)
    check_recipe_fits(recipe, config_names(config), f"the checkpoint at '{model_dir}'")
    cls: Any = model_class(config)
    result = VerifyResult(model_dir, recipe.name, cls.__name__, dtype, atol=atol, new_tokens=new_tokens)
    steps = tqdm(
        total=6 + bool(checks) + (train is not None),
        desc="modelpatch verify",
        unit="step",
        disable=None if progress is None else not progress,
        leave=False,
    )
    with steps, tempfile.TemporaryDirectory(prefix="modelpatch-verify-") as saved_dir:
        steps.set_postfix_str("vanilla load")
        try:
            vanilla, vanilla_info, result.load_seconds["vanilla"] = _timed_load(cls, model_dir, torch_dtype, None)
        except Exception as exc:  # noqa: BLE001 - any load error becomes one line naming the folder
            raise CliError(f"loading '{model_dir}' without patches failed: {type(exc).__name__}: {exc}") from None
        problem = converted_layout_error(
            model_dir, recipe, config, vanilla_info, source_args or f"--recipe {recipe.name}"
        )
        if problem is not None:
            raise CliError(problem)
        steps.update()
        steps.set_postfix_str("patched load")
        try:
            patched, patched_info, result.load_seconds["patched"] = _timed_load(cls, model_dir, torch_dtype, recipe)
        except Exception as exc:  # noqa: BLE001 - a patch that does not load fails: what the headers show, or why
            return _failed_load(result, recipe, config, model_dir, exc, checks)
        steps.update()
        report = patch_report(patched)
        result.patch = report.as_dict()
        # the conversion rows are reported once, under "conversion_report" (load and save rows)
        result.patch.pop("conversion", None)
        result.loading = _new_loading_issues(patched_info, vanilla_info)

        steps.set_postfix_str("forward")
        inputs, result.input = model_inputs(model_dir, config)
        expected, result.output_kind = model_output(vanilla, inputs)
        try:
            actual, _ = model_output(patched, inputs)
        except Exception as exc:  # noqa: BLE001 - a patched forward that raises fails the outputs check
            result.output_error = _first_line(exc)
            actual = torch.full_like(expected, float("nan"))
        result.max_abs_diff = float((actual - expected).abs().max()) if actual.shape == expected.shape else float("inf")
        steps.update()
        if checks:
            result.paths = run_path_checks(
                vanilla,
                patched,
                inputs,
                checks=checks,
                new_tokens=new_tokens,
                atol=atol,
                progress=steps.set_postfix_str,
            )
            steps.update()

        steps.set_postfix_str("save")
        start = time.perf_counter()
        try:
            patched.save_pretrained(saved_dir)
        except Exception as exc:  # noqa: BLE001 - a patched model that cannot be saved fails the round trip
            result.save_error = _first_line(exc)
        result.load_seconds["save_patched"] = time.perf_counter() - start
        rows = conversion_report(patched)
        result.conversion = [
            {
                "direction": r.direction,
                "rule": r.rule,
                "registered_as": r.registered_as,
                "source_keys": list(r.source_keys),
                "target_keys": list(r.target_keys),
            }
            for r in rows
        ]
        steps.update()

        result.unfired_rules = unfired_rules(recipe, patched, {r.rule for r in rows if r.direction == "load"})
        result.other_type_rules = other_type_rules(recipe, config_names(config) | model_names(patched))
        if result.save_error is None:
            steps.set_postfix_str("provenance")
            result.provenance = parameter_provenance(
                patched,
                model_dir,
                saved_dir,
                [r for r in rows if r.direction == "load"],
                missing_keys=patched_info.get("missing_keys") or (),
            )
            steps.update()
            steps.set_postfix_str("round trip")
            plain, plain_info = cls.from_pretrained(
                saved_dir, dtype=torch_dtype, output_loading_info=True, **remote_code_kwargs()
            )
            # keys the save wrote that a plain load drops (a replacement's own parameter), or did not write, are a
            # difference even when the state dicts after the load agree
            new = _new_loading_issues(plain_info, vanilla_info)
            written = [f"{kind.split('_')[0]} {keys[:3]}" for kind, keys in new.items() if keys]
            result.round_trip = (
                f"a plain load of the save reports keys the checkpoint's load does not: {'; '.join(written)}"
                if written
                else first_difference(plain.eval().state_dict(), vanilla.state_dict())
            )
            steps.update()
        else:
            result.round_trip = f"save_pretrained of the patched model fails: {result.save_error}"
        if quantization is not None:
            steps.set_postfix_str(f"quantized ({quantization})")
            result.quantization = run_quantized(
                cls, model_dir, recipe, torch_dtype, quantization, actual, inputs, model_output
            )
        if train is not None:
            steps.set_postfix_str(f"train ({train.optimizer})")
            reference, trained = vanilla, patched
            if torch_dtype != torch.float32:  # the bounds are fp32 rounding noise
                del vanilla, patched
                reference = _load_for_training(cls, model_dir, None, torch.float32)
                trained = _load_for_training(cls, model_dir, recipe, torch.float32)
            result.training = run_train_check(
                reference,
                trained,
                float64=lambda: (
                    _load_for_training(cls, model_dir, None, torch.float64),
                    _load_for_training(cls, model_dir, recipe, torch.float64),
                ),
                optimizer=train.optimizer,
                steps=train.steps,
                lr=train.lr,
                tokens=train.tokens,
                seed=train.seed,
            )
            steps.update()
    result.checks = _checks(result, report)
    return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _check_train_settings(train: TrainSettings) -> None:
    """The ``--train`` settings :func:`.train_check.run_train_check` would refuse, refused before any load."""
    if train.optimizer not in OPTIMIZERS:
        raise CliError(f"--optimizer: unknown optimizer {train.optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    for name, value in (("--steps", train.steps), ("--tokens", train.tokens)):
        if value < 1:
            raise CliError(f"{name}: must be an integer >= 1, got {value}")
    if train.lr is not None and not (math.isfinite(train.lr) and train.lr > 0):
        raise CliError(f"--lr: must be a finite number > 0, got {train.lr}")


def _load_for_training(cls, path: str, recipe: Recipe | None, dtype: torch.dtype):
    """A fresh load for ``--train``; in float64 with Transformers' eager experts (``grouped_mm`` has no float64)."""
    kwargs = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    try:
        return _timed_load(cls, path, dtype, recipe, **kwargs)[0]
    except Exception as exc:  # noqa: BLE001 - any load error becomes one line naming the dtype and the folder
        which = "unpatched" if recipe is None else "patched"
        name = str(dtype).removeprefix("torch.")
        raise CliError(f"{name} {which} load of '{path}' for --train failed: {type(exc).__name__}: {exc}") from None


def converted_layout_rule(
    model_dir: str, recipe: Recipe, config, missing: Iterable[str] | None = None
) -> tuple[str, str] | None:
    """``(a converted key, the source patterns)`` when a converter of ``recipe`` finds no checkpoint key of its
    source layout in ``model_dir`` but a key of its target layout (a folder written by ``modelpatch convert``), or
    ``None``.

    ``missing``: keys of the unpatched model a load leaves unfilled; when given, only a converter whose source
    patterns name one of them counts (the converted layout is what the load lacks), so a key missing for another
    reason never makes the folder "already converted"."""
    found = _converted_layout(model_dir, recipe, config, missing)
    return None if found is None else found[:2]


def _converted_layout(
    model_dir: str, recipe: Recipe, config, missing: Iterable[str] | None
) -> tuple[str, str, str | None] | None:
    """:func:`converted_layout_rule`'s answer and the first key of ``missing`` the converter's sources name."""
    from ..conversion.compose import has_target_layout
    from ..conversion.rules import WeightConverter, as_modelpatch_rule, match_rule, original_patterns

    names = config_names(config)
    keys = checkpoint_keys(model_dir)
    wanted = None if missing is None else sorted(missing)
    for name, rules in recipe.build_conversion_rules().items():
        if name not in names:
            continue
        for rule in rules:
            rule = as_modelpatch_rule(rule)
            if not isinstance(rule, WeightConverter) or any(match_rule(rule, key) is not None for key in keys):
                continue
            converted = next((key for key in keys if has_target_layout(rule, [key])), None)
            if converted is None:
                continue
            lacked = None if wanted is None else next((k for k in wanted if match_rule(rule, k) is not None), None)
            if wanted is None or lacked is not None:
                return converted, ", ".join(original_patterns(rule)[0]), lacked
    return None


def converted_layout_error(model_dir: str, recipe: Recipe, config, vanilla_info: dict, source_args: str) -> str | None:
    """The one-line error for a checkpoint already in the layout ``recipe`` converts to (e.g. written by
    ``modelpatch convert``), or ``None``; ``explain`` gives the same from the checkpoint's headers.

    Such a folder is reported when a converter of the recipe finds no checkpoint key of its source layout but keys
    of its target layout, and the unpatched load left parameters missing (randomly initialised) that the
    converter's source patterns name (:func:`converted_layout_rule` with ``missing``): comparing with that reference
    would blame the patch for the checkpoint's layout. Parameters missing for another reason (a tied
    ``lm_head.weight`` an analysis did not drop, a checkpoint saved without a head) never make this error.
    """
    missing = sorted(str(k) for k in vanilla_info.get("missing_keys") or ())
    if not missing:
        return None
    found = _converted_layout(model_dir, recipe, config, missing)
    if found is None:
        return None
    converted, sources, lacked = found
    return (
        f"'{model_dir}' is already in the converted layout of {recipe.name} (it has '{converted}' and no "
        f"key matching {sources}), so the unpatched reference load would leave {len(missing)} parameter(s) "
        f"random (e.g. '{lacked}') and nothing can be compared; verify the original checkpoint instead, "
        f"or write it back first with `modelpatch convert {model_dir} OUT {source_args} --reverse` and "
        f"verify OUT"
    )


def _failed_load(result: VerifyResult, recipe: Recipe, config, model_dir: str, exc: Exception, checks) -> VerifyResult:
    """The result of a patched load that raised: ``patches`` from the patched model built on ``meta``, ``loading``
    failed with what the checkpoint's headers show (:func:`.plan.static_findings`) or the loader's message, the
    checks that need the patched model skipped."""
    from ..patching.report import patch_report

    meta, findings = static_findings(recipe, config, model_dir)
    if not findings.mismatched and findings.load_error is None:
        findings.load_error = _first_line(exc)
    result.load_failure = findings
    # the --json document's "loading" names the failure as the checks do: the key and both shapes, or the message
    result.loading = {
        "failed": True,
        "error": _first_line(exc),
        "missing_keys": findings.missing,
        "unexpected_keys": findings.unexpected,
        "mismatched_keys": [
            {"key": key, "checkpoint_shape": list(ck), "model_shape": list(own)} for key, ck, own in findings.mismatched
        ],
    }
    report = patch_report(meta) if meta is not None else None
    result.patch = report.as_dict() if report is not None else {}
    result.patch.pop("conversion", None)
    result.unfired_rules = findings.unfired
    result.other_type_rules = findings.other_types
    findings.replaced = None  # the patches check states the count itself
    words = problem_words(findings)
    why = "the patched load failed"
    skipped = ["provenance", "outputs"]
    for name in (c for c in PATH_CHECKS if c in checks):
        skipped += ["cache (dynamic)", "cache (static)"] if name == "cache" else [name]
    skipped.append("round trip")
    result.checks = [
        _patches_check(report, words) if report is not None else Check("patches", False, "; ".join(words["patches"])),
        Check("loading", False, "; ".join(words["loading"])),
        *(Check(name, False, why, skipped=True) for name in skipped),
    ]
    return result


def _patches_check(report, words: dict[str, list[str]]) -> Check:
    rows, unmatched, conflicts = report.rows, report.unmatched_keys, report.conflicts
    return Check(
        "patches",
        bool(rows) and not unmatched and not conflicts,
        "; ".join([f"{len(rows)} module(s) replaced", *words["patches"]]),
    )


def _checks(result: VerifyResult, report) -> list[Check]:
    loading = result.loading
    findings = Findings(
        unmatched_keys=list(report.unmatched_keys),
        conflicts=[c.message() for c in report.conflicts],
        missing=loading.get("missing_keys") or [],
        unexpected=loading.get("unexpected_keys") or [],
        unfired=result.unfired_rules,
        other_types=result.other_type_rules,
    )
    words = problem_words(findings)
    # Transformers' own mismatched-key entries (a load with ignore_mismatched_sizes): named as it names them
    if loading.get("mismatched_keys"):
        words["loading"].insert(0, f"mismatched_keys: {loading['mismatched_keys'][:3]}")
    bad = [p for p in result.provenance if not p.ok]
    return (
        [
            _patches_check(report, words),
            Check(
                "loading",
                not words["loading"],
                "; ".join(words["loading"]) or "no new missing/unexpected/mismatched keys",
            ),
            Check("provenance", False, "save_pretrained of the patched model failed", skipped=True)
            if result.save_error is not None
            else Check(
                "provenance",
                not bad,
                f"all {len(result.provenance)} parameters from the checkpoint"
                if not bad
                else f"{len(result.provenance) - len(bad)} of {len(result.provenance)} parameters from the checkpoint; first "
                f"not: {bad[0].name} ({bad[0].status}: {bad[0].detail})",
            ),
            Check(
                "outputs",
                result.max_abs_diff <= result.atol,
                f"max abs diff of {result.output_kind} {result.max_abs_diff:.3g} (atol {result.atol:g})"
                if result.output_error is None
                else f"the patched model's forward fails: {result.output_error}",
            ),
            *(Check(p.name, p.status == "ok", p.detail, skipped=p.status == "skipped") for p in result.paths),
            Check(
                "round trip",
                result.round_trip is None,
                "bit-exact" if result.round_trip is None else f"first difference: {result.round_trip}",
            ),
        ]
        + _quantization_checks(result.quantization)
        + _training_checks(result.training)
    )


def _training_checks(trained: TrainResult | None) -> list[Check]:
    if trained is None:
        return []
    keys = len(trained.keys)
    run = f"{trained.steps} {trained.optimizer} step(s)"
    if trained.only_unpatched or trained.only_patched:
        detail = (
            f"checkpoint keys differ: only unpatched {trained.only_unpatched[:3]}, only patched "
            f"{trained.only_patched[:3]}"
        )
        training = Check("training", False, detail)
    elif trained.nonfinite_loss is not None:
        label, step, value = trained.nonfinite_loss
        training = Check(
            "training",
            False,
            f"the {label} model's loss is {value} at step {step} of {run}: no gradient to compare ({trained.loss_kind})",
        )
    elif trained.diverged:
        worst = trained.diverged[0]
        training = Check(
            "training",
            False,
            f"after {run}: {len(trained.diverged)} of {keys} checkpoint keys beyond the bound {trained.bound:g}; "
            f"largest {worst.key} {worst.judged:.3g}"
            + (f" (float64 {worst.float64:.3g})" if worst.float64 is not None else ""),
        )
    elif not trained.compared:
        training = Check(
            "training",
            False,
            f"after {run} no weight moved more than the bound {trained.bound:g} (max {trained.max_moved:.3g}): "
            "nothing told apart from noise; raise --lr or --steps",
        )
    else:
        idle = sum(len(i.experts) for i in trained.idle)
        rounding = trained.rounding
        note = (
            f"; {len(rounding)} more beyond it in float32 agree in float64 (fp32 rounding), e.g. {rounding[0].key}"
            if rounding
            else ""
        )
        judged = [k for k in trained.keys if k.judged is not None]
        unjudged = len(trained.keys) - len(judged)
        after_first = any(k.judged != k.max_abs_diff for k in judged)
        scope = (
            f"{len(judged)} of {keys} checkpoint keys, judged after step 1"
            + (f"; {unjudged} key(s) stored in another layout shown, not judged" if unjudged else "")
            + " (Adafactor's statistics are per tensor)"
            if after_first or unjudged
            else f"{keys} checkpoint keys"
        )
        training = Check(
            "training",
            True,
            f"after {run}: largest judged difference {trained.max_diff:.3g} over {scope} (bound {trained.bound:g}, "
            f"weights moved up to {trained.max_moved:.3g}){note}; {idle} idle expert-step(s)",
        )
    missing = trained.missing_grads
    gradients = Check(
        "gradients",
        not missing,
        "every trainable parameter got a gradient where the unpatched model's did"
        if not missing
        else f"{len(missing)} parameter(s) with grad=None that the unpatched model trains, e.g. {missing[0].parameter} "
        f"(step(s) {', '.join(map(str, missing[0].steps))})",
    )
    return [training, gradients]


def _quantization_checks(quantized: QuantizedResult | None) -> list[Check]:
    if quantized is None:
        return []
    c = quantized.census
    fine = c.experts_quantized == c.experts and not c.fused_experts and quantized.max_abs_diff <= quantized.atol
    detail = (
        f"{c.linear_quantized} of {c.linear} Linear layers, {c.experts_quantized} of {c.experts} expert Linear "
        f"layers quantized; max abs diff to full precision {quantized.max_abs_diff:.3g} (atol {quantized.atol:g})"
    )
    if c.fused_experts:
        detail += f"; {len(c.fused_experts)} fused experts parameter(s) in full precision (e.g. {c.fused_experts[0]})"
    if quantized.round_trip_diff is None:
        save = Check("quantized save", True, f"{quantized.saved_layout}: {quantized.save_note}")
    else:
        note = f" ({quantized.save_note})" if quantized.save_note else ""
        save = Check(
            "quantized save",
            quantized.round_trip_diff == 0.0,
            f"{quantized.saved_layout} layout{note}; reloaded pre-quantized with the recipe: max abs diff "
            f"{quantized.round_trip_diff:.3g}",
        )
    return [Check("quantized", fine, detail), save]


def render(result: VerifyResult) -> str:
    """The human-readable report."""
    patch = result.patch
    out = [
        f"modelpatch verify: {result.model_dir}",
        f"  recipe {result.recipe}  |  {result.model_class}  |  {result.dtype}  |  input: {result.input}",
    ]
    out.append(
        section(
            "patch report",
            table(
                ["module", "original", "replacement"],
                [[r["path"], r["original"].rsplit(".", 1)[-1], r["replacement"]] for r in patch.get("replaced", [])],
            ),
        )
    )
    if patch.get("unmatched_keys"):
        out.append(f"  keys that replaced nothing: {', '.join(patch['unmatched_keys'])}")
    out += [f"  conflict: {c}" for c in patch.get("conflicts", [])]
    conversion = [
        [r["direction"], r["registered_as"] or "", _short(r["source_keys"]), _short(r["target_keys"])]
        for r in result.conversion
    ]
    out.append(
        section(
            "conversion report (rules -> keys)",
            table(["dir", "rules of", "from", "to"], conversion) if conversion else "  no conversion rule fired",
        )
    )
    rules = sorted({r["rule"] for r in result.conversion})
    out += [f"  rule: {rule}" for rule in rules]
    out += [f"  rule that matched no checkpoint key: {rule}" for rule in result.unfired_rules]
    if result.other_type_rules:
        out.append(f"  {result.other_type_rules}")
    counts: dict[str, int] = {}
    for p in result.provenance:
        counts[p.status] = counts.get(p.status, 0) + 1
    body = table(["status", "parameters"], [[k, v] for k, v in sorted(counts.items())])
    bad = [p for p in result.provenance if not p.ok]
    if bad:
        body += "\n" + table(["parameter", "status", "detail"], [[p.name, p.status, p.detail] for p in bad[:20]])
    out.append(section("parameter provenance", body))
    if result.quantization is not None:
        c = result.quantization.census
        rows: list[list[object]] = [
            ["Linear layers quantized", f"{c.linear_quantized} of {c.linear}"],
            ["expert Linear layers quantized", f"{c.experts_quantized} of {c.experts}"],
            ["not quantized", ", ".join(c.not_quantized) or "-"],
            ["fused experts in full precision", ", ".join(c.fused_experts) or "-"],
            ["max abs diff to full precision", f"{result.quantization.max_abs_diff:.3g}"],
            ["saved layout", result.quantization.saved_layout],
            ["reload max abs diff", str(result.quantization.round_trip_diff)],
        ]
        out.append(section(f"quantization ({result.quantization.name})", table(["", ""], rows)))
    if result.training is not None:
        out.append(render_training(result.training))
    times = result.load_seconds
    out.append(section("load times", table(["load", "seconds"], [[k, f"{v:.3f}"] for k, v in times.items()])))
    out.append(
        section(
            "checks",
            table(["check", "result", "detail"], [[c.name, c.status, c.detail] for c in result.checks]),
        )
    )
    out.append(f"\n{'PASS' if result.ok else 'FAIL'}")
    return "\n".join(out)


def _short(keys: list[str]) -> str:
    if len(keys) <= 1:
        return ", ".join(keys)
    return f"{keys[0]} (+{len(keys) - 1})"


def _tolerance(text: str) -> float:
    """``--atol``: a finite number >= 0."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _at_least_one(text: str) -> int:
    """``--steps``, ``--tokens``, ``--new-tokens``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _path_checks(text: str) -> tuple[str, ...]:
    """``--checks``: names of :data:`.paths.PATH_CHECKS`, comma-separated, or ``none``."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if names == ["none"]:
        return ()
    if "none" in names:  # none with other names
        raise argparse.ArgumentTypeError(f"'none' runs no check and goes alone, got {text!r}")
    unknown = [name for name in names if name not in PATH_CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check(s) {', '.join(unknown) or repr(text)}; choose from {', '.join(PATH_CHECKS)}, or none"
        )
    return tuple(name for name in PATH_CHECKS if name in names)


def _learning_rate(text: str) -> float:
    """``--lr``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="load a checkpoint vanilla and patched; compare weights, outputs and the save round trip",
        description=plain(__doc__.split("\n\n")[0]),
    )
    parser.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the built-in tiny Qwen2-MoE)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--recipe", metavar="NAME", help="a recipe of modelpatch.recipes ('a+b' combines)")
    source.add_argument("--patches", metavar="MODULE_OR_FILE", help="module or .py file defining PATCH_MAPPING")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="load dtype (default float32)")
    parser.add_argument("--atol", type=_tolerance, help="output tolerance (default 1e-5 for float32, else 2e-2)")
    parser.add_argument(
        "--checks",
        type=_path_checks,
        default=PATH_CHECKS,
        metavar="LIST",
        help=f"comma-separated paths to check against the unpatched model besides the weights, outputs and round "
        f"trip: {', '.join(PATH_CHECKS)} (default all; 'none' for none)",
    )
    parser.add_argument(
        "--new-tokens",
        type=_at_least_one,
        default=DEFAULT_NEW_TOKENS,
        metavar="N",
        help=f"tokens decoded by the cache and generate checks (default {DEFAULT_NEW_TOKENS})",
    )
    parser.add_argument(
        "--quantization",
        metavar="NAME",
        help=f"also load the patched model quantized and save it ({', '.join(QUANTIZATIONS)})",
    )
    train = parser.add_argument_group("training (--train)")
    train.add_argument(
        "--train",
        action="store_true",
        help="also train both models the same steps (float32) and compare every checkpoint key",
    )
    train.add_argument("--steps", type=_at_least_one, help=f"optimizer steps with --train (default {DEFAULT_STEPS})")
    train.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        help="optimizer with --train (default adamw; "
        + ", ".join(f"{o.name}: {o.settings}" for o in OPTIMIZERS.values())
        + ")",
    )
    train.add_argument(
        "--lr",
        type=_learning_rate,
        help="learning rate with --train (default "
        + ", ".join(f"{n} {o.default_lr:g}" for n, o in OPTIMIZERS.items())
        + ")",
    )
    train.add_argument(
        "--tokens", type=_at_least_one, help=f"generated tokens per step with --train (default {DEFAULT_TOKENS})"
    )
    train.add_argument("--seed", type=int, help="seed of the generated tokens with --train (default 0)")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_trust_remote_code(parser)
    parser.set_defaults(handler=main)


_TRAIN_OPTIONS = ("steps", "optimizer", "lr", "tokens", "seed")


def _train_settings(args: argparse.Namespace) -> TrainSettings | None:
    """``--train``'s settings, or ``None`` without ``--train``.

    Raises:
        CliError: a training option (``--steps``, ``--optimizer``, ...) given without ``--train``.
    """
    given = [f"--{name}" for name in _TRAIN_OPTIONS if getattr(args, name, None) is not None]
    if not args.train:
        if given:
            raise CliError(f"{', '.join(given)} only apply with --train (add --train, or drop them)")
        return None
    values = {name: getattr(args, name) for name in _TRAIN_OPTIONS if getattr(args, name) is not None}
    return TrainSettings(**values)


def main(args: argparse.Namespace) -> int:
    if args.quantization is not None:
        quantization_config(args.quantization)  # an unknown name, a missing backend: one line, before any load
    train = _train_settings(args)
    if args.model is None and args.recipe is None and args.patches is None:
        recipe, model_dir = FULL_EXAMPLE, example_checkpoint()
    else:
        if args.model is not None:
            checkpoint_dir(args.model)  # a missing folder is named before a missing --recipe
        recipe = resolve_patches(args.recipe, args.patches)
        model_dir = args.model if args.model is not None else example_checkpoint()
        example_types = set(FULL_EXAMPLE.model_types)
        if args.model is None and recipe.model_types and not example_types & set(recipe.model_types):
            raise CliError(
                f"recipe {recipe.name} is for model type(s) {', '.join(recipe.model_types[:8])}"
                f"{' ...' if len(recipe.model_types) > 8 else ''}, and without --model verify runs the built-in "
                f"{', '.join(sorted(example_types))} example: pass --model with a checkpoint of the recipe's model type"
            )
    source_args = f"--patches {args.patches}" if args.patches is not None else f"--recipe {recipe.name}"
    result = run_verify(
        model_dir,
        recipe,
        dtype=args.dtype,
        atol=args.atol,
        progress=False if args.no_progress else None,
        source_args=source_args,
        quantization=args.quantization,
        train=train,
        checks=args.checks,
        new_tokens=args.new_tokens,
    )
    emit(strict_json(result.as_dict()) if args.json else render(result))
    return 0 if result.ok else EXIT_FAILED_CHECK
