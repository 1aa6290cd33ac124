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

import torch

__all__ = ["PATH_CHECKS", "DEFAULT_NEW_TOKENS", "PathCheck", "run_path_checks"]

PATH_CHECKS = ("padding", "cache", "generate", "routing")
"""The names ``--checks`` takes (``cache`` runs the dynamic and the static cache)."""

DEFAULT_NEW_TOKENS = 4


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


def _compare_cache(want, got, atol: float, step: str) -> float:
    """The largest key/value difference over every layer; raises :class:`_Diverged` at the first beyond ``atol``."""
    worst = 0.0
    if len(got.layers) != len(want.layers):
        raise _Diverged(f"{step}: {len(got.layers)} cache layers, unpatched {len(want.layers)}", {}, float("inf"))
    for layer, (a, b) in enumerate(zip(want.layers, got.layers)):
        for name in ("keys", "values"):
            x, y = getattr(a, name, None), getattr(b, name, None)
            if x is None or (isinstance(x, torch.Tensor) and x.numel() == 0):
                continue
            if y is None or not isinstance(y, torch.Tensor) or y.shape != x.shape:
                shape = None if not isinstance(y, torch.Tensor) else tuple(y.shape)
                raise _Diverged(
                    f"{step}: layer {layer} {name} {'not cached' if shape is None else f'shape {shape}'}, unpatched "
                    f"{tuple(x.shape)}",
                    {"layer": layer},
                    float("inf"),
                )
            diff = (x.float() - y.float()).abs().nan_to_num(nan=float("inf"))
            top = float(diff.max()) if diff.numel() else 0.0
            worst = max(worst, top)
            if top > atol:  # (B, heads, T, head_dim): first row, then first token
                row, _, token, _ = _first(diff.amax(dim=(1, 3), keepdim=True).expand_as(diff) > atol)
                raise _Diverged(
                    f"{step}: layer {layer} {name} differ by {top:.3g}; first: row {row}, token {token}, layer {layer}",
                    {"row": row, "token": token, "layer": layer},
                    top,
                )
    return worst


@torch.no_grad()
def _cache(vanilla, patched, ids: torch.Tensor, new_tokens: int, atol: float, kind: str) -> PathCheck:
    name = f"cache ({kind})"
    length = ids.shape[1] + new_tokens
    try:
        want, got = _caches(vanilla, kind, length)
        mask = torch.ones_like(ids)
        expected = vanilla(input_ids=ids, attention_mask=mask, past_key_values=want, use_cache=True)
    except Exception as exc:  # noqa: BLE001
        return PathCheck(name, "skipped", f"the unpatched model fails with a {kind} cache: {_error(exc)}")
    fed, logits_worst, cache_worst = ids, 0.0, 0.0
    try:
        for step in range(new_tokens + 1):
            label = "prefill"
            if step:  # both models get the unpatched model's greedy token
                token = expected.logits[:, -1:].argmax(dim=-1)
                fed = torch.cat([fed, token], dim=1)
                mask = torch.ones_like(fed)
                expected = vanilla(input_ids=token, attention_mask=mask, past_key_values=want, use_cache=True)
                label = f"decode step {step} (token {fed.shape[1] - 1})"
            try:
                actual = patched(
                    input_ids=fed if step == 0 else fed[:, -1:],
                    attention_mask=mask,
                    past_key_values=got,
                    use_cache=True,
                )
            except Exception as exc:  # noqa: BLE001
                raise _Diverged(
                    f"{label}: the patched model fails: {_error(exc)}", {"step": step}, float("inf")
                ) from None
            a, b = expected.logits.float(), actual.logits.float()
            if a.shape != b.shape:
                raise _Diverged(
                    f"{label}: logits {tuple(b.shape)}, unpatched {tuple(a.shape)}", {"step": step}, float("inf")
                )
            diff = (a - b).abs().amax(dim=-1).nan_to_num(nan=float("inf"))
            top = float(diff.max())
            logits_worst = max(logits_worst, top)
            if top > atol:
                row, token = _first(diff > atol)
                token += fed.shape[1] - a.shape[1]
                raise _Diverged(
                    f"{label}: logits differ by {top:.3g}; first: row {row}, token {token}",
                    {"step": step, "row": row, "token": token},
                    top,
                )
            try:
                cache_worst = max(cache_worst, _compare_cache(want, got, atol, label))
            except _Diverged as diverged:
                diverged.where["step"] = step
                raise
    except _Diverged as diverged:
        return PathCheck(name, "FAIL", str(diverged), diverged.figure, diverged.where)
    return PathCheck(
        name,
        "ok",
        f"prefill {ids.shape[1]} + {new_tokens} decode step(s): max abs diff of logits {logits_worst:.3g}, of "
        f"keys/values {cache_worst:.3g} (atol {atol:g})",
        max(logits_worst, cache_worst),
    )


