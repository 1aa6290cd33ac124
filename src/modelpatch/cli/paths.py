"""``verify``'s checks of the paths patches break, each against the unpatched model on the same input.

``padding``        a left-padded batch (the last row shortened by a third): the logits (or last hidden states) at
                   every non-pad position within ``atol`` of the unpatched model's on the same padded batch
``cache (dynamic)``, ``cache (static)``
                   prefill, then ``new_tokens`` decode steps one token at a time with a ``DynamicCache`` / a
                   ``StaticCache``, both models fed the unpatched model's greedy token: at every step the logits and
                   the cache contents (each layer's key and value tensors) within ``atol``
``generate``       greedy ``generate`` of ``new_tokens`` tokens from the left-padded batch: the same tokens
``routing``        MoE models: the experts each token is routed to, in every MoE layer, on the padded batch
                   (recorded with :func:`modelpatch.routing.record_routing`), the same

A failure names the first position where the models diverge (batch row, token index in the batch as fed, layer,
decode step). A check that cannot run on the model (no generation head, a cache the unpatched model does not
support, no MoE router) is skipped with its reason; a patched model that raises where the unpatched one runs fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PATH_CHECKS", "DEFAULT_NEW_TOKENS", "PathCheck", "run_path_checks"]

PATH_CHECKS = ("padding", "cache", "generate", "routing")
"""The names ``--checks`` takes (``cache`` runs the dynamic and the static cache)."""

DEFAULT_NEW_TOKENS = 2


@dataclass(frozen=True)
class PathCheck:
    """One line of the checks table: ``status`` ``"ok"``, ``"FAIL"`` or ``"skipped"``; ``figure`` the largest
    difference measured (``None`` when skipped); ``where`` the first position of divergence (``None`` when none)."""

    name: str
    status: str
    detail: str
    figure: float | None = None
    where: dict | None = None


class _Diverged(Exception):
    def __init__(self, text: str, where: dict, figure: float):
        super().__init__(text)
        self.where, self.figure = where, figure


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _output(out) -> torch.Tensor:
    """The logits, or (a model without a head) the last hidden states, float32 ``(B, T, *)``."""
    logits = getattr(out, "logits", None)
    return (logits if logits is not None else out.last_hidden_state).float()


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first ``True`` of ``mask`` in row-major order."""
    return tuple(int(i) for i in mask.nonzero()[0])


