"""Where each sequence's tokens sit in the flattened ``(batch * seq_len)`` token grid a router sees.

Handles plain batches, left or right padding (2-D ``attention_mask``), several sequences packed into one
row (``position_ids`` restarting), and decode steps with a KV cache (``past_key_values`` non-empty).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.utils import logging

from ..errors import ModelpatchRuntimeError

logger = logging.get_logger(__name__)

__all__ = ["Slot", "ForwardLayout", "layout_from_call"]


@dataclass
class Slot:
    """The tokens of one sequence in one forward: ``rows`` indexes the flat token grid (a ``slice`` when they
    are contiguous, else a LongTensor), ``n`` tokens; ``seq``/``start`` are filled by the session (which
    trace sequence, and its first token position in that sequence)."""

    rows: slice | torch.Tensor
    n: int
    seq: int = -1
    start: int = 0
    pad_end: int = 0  # replay: trailing tokens without a route in the trace (engine "seq_len - 1" rows)


@dataclass
class ForwardLayout:
    num_tokens: int
    slots: list[Slot] = field(default_factory=list)
    continuation: bool = False
    past: int = 0  # positions already in the KV cache
    seq_len: int = 0  # positions of this forward per row (padding included)


_SIGNATURES: weakref.WeakKeyDictionary[Any, inspect.Signature | None] = weakref.WeakKeyDictionary()


def signature_binder(module: torch.nn.Module):
    """The signature of ``module.forward`` (``None`` if it has none), memoised per forward function (every record /
    replay block asks for it)."""
    forward = module.forward
    func = getattr(forward, "__func__", None)
    if func is not None and getattr(forward, "__self__", None) is module:
        try:
            return _SIGNATURES[func]
        except (KeyError, TypeError):
            pass
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        sig = None
    if func is not None and getattr(forward, "__self__", None) is module:
        try:
            _SIGNATURES[func] = sig
        except TypeError:  # not weak-referenceable
            pass
    return sig


def _past_length(past) -> int:
    if past is None:
        return 0
    get = getattr(past, "get_seq_length", None)
    if get is not None:
        try:
            n = int(get())
        except Exception:  # noqa: BLE001 - caches of exotic layers: assume no past
            n = 0
        if n == 0:  # layer 0 may hold no key/value states (MiniMax: linear attention there): ask every layer
            for layer in getattr(past, "layers", None) or ():
                try:
                    n = max(n, int(layer.get_seq_length()))
                except Exception:  # noqa: BLE001 - layers without a sequence length (linear attention, SSM)
                    continue
        return n
    if isinstance(past, (tuple, list)) and past and isinstance(past[0], (tuple, list)) and past[0]:
        return int(past[0][0].shape[-2])
    return 0


def layout_from_call(  # noqa: C901 - each branch reads one of the forward's optional inputs (ids / embeds, mask, positions, cache)
    module: torch.nn.Module, args: tuple, kwargs: dict, sig=None, *, past: int | None = None
) -> ForwardLayout:
    """Layout of the tokens of one call of the decoder-stack owner ``module`` (e.g. ``Qwen3MoeModel``).

    Reads ``input_ids`` (B, S) or ``inputs_embeds`` (B, S, H), a 2-D ``attention_mask`` (B, past + S)
    (1 = real token), ``position_ids`` (B, S) or (n, B, S), ``past_key_values`` (``cache`` from Transformers
    5.24) / ``cache_position``. ``past`` (positions already cached), when given, is used instead of reading the
    cache (the compiled path reads it while tracing).
    """
    sig = sig or signature_binder(module)
    bound = dict(kwargs)
    if args and sig is not None:
        try:
            bound.update(sig.bind_partial(*args).arguments)
        except TypeError:
            pass
    ref = bound.get("input_ids")
    if ref is None:
        ref = bound.get("inputs_embeds")
        if ref is not None:
            ref = ref[..., 0]
    if ref is None:
        ref = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if ref is None or ref.dim() < 2:
        raise ModelpatchRuntimeError(
            f"routing: cannot read the batch layout of {type(module).__name__}.forward "
            "(expected input_ids (batch, seq_len) or inputs_embeds (batch, seq_len, hidden))"
        )
    bsz, seq_len = int(ref.shape[0]), int(ref.shape[1])
    # the KV cache argument is `past_key_values` up to Transformers 5.23 and `cache` from 5.24 on
    if past is None:
        cache = bound.get("past_key_values")
        past = _past_length(cache if cache is not None else bound.get("cache"))
    cache_position = bound.get("cache_position")
    if past == 0 and isinstance(cache_position, torch.Tensor) and cache_position.numel():
        past = int(cache_position.reshape(-1)[0])
    layout = ForwardLayout(num_tokens=bsz * seq_len, continuation=past > 0, past=past, seq_len=seq_len)

    mask = bound.get("attention_mask")
    valid = None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == bsz:
        valid = mask[:, -seq_len:].bool()
        if bool(valid.all()):
            valid = None
    elif isinstance(mask, torch.Tensor) and mask.dim() != 2:
        logger.warning_once(
            f"routing: {mask.dim()}-D attention_mask given to {type(module).__name__}; padding cannot be read from "
            "it, so every position of every row is treated as a token of its sequence"
        )

    pos = bound.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() == 3:
        pos = pos[0]
    if (
        valid is None
        and not layout.continuation
        and bsz == 1
        and isinstance(pos, torch.Tensor)
        and pos.dim() == 2
        and pos.shape[-1] == seq_len
        and seq_len > 1
    ):
        p = pos[0]
        starts = [0] + ((p[1:] <= p[:-1]).nonzero().flatten() + 1).tolist()
        ends = starts[1:] + [seq_len]
        layout.slots = [Slot(slice(s, e), e - s) for s, e in zip(starts, ends)]
        return layout

    for b in range(bsz):
        if valid is None:
            layout.slots.append(Slot(slice(b * seq_len, (b + 1) * seq_len), seq_len))
        else:
            cols = valid[b].nonzero().flatten()
            layout.slots.append(Slot(cols + b * seq_len, int(cols.numel())))
    return layout
