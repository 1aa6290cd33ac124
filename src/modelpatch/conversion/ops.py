"""Tensor operations used by :class:`~modelpatch.conversion.rules.WeightConverter`, each with an exact inverse.

The classes subclass Transformers' ``core_model_loading.ConversionOps`` so they plug into the same converter
protocol (``convert(input_dict, source_patterns, target_patterns, **kwargs) -> dict[pattern, Tensor]``), and reuse
Transformers' implementation where it is correct (``Concatenate``, ``MergeModulelist``, ``SplitModulelist``,
``Transpose``). ``Chunk`` is reimplemented: Transformers' version splits into *equal* pieces, so the reverse of a
grouped-query ``qkv_proj`` (e.g. 64/32/32 rows) silently produced 43/43/42 rows.

All operations are pure data movement (``cat``/``split``/``stack``/``transpose``): values are preserved bit for bit,
for any dtype, and they also run on ``meta`` tensors (used to check shapes before anything is loaded).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping, Sequence

import torch
from transformers import core_model_loading as _tcml

from ..errors import ModelpatchTypeError, ModelpatchValueError
from .errors import ConversionError

__all__ = [
    "Chunk",
    "Concatenate",
    "Deinterleave",
    "Interleave",
    "SwapDims",
    "MergeModulelist",
    "SplitModulelist",
    "Transpose",
    "as_modelpatch_op",
    "check_operation",
]


def _single_tensor(input_dict: dict, op: str) -> torch.Tensor:
    if len(input_dict) != 1:
        raise ConversionError(f"{op} expects exactly one source tensor, got patterns {list(input_dict)}")
    tensors = next(iter(input_dict.values()))
    if isinstance(tensors, list):
        if len(tensors) != 1:
            raise ConversionError(f"{op} expects one tensor per source, got {len(tensors)}")
        return tensors[0]
    return tensors


def _piece_sizes(sizes: object) -> list[int]:
    """``sizes`` as a list of non-negative ints (Python or NumPy/torch integers).

    Raises:
        ModelpatchValueError: ``sizes`` is a string, not iterable, or holds something else than non-negative ints.
    """
    try:
        if isinstance(sizes, (str, bytes)):
            raise TypeError
        values = [operator.index(s) for s in sizes]  # type: ignore[attr-defined]
    except TypeError:
        values = []
    else:
        if all(v >= 0 for v in values):
            return values
    raise ModelpatchValueError(f"Chunk(sizes={sizes!r}): sizes must be a list of non-negative ints, e.g. [64, 32, 32]")


class Chunk(_tcml.ConversionOps):
    """Split one tensor along ``dim`` into one piece per target pattern.

    Args:
        dim: dimension to split.
        sizes: explicit piece sizes along ``dim`` (e.g. ``[64, 32, 32]`` for GQA q/k/v rows). When ``None`` the
            sizes are resolved, in order, from ``reference_shapes`` passed by the engine (at load: the patched model's
            parameter shapes; at save: the shapes recorded from the checkpoint that was loaded, else those of the
            vanilla model), and only for intermediate, stacked targets (patterns containing ``*``) by an equal split.

    Input: ``{source: Tensor[..., sum(sizes), ...]}``; output: ``{target_i: Tensor[..., sizes[i], ...]}`` (views of
    the input: the plan copies each *final* output once into its own contiguous storage, so a chain such as
    ``Chunk`` + ``SplitModulelist`` copies the data once, not twice).

    Raises:
        ConversionError: the sizes do not add up to the tensor's size along ``dim``, or cannot be determined
            (a concrete target without a reference shape is never guessed by an equal split).
    """

    def __init__(self, dim: int = 0, sizes: Sequence[int] | None = None):
        self.dim = dim
        self.sizes = None if sizes is None else _piece_sizes(sizes)

    def __repr__(self):
        return f"Chunk(dim={self.dim}" + ("" if self.sizes is None else f", sizes={self.sizes}") + ")"

    def _resolve_sizes(self, tensor, target_patterns, full_layer_name, reference_shapes) -> list[int]:
        total = tensor.shape[self.dim]
        if self.sizes is not None:
            if len(self.sizes) != len(target_patterns) or sum(self.sizes) != total:
                raise ConversionError(
                    f"{self!r}: sizes {self.sizes} do not split dimension {self.dim} of size {total} into "
                    f"{len(target_patterns)} pieces for {target_patterns} ({full_layer_name})"
                )
            return list(self.sizes)
        if any("*" in t for t in target_patterns):
            # Intermediate stacked tensors (e.g. gate/up halves of a fused experts tensor): equal halves by definition.
            if total % len(target_patterns):
                raise ConversionError(
                    f"{self!r}: cannot split {total} evenly into {target_patterns} ({full_layer_name})"
                )
            return [total // len(target_patterns)] * len(target_patterns)
        sizes = []
        prefix, first, suffix = (full_layer_name or "").rpartition(target_patterns[0])
        for target in target_patterns:
            name = f"{prefix}{target}{suffix}" if first else None
            shape = reference_shapes.get(name) if (reference_shapes is not None and name) else None
            if shape is None or len(shape) != tensor.dim():
                raise ConversionError(
                    f"{self!r}: cannot determine the size of '{name or target}' along dim {self.dim} when splitting "
                    f"'{full_layer_name}' of shape {tuple(tensor.shape)}; pass Chunk(dim={self.dim}, sizes=[...])"
                )
            sizes.append(int(shape[self.dim]))
        if sum(sizes) != total:
            raise ConversionError(
                f"{self!r}: reference sizes {sizes} of {target_patterns} do not add up to {total} "
                f"(dim {self.dim} of '{full_layer_name}', shape {tuple(tensor.shape)})"
            )
        return sizes

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, reference_shapes=None, **kw):
        tensor = _single_tensor(input_dict, repr(self))
        sizes = self._resolve_sizes(tensor, target_patterns, full_layer_name, reference_shapes)
        pieces = torch.split(tensor, sizes, dim=self.dim)  # views: the plan gives each final output its own copy
        return dict(zip(target_patterns, pieces))

    @property
    def reverse_op(self) -> Concatenate:
        return Concatenate(self.dim)


class Concatenate(_tcml.Concatenate):
    """Concatenate the source tensors, in ``source_patterns`` order, along ``dim`` into the single target.

    Input: ``{source_i: Tensor[..., n_i, ...]}``; output: ``{target: Tensor[..., sum(n_i), ...]}``. The reverse is a
    :class:`Chunk` whose sizes are taken from the shapes recorded when the checkpoint was loaded (or from the vanilla
    model for a model that was never loaded), so unequal pieces (GQA) round-trip exactly.
    """

    def __init__(self, dim: int = 0):
        super().__init__(dim=dim)

    def __repr__(self):
        return f"Concatenate(dim={self.dim})"

    @property
    def reverse_op(self) -> Chunk:
        return Chunk(self.dim)


class MergeModulelist(_tcml.MergeModulelist):
    """Stack a list of per-module tensors (e.g. one per expert, in index order) along ``dim``.

    Input: ``{source: [Tensor[*s]] * E}``; output: one ``Tensor`` with ``E`` inserted at ``dim``.
    Inverse: :class:`SplitModulelist`.
    """

    def __repr__(self):
        return f"MergeModulelist(dim={self.dim})"

    @property
    def reverse_op(self) -> SplitModulelist:
        return SplitModulelist(self.dim)


class SplitModulelist(_tcml.SplitModulelist):
    """Unstack a tensor along ``dim`` into one tensor per module; ``*`` in the target pattern becomes the index.

    Input: ``{source: Tensor}`` with ``E = shape[dim]``; output: ``{pattern.replace('*', str(e)): Tensor}``.
    Inverse: :class:`MergeModulelist`.
    """

    def __repr__(self):
        return f"SplitModulelist(dim={self.dim})"

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):  # type: ignore[override]
        # Views: the plan copies each final output into its own storage (safetensors refuses tensors sharing memory,
        # and a per-module parameter must not keep the whole stacked tensor alive).
        with torch.no_grad():
            return super().convert(input_dict, source_patterns, target_patterns, **kwargs)  # type: ignore[call-arg]

    @property
    def reverse_op(self) -> MergeModulelist:
        return MergeModulelist(self.dim)


class Transpose(_tcml.Transpose):
    """Swap dimensions ``dim0`` and ``dim1`` (result made contiguous). Its own inverse (with dims swapped).

    Never guesses from shapes: Transformers' ``check_dims`` mode is not exposed.
    """

    def __init__(self, dim0: int = 0, dim1: int = 1):
        super().__init__(dim0=dim0, dim1=dim1, check_dims=False)

    def __repr__(self):
        return f"Transpose(dim0={self.dim0}, dim1={self.dim1})"

    @property
    def reverse_op(self) -> Transpose:
        return Transpose(self.dim1, self.dim0)


def _tensors(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, list) else [value]


class Deinterleave(_tcml.ConversionOps):
    """Split one tensor along ``dim`` (>= 0) into one piece per target pattern by stride: with ``n`` targets, piece
    ``i`` holds the indices ``i, i + n, i + 2n, ...`` (gpt-oss stores gate and up columns alternately: gate ``0::2``,
    up ``1::2``).

    Input: ``{source: Tensor[..., n * m, ...]}``; output: ``{target_i: Tensor[..., m, ...]}`` (strided views; the plan
    copies each final output into its own storage). Inverse: :class:`Interleave`.

    Raises:
        ConversionError: the size along ``dim`` is not a multiple of the number of targets.
    """

    def __init__(self, dim: int = 0):
        if operator.index(dim) < 0:
            raise ModelpatchValueError(f"Deinterleave(dim={dim}): dim must be >= 0")
        self.dim = dim

    def __repr__(self):
        return f"Deinterleave(dim={self.dim})"

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, **kwargs):
        tensor = _single_tensor(input_dict, repr(self))
        n, size = len(target_patterns), tensor.shape[self.dim]
        if size % n:
            raise ConversionError(f"{self!r}: cannot split {size} into {n} interleaved pieces ({full_layer_name})")
        pieces = tensor.unflatten(self.dim, (size // n, n)).unbind(self.dim + 1)
        return dict(zip(target_patterns, pieces))

    @property
    def reverse_op(self) -> Interleave:
        return Interleave(self.dim)


class Interleave(_tcml.ConversionOps):
    """Merge the source tensors (in ``source_patterns`` order, all of one shape) along ``dim`` (>= 0) alternately:
    index ``j * n + i`` of the result is index ``j`` of source ``i``. Inverse: :class:`Deinterleave`.

    Input: ``{source_i: Tensor[..., m, ...]}``; output: ``{target: Tensor[..., n * m, ...]}``.

    Raises:
        ConversionError: the sources do not all have one shape.
    """

    def __init__(self, dim: int = 0):
        if operator.index(dim) < 0:
            raise ModelpatchValueError(f"Interleave(dim={dim}): dim must be >= 0")
        self.dim = dim

    def __repr__(self):
        return f"Interleave(dim={self.dim})"

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, **kwargs):
        tensors = [t for p in source_patterns if p in input_dict for t in _tensors(input_dict.pop(p))]
        if len({tuple(t.shape) for t in tensors}) != 1:
            shapes = [tuple(t.shape) for t in tensors]
            raise ConversionError(f"{self!r}: the pieces of '{full_layer_name}' differ in shape: {shapes}")
        return {target_patterns[0]: torch.stack(tensors, dim=self.dim + 1).flatten(self.dim, self.dim + 1)}

    @property
    def reverse_op(self) -> Deinterleave:
        return Deinterleave(self.dim)


class SwapDims(_tcml.ConversionOps):
    """Swap dimensions ``dim0`` and ``dim1`` of every tensor of the input, names unchanged (a step inside a chain,
    e.g. transposed fused experts ``(E, in, out)`` -> ``(E, out, in)`` before they are split into ``nn.Linear``
    weights). Its own inverse (with the dims swapped back).

    Input and output: ``{pattern: Tensor or [Tensor]}``, each tensor transposed (a view).
    """

    def __init__(self, dim0: int = 0, dim1: int = 1):
        self.dim0, self.dim1 = dim0, dim1

    def __repr__(self):
        return f"SwapDims(dim0={self.dim0}, dim1={self.dim1})"

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        out = {}
        for key, value in input_dict.items():
            swapped = [t.transpose(self.dim0, self.dim1) for t in _tensors(value)]
            out[key] = swapped if isinstance(value, list) else swapped[0]
        return out

    @property
    def reverse_op(self) -> SwapDims:
        return SwapDims(self.dim1, self.dim0)


_FROM_TRANSFORMERS: Mapping[type, type] = {
    _tcml.Concatenate: Concatenate,
    _tcml.MergeModulelist: MergeModulelist,
    _tcml.SplitModulelist: SplitModulelist,
}


def _instance_example(cls: type) -> str:
    """How an instance of operation class ``cls`` is written: ``Concatenate(dim=0)``, ``Foo()``, ``Bar(...)``."""
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return f"{cls.__name__}(...)"
    if any(p.name == "dim" for p in parameters):
        return f"{cls.__name__}(dim=0)"
    required = [p for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return f"{cls.__name__}({'...' if required else ''})"


def check_operation(op: object) -> None:
    """Refuse what is not a conversion operation *instance*, naming the fix.

    Raises:
        TypeError: ``op`` is a class (``Concatenate`` instead of ``Concatenate(dim=0)``), or not a Transformers
            ``ConversionOps`` at all.
    """
    if isinstance(op, type):
        example = _instance_example(op)
        raise ModelpatchTypeError(
            f"operation {op.__module__}.{op.__qualname__} is a class, not an instance: write "
            f"operations=[{example}] instead of operations=[{op.__name__}]"
        )
    if not isinstance(op, _tcml.ConversionOps):
        raise ModelpatchTypeError(
            f"operation {op!r} ({type(op).__name__}) is not a conversion operation: expected an instance of a "
            "ConversionOps class such as Concatenate(dim=0), Chunk(dim=0), MergeModulelist(dim=0)"
        )


def as_modelpatch_op(op: _tcml.ConversionOps) -> _tcml.ConversionOps:
    """Return the modelpatch equivalent of a Transformers operation (exact inverse), or ``op`` itself if none exists.

    Raises:
        TypeError: ``op`` is an operation class instead of an instance, or not an operation (see
            :func:`check_operation`).
    """
    check_operation(op)
    if isinstance(
        op, (Chunk, Concatenate, Deinterleave, Interleave, MergeModulelist, SplitModulelist, SwapDims, Transpose)
    ):
        return op
    if type(op) is _tcml.Chunk and getattr(op, "num_shards_attribute", None) is None:
        return Chunk(op.dim)
    if type(op) is _tcml.Transpose and not op.check_dims:
        return Transpose(op.dim0, op.dim1)
    if type(op) in _FROM_TRANSFORMERS and getattr(op, "num_shards_attribute", None) is None:
        return _FROM_TRANSFORMERS[type(op)](op.dim)  # type: ignore[attr-defined]  # every class of the table has dim
    return op