def left_padded(inputs: dict, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``(B, L)`` long: each row's tokens of ``inputs`` at the right, pads at the
    left; when every row has the same length, the last row loses its last third (so it is padded)."""
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    rows = [row[keep.bool()] for row, keep in zip(ids, mask)]
    if len(rows) > 1 and len({len(r) for r in rows}) == 1 and len(rows[-1]) > 1:
        rows[-1] = rows[-1][: len(rows[-1]) - max(1, len(rows[-1]) // 3)]
    width = max(len(r) for r in rows)
    padded = torch.full((len(rows), width), pad_id, dtype=ids.dtype)
    attention = torch.zeros((len(rows), width), dtype=mask.dtype)
    for i, row in enumerate(rows):
        padded[i, width - len(row) :] = row
        attention[i, width - len(row) :] = 1
    return padded, attention


def _unpadded(inputs: dict) -> torch.Tensor:
    """The rows' tokens cut to the shortest row (no pad anywhere), ``(B, T)``."""
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    rows = [row[keep.bool()] for row, keep in zip(ids, mask)]
    shortest = min(len(r) for r in rows)
    return torch.stack([r[:shortest] for r in rows])


@torch.no_grad()
def _padding(vanilla, patched, ids, mask, atol: float, routing: bool) -> tuple[PathCheck, PathCheck | None]:
    from ..routing import RoutingDiscoveryError, find_router_sites, record_routing

    moe = routing
    if routing:
        try:
            find_router_sites(vanilla)
        except RoutingDiscoveryError:
            moe = False
    try:
        if moe:
            with record_routing(vanilla) as expected_routes:
                expected = _output(vanilla(input_ids=ids, attention_mask=mask))
        else:
            expected = _output(vanilla(input_ids=ids, attention_mask=mask))
    except Exception as exc:  # noqa: BLE001
        reason = f"the unpatched model fails on a left-padded batch: {_error(exc)}"
        return PathCheck("padding", "skipped", reason), PathCheck("routing", "skipped", reason) if routing else None
    actual_routes = None
    try:
        if moe:
            with record_routing(patched) as actual_routes:
                actual = _output(patched(input_ids=ids, attention_mask=mask))
        else:
            actual = _output(patched(input_ids=ids, attention_mask=mask))
    except Exception as exc:  # noqa: BLE001
        failed = f"the patched model fails on a left-padded batch: {_error(exc)}"
        return PathCheck("padding", "FAIL", failed), PathCheck("routing", "FAIL", failed) if routing else None
    pads = int((mask == 0).sum())
    real = mask.bool()
    if actual.shape != expected.shape:
        padding = PathCheck("padding", "FAIL", f"output shape {tuple(actual.shape)}, unpatched {tuple(expected.shape)}")
    else:
        diff = (actual - expected).abs().amax(dim=-1).masked_fill(~real, 0.0)
        diff = diff.nan_to_num(nan=float("inf"))
        worst = float(diff.max())
        what = "logits" if getattr(vanilla, "can_generate", lambda: False)() else "outputs"
        text = f"max abs diff of {what} at {int(real.sum())} non-pad positions {worst:.3g} (atol {atol:g}; {pads} left pad(s))"
        if worst <= atol:
            padding = PathCheck("padding", "ok", text, worst)
        else:
            row, token = _first(diff > atol)
            where = {"row": row, "token": token}
            padding = PathCheck("padding", "FAIL", f"{text}; first beyond atol: row {row}, token {token}", worst, where)
    if not routing:
        return padding, None
    if not moe:
        return padding, PathCheck("routing", "skipped", f"{type(vanilla).__name__} has no MoE router")
    return padding, _routing(expected_routes, actual_routes, mask)


def _routing(expected, actual, mask) -> PathCheck:
    from ..routing import compare_routing

    offsets = [int((row == 0).sum()) for row in mask]  # left pads: a sequence's token t sits at offset + t
    for layer in expected.layers:
        if layer not in actual.layers:
            return PathCheck(
                "routing", "FAIL", f"layer {layer}: the patched model routed no token", 1.0, {"layer": layer}
            )
        for row, (want, got) in enumerate(zip(expected.layer_routes(layer), actual.layer_routes(layer))):
            if want.shape != got.shape:
                return PathCheck(
                    "routing",
                    "FAIL",
                    f"layer {layer}, row {row}: routes {tuple(got.shape)}, unpatched {tuple(want.shape)}",
                    1.0,
                    {"row": row, "layer": layer},
                )
            differs = (want.sort(dim=-1).values != got.sort(dim=-1).values).any(dim=-1)
            if differs.any():
                token = int(differs.nonzero()[0]) + offsets[row]
                agreement = compare_routing(expected, actual)
                where = {"row": row, "token": token, "layer": layer}
                return PathCheck(
                    "routing",
                    "FAIL",
                    f"router disagreement {agreement.router_disagreement_rate:.3g} over {agreement.tokens} tokens x "
                    f"{len(expected.layers)} MoE layers; first: row {row}, token {token}, layer {layer}: experts "
                    f"{sorted(got[int(differs.nonzero()[0])].tolist())}, unpatched {sorted(want[int(differs.nonzero()[0])].tolist())}",
                    agreement.router_disagreement_rate,
                    where,
                )
    tokens = sum(expected.sequence_lengths)
    return PathCheck(
        "routing", "ok", f"the same experts for all {tokens} tokens x {len(expected.layers)} MoE layers", 0.0
    )


def _caches(vanilla, kind: str, length: int) -> tuple:
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=vanilla.config), DynamicCache(config=vanilla.config)
    return (
        StaticCache(config=vanilla.config, max_cache_len=length),
        StaticCache(config=vanilla.config, max_cache_len=length),
    )


@dataclass
class _Decoded:
    """Both models' greedy ``generate`` of the same prompt with a cache of one kind."""

    kind: str
    prompt: int
    expected: Any = None
    actual: Any = None
    want: Any = None
    got: Any = None
    failed: PathCheck | None = None


