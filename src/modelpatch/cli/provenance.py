"""Parameter provenance and the save round trip, checked by value against safetensors files.

Provenance: the patched model is saved (``save_pretrained`` writes the original layout through the reverse
conversion); for every parameter, the checkpoint keys it was loaded from (the conversion report's load rows, else
the same name) must come back from that save equal, bit for bit (after a cast to the saved dtype), to the
checkpoint tensors. Conversion operations only move data, so a parameter left at its initial value, or loaded from
the wrong slice, shows up as a differing key. Parameters under Transformers' own built-in conversions (no row) are
checked as a group: every checkpoint key no row or name claims must come back equal.

Round trip: the saved folder loaded by plain Transformers (no patch) must equal the vanilla model bit for bit.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from safetensors import safe_open

from .checkpoint import checkpoint_files

__all__ = ["ParamSource", "parameter_provenance", "first_difference", "OK_STATUSES"]

OK_STATUSES = ("checkpoint", "checkpoint (built-in conversion)", "tied")


@dataclass(frozen=True)
class ParamSource:
    """Where one parameter's values came from. ``status`` is one of :data:`OK_STATUSES`, ``"differs"`` (a
    checkpoint key it feeds comes back different), ``"not saved"`` or ``"not in checkpoint"``."""

    name: str
    status: str
    keys: tuple[str, ...] = ()
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    def as_dict(self) -> dict:
        return {
            "parameter": self.name,
            "status": self.status,
            "checkpoint_keys": list(self.keys),
            "detail": self.detail,
        }


class _Tensors:
    """Lazy ``{normalised key: tensor}`` over a checkpoint folder's safetensors files."""

    def __init__(self, stack: ExitStack, folder: str, normalise):
        self._where = {}
        for file in checkpoint_files(folder):
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for key in handle.keys():
                self._where[normalise(key)] = (handle, key)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self):
        return self._where.keys()

    def stored_name(self, key: str) -> str:
        """The key as written in the file (``key`` is normalised: without the base model prefix)."""
        return self._where[key][1] if key in self._where else key

    def __getitem__(self, key: str) -> torch.Tensor:
        handle, real = self._where[key]
        return handle.get_tensor(real)


def _compare(keys, saved: _Tensors, source: _Tensors) -> tuple[str, str]:
    for key in keys:
        if key not in saved:
            return "not saved", f"save_pretrained wrote no '{key}'"
        got = saved[key]
        want = source[key].to(got.dtype)
        if got.shape != want.shape:
            return "differs", f"'{key}': saved shape {tuple(got.shape)} != checkpoint {tuple(want.shape)}"
        if not torch.equal(got, want):
            return "differs", f"'{key}': max abs diff {(got.float() - want.float()).abs().max().item():.3g}"
    return "checkpoint", ""


def parameter_provenance(
    model, checkpoint_dir: str, saved_dir: str, load_rows, missing_keys: Collection[str] = ()
) -> list[ParamSource]:
    """One :class:`ParamSource` per parameter of ``model`` (tied parameters listed under each name).

    Args:
        model: the patched model, loaded from ``checkpoint_dir``.
        saved_dir: where ``model.save_pretrained`` wrote it.
        load_rows: the conversion report's rows of direction ``"load"`` (checkpoint keys → model keys).
        missing_keys: what ``from_pretrained(output_loading_info=True)`` reported missing for ``model``: such a
            parameter is ``"not in checkpoint"`` even when other checkpoint keys went through built-in conversions.
    """
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""

    def normalise(key: str) -> str:
        return key[len(prefix) :] if prefix and key.startswith(prefix) else key

    missing = {normalise(str(k)) for k in missing_keys}
    from_rows = {}
    for row in load_rows:
        for target in row.target_keys:
            from_rows[normalise(target)] = tuple(normalise(s) for s in row.source_keys)
    result: list[ParamSource] = []
    with ExitStack() as stack:
        source = _Tensors(stack, checkpoint_dir, normalise)
        saved = _Tensors(stack, saved_dir, normalise)
        claimed: set[str] = set()
        first_name: dict[int, str] = {}
        pending: list[str] = []
        for name, param in model.named_parameters(remove_duplicate=False):
            key = normalise(name)
            keys = from_rows.get(key) or ((key,) if key in source else None)
            if keys is None:
                twin = first_name.get(id(param))
                if twin is not None:
                    result.append(ParamSource(name, "tied", (), f"shares storage with {twin}"))
                else:
                    pending.append(name)
                first_name.setdefault(id(param), name)
                continue
            first_name.setdefault(id(param), name)
            claimed.update(keys)
            status, detail = _compare(keys, saved, source)
            result.append(ParamSource(name, status, tuple(source.stored_name(k) for k in keys), detail))
        unfed = [n for n in pending if normalise(n) in missing]
        result += [
            ParamSource(n, "not in checkpoint", (), "from_pretrained reported it missing: its initial value")
            for n in unfed
        ]
        pending = [n for n in pending if normalise(n) not in missing]
        if pending:
            rest = tuple(k for k in source.keys() if k not in claimed and k in saved)
            if not rest:
                result += [ParamSource(n, "not in checkpoint", (), "no checkpoint key feeds it") for n in pending]
            else:
                status, detail = _compare(rest, saved, source)
                status = "checkpoint (built-in conversion)" if status == "checkpoint" else status
                result += [ParamSource(n, status, (), detail) for n in pending]
    return result


def first_difference(actual: dict, expected: dict) -> str | None:
    """``None`` when both state dicts have the same keys and bit-identical tensors, else a description of the
    first difference (sorted key order)."""
    if set(actual) != set(expected):
        extra, missing = sorted(set(actual) - set(expected)), sorted(set(expected) - set(actual))
        return f"key sets differ: extra {extra[:3]}, missing {missing[:3]}"
    for key in sorted(expected):
        a, e = actual[key], expected[key]
        if a.shape != e.shape or a.dtype != e.dtype or not torch.equal(a, e):
            return key
    return None