@torch.no_grad()
def _generate(vanilla, patched, ids, mask, new_tokens: int, atol: float, pad_id: int) -> PathCheck:
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
    try:
        expected = vanilla.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    except Exception as exc:  # noqa: BLE001
        return PathCheck("generate", "skipped", f"the unpatched model's generate fails: {_error(exc)}")
    try:
        actual = patched.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    except Exception as exc:  # noqa: BLE001
        return PathCheck("generate", "FAIL", f"the patched model's generate fails: {_error(exc)}")
    want, got = expected.sequences[:, ids.shape[1] :], actual.sequences[:, ids.shape[1] :]
    steps = min(want.shape[1], got.shape[1])
    differs = want[:, :steps] != got[:, :steps]
    # the logits of the steps both models took with the same tokens so far
    agree = steps if not differs.any() else int(differs.any(dim=0).nonzero()[0])
    worst = max(
        (
            float((a.float() - b.float()).abs().max())
            for a, b in zip(expected.logits[: agree + 1], actual.logits[: agree + 1])
        ),
        default=0.0,
    )
    if differs.any() or want.shape != got.shape:
        if differs.any():  # the earliest new token, then the first row
            step = int(differs.any(dim=0).nonzero()[0])
            row = int(differs[:, step].nonzero()[0])
        else:
            row, step = 0, steps
        token = ids.shape[1] + step
        return PathCheck(
            "generate",
            "FAIL",
            f"{int(differs.sum())} of {want.numel()} tokens differ; first: row {row}, new token {step} (token {token}): "
            f"{got[row, step].item() if step < got.shape[1] else 'none'}, unpatched "
            f"{want[row, step].item() if step < want.shape[1] else 'none'}; max abs diff of logits up to there {worst:.3g}",
            worst,
            {"row": row, "token": token, "step": step},
        )
    return PathCheck(
        "generate",
        "ok",
        f"{want.numel()} of {want.numel()} greedy tokens equal ({want.shape[0]} rows x {new_tokens}, left-padded); "
        f"max abs diff of logits {worst:.3g}",
        worst,
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
    results: list[PathCheck] = []
    if "padding" in checks or "routing" in checks:
        if progress:
            progress("padding")
        ids, mask = left_padded(inputs, pad_id)
        padding, routing = _padding(vanilla, patched, ids, mask, atol, "routing" in checks)
        if "padding" in checks:
            results.append(padding)
    generates = bool(getattr(vanilla, "can_generate", lambda: False)())
    reason = f"{type(vanilla).__name__} has no generation head (can_generate() is False)"
    if "cache" in checks:
        for kind in ("dynamic", "static"):
            if progress:
                progress(f"{kind} cache")
            if not generates:
                results.append(PathCheck(f"cache ({kind})", "skipped", reason))
            else:
                results.append(_cache(vanilla, patched, _unpadded(inputs), new_tokens, atol, kind))
    if "generate" in checks:
        if progress:
            progress("generate")
        if not generates:
            results.append(PathCheck("generate", "skipped", reason))
        else:
            ids, mask = left_padded(inputs, pad_id)
            results.append(_generate(vanilla, patched, ids, mask, new_tokens, atol, pad_id))
    if "routing" in checks and routing is not None:
        results.append(routing)
    return results