@torch.no_grad()
def _decode(vanilla, patched, ids, mask, new_tokens: int, pad_id: int, kind: str) -> _Decoded:
    """Greedy ``generate`` of ``new_tokens`` tokens by both models from the left-padded batch, each with its own
    cache of ``kind`` (prefill, then one decode step per token), keeping every step's logits and the caches."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    run = _Decoded(kind, ids.shape[1])
    name = f"cache ({kind})"
    try:
        run.want, run.got = _caches(vanilla, kind, ids.shape[1] + new_tokens)
        run.expected = vanilla.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, past_key_values=run.want
        )
    except Exception as exc:  # noqa: BLE001
        run.failed = PathCheck(
            name, "skipped", f"the unpatched model's generate fails with a {kind} cache: {_error(exc)}"
        )
        return run
    try:
        run.actual = patched.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, past_key_values=run.got
        )
    except Exception as exc:  # noqa: BLE001
        run.failed = PathCheck(name, "FAIL", f"the patched model's generate fails with a {kind} cache: {_error(exc)}")
    return run


def _step(prompt: int, token: int) -> str:
    """The forward that fed ``token``: the prefill (the prompt) or a decode step."""
    return "prefill" if token < prompt else f"decode step {token - prompt + 1}"


def _compare_cache(want, got, valid: torch.Tensor, atol: float) -> tuple[float, _Diverged | None]:
    """``(largest key/value difference over the ``valid`` positions (B, T) of every layer, the first divergence:
    lowest token, then row, then layer)``."""
    worst, first, first_at = 0.0, None, None
    if len(got.layers) != len(want.layers):
        return float("inf"), _Diverged(
            f"{len(got.layers)} cache layers, unpatched {len(want.layers)}", {}, float("inf")
        )
    for layer, (a, b) in enumerate(zip(want.layers, got.layers)):
        for name in ("keys", "values"):
            x, y = getattr(a, name, None), getattr(b, name, None)
            if not isinstance(x, torch.Tensor) or x.numel() == 0:
                continue
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                shape = tuple(y.shape) if isinstance(y, torch.Tensor) and y.numel() else None
                what = "not cached" if shape is None else f"shape {shape}"
                diverged = _Diverged(
                    f"layer {layer} {name} {what}, unpatched {tuple(x.shape)}", {"layer": layer}, float("inf")
                )
                return float("inf"), first if first is not None else diverged
            width = min(x.shape[2], valid.shape[1])  # (B, heads, T, head_dim); a static cache's unused tail is left out
            diff = (x[:, :, :width].float() - y[:, :, :width].float()).abs().nan_to_num(nan=float("inf"))
            per_token = diff.amax(dim=(1, 3)).masked_fill(~valid[:, :width], 0.0)  # (B, T)
            top = float(per_token.max()) if per_token.numel() else 0.0
            worst = max(worst, top)
            if top > atol:
                beyond = per_token > atol
                token = int(beyond.any(dim=0).nonzero()[0])
                row = int(beyond[:, token].nonzero()[0])
                if first_at is None or token < first_at:
                    first_at = token
                    first = _Diverged(
                        f"layer {layer} {name} differ by {top:.3g}; first: row {row}, token {token}, layer {layer}",
                        {"row": row, "token": token, "layer": layer},
                        top,
                    )
    return worst, first


def _cache_check(run: _Decoded, mask: torch.Tensor, atol: float) -> PathCheck:
    name = f"cache ({run.kind})"
    if run.failed is not None:
        return run.failed
    prompt = run.prompt
    logits_worst, logits_first = 0.0, None
    for step, (a, b) in enumerate(zip(run.expected.logits, run.actual.logits)):
        if a.shape != b.shape:
            logits_first = (step, _Diverged(f"logits {tuple(b.shape)}, unpatched {tuple(a.shape)}", {}, float("inf")))
            break
        diff = (a.float() - b.float()).abs().amax(dim=-1).nan_to_num(nan=float("inf"))  # (B,)
        top = float(diff.max())
        logits_worst = max(logits_worst, top)
        if top > atol:
            row, token = int((diff > atol).nonzero()[0]), prompt - 1 + step  # the logits of the token fed at step
            where = {"row": row, "token": token}
            logits_first = (step, _Diverged(f"logits differ by {top:.3g}; first: row {row}, token {token}", where, top))
            break
    # the cache positions both models computed from the same tokens: the prompt's non-pad ones, then the generated
    # tokens fed before the logits diverged
    fed = prompt + (logits_first[0] if logits_first is not None else len(run.expected.logits) - 1)
    valid = torch.cat([mask.bool(), mask.new_ones(mask.shape[0], max(0, fed - prompt)).bool()], dim=1)[:, :fed]
    cache_worst, cache_first = _compare_cache(run.want, run.got, valid, atol)
    candidates = []
    if cache_first is not None:
        token = cache_first.where.get("token", 0)
        candidates.append((0 if token < prompt else token - prompt + 1, 0, cache_first))
    if logits_first is not None:
        candidates.append((logits_first[0], 1, logits_first[1]))
    if candidates:
        step, _, diverged = min(candidates, key=lambda c: c[:2])
        label = "prefill" if step == 0 else f"decode step {step}"
        return PathCheck(name, "FAIL", f"{label}: {diverged}", diverged.figure, {**diverged.where, "step": step})
    steps = len(run.expected.logits)
    return PathCheck(
        name,
        "ok",
        f"prefill {prompt} + {steps - 1} decode step(s), left-padded: max abs diff of logits {logits_worst:.3g}, of "
        f"keys/values {cache_worst:.3g} (atol {atol:g})",
        max(logits_worst, cache_worst),
    )


def _generate_check(run: _Decoded) -> PathCheck:
    if run.failed is not None:
        return PathCheck("generate", run.failed.status, run.failed.detail.replace(f" with a {run.kind} cache", ""))
    prompt = run.prompt
    want, got = run.expected.sequences[:, prompt:], run.actual.sequences[:, prompt:]
    steps = min(want.shape[1], got.shape[1])
    differs = want[:, :steps] != got[:, :steps]
    if differs.any() or want.shape != got.shape:
        if differs.any():  # the earliest new token, then the first row
            step = int(differs.any(dim=0).nonzero()[0])
            row = int(differs[:, step].nonzero()[0])
        else:
            row, step = 0, steps
        token = prompt + step
        return PathCheck(
            "generate",
            "FAIL",
            f"{int(differs.sum())} of {want.numel()} tokens differ; first: row {row}, new token {step} (token {token}): "
            f"{got[row, step].item() if step < got.shape[1] else 'none'}, unpatched "
            f"{want[row, step].item() if step < want.shape[1] else 'none'}",
            float(differs.sum()),
            {"row": row, "token": token, "step": step},
        )
    return PathCheck(
        "generate",
        "ok",
        f"{want.numel()} of {want.numel()} greedy tokens equal ({want.shape[0]} rows x {want.shape[1]}, left-padded, "
        "dynamic cache)",
        0.0,
    )


def run_path_checks(
    vanilla,
    patched,
    inputs: dict,
    *,
    checks: tuple[str, ...],
    new_tokens: int,
    atol: float,
    progress: Callable[[str], None] | None = None,
) -> list[PathCheck]:
    """The checks named in ``checks`` (of :data:`PATH_CHECKS`) of ``patched`` against ``vanilla`` (both in eval
    mode, the same dtype), from the token ids of ``inputs`` (``input_ids``, ``attention_mask`` ``(B, T)``).

    Returns one :class:`PathCheck` per line (``cache`` gives two: dynamic and static), in the order of
    :data:`PATH_CHECKS`. Never raises for what a model does: an exception of the unpatched model skips the
    check (with its message), one of the patched model fails it.
    """
    pad_id = getattr(vanilla.config, "pad_token_id", None)
    pad_id = int(pad_id) if isinstance(pad_id, int) else 0
    ids, mask = left_padded(inputs, pad_id)
    results: list[PathCheck] = []
    routing = None
    if "padding" in checks or "routing" in checks:
        if progress:
            progress("padding")
        padding, routing = _padding(vanilla, patched, ids, mask, atol, "routing" in checks)
        if "padding" in checks:
            results.append(padding)
    generates = bool(getattr(vanilla, "can_generate", lambda: False)())
    reason = f"{type(vanilla).__name__} has no generation head (can_generate() is False)"
    kinds = ("dynamic", "static") if "cache" in checks else ("dynamic",) if "generate" in checks else ()
    runs = {}
    for kind in kinds:
        if progress:
            progress(f"generate, {kind} cache")
        runs[kind] = _decode(vanilla, patched, ids, mask, new_tokens, pad_id, kind) if generates else None
    if "cache" in checks:
        for kind in kinds:
            run = runs[kind]
            results.append(
                PathCheck(f"cache ({kind})", "skipped", reason) if run is None else _cache_check(run, mask, atol)
            )
    if "generate" in checks:
        run = runs["dynamic"]
        results.append(PathCheck("generate", "skipped", reason) if run is None else _generate_check(run))
    if routing is not None:
        results.append(routing)
    return results
