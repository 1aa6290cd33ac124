"""Rules that only place their sources side by side, read straight into one output allocated once.

A rule whose operations are ``Concatenate`` (``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``), or
``MergeModulelist`` then ``Concatenate`` (per-expert ``gate_proj``/``up_proj`` -> a stacked ``gate_up_proj``), puts
every element of every source somewhere in a single output: each source is a block of rows of it. Instead of
materialising the sources and concatenating them (one more full-size tensor, and a second one when the loader then
casts the result to the parameter's dtype), :func:`fill` allocates the output once, in the dtype it will have in the
model, and copies each source into its block as the source is read, as vLLM's ``weight_loader`` writes each shard of
a checkpoint into its rows of the fused parameter (``param.data.narrow(dim, offset, size).copy_(loaded_weight)``).

The values are those of the generic path bit for bit: the same elements at the same places, and a cast made by
``copy_`` rounds exactly like ``Tensor.to`` (Transformers' cast on load). Sources of different dtypes (which
``torch.cat`` would promote) and any other operation take the generic path (:func:`placement` returns ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import core_model_loading as _tcml

from .errors import ConversionError

__all__ = ["Placement", "placement", "placed_shape", "fill"]

_CONCATENATE = _tcml.Concatenate.convert
_MERGE = _tcml.MergeModulelist.convert


@dataclass(frozen=True)
class Placement:
    """Where a placement-only rule puts its sources: concatenated along ``dim`` in source-pattern order, each
    pattern's list of modules first stacked along ``stack_dim`` (``None``: one tensor per pattern, no stacking)."""

    dim: int
    stack_dim: int | None


def placement(rule, patterns: int, modules: int) -> Placement | None:
    """The :class:`Placement` of ``rule`` for a group of ``patterns`` source patterns of ``modules`` tensors each, or
    ``None`` when its operations do more than place (transpose, split, ...) or the group is not the one-output,
    one-tensor-per-pattern (``Concatenate``) or stacked (``MergeModulelist``, ``Concatenate``) shape handled here.
    Operations are recognised by their ``convert`` (Transformers' ``Concatenate``/``MergeModulelist`` and
    modelpatch's subclasses; a subclass that overrides ``convert`` is not a placement)."""
    if not isinstance(rule, _tcml.WeightConverter) or len(rule.target_patterns) != 1:
        return None
    operations: list = list(rule.operations)
    kinds = [type(op).convert for op in operations]
    if kinds == [_CONCATENATE] and modules == 1:
        return Placement(operations[0].dim, None)
    if kinds == [_MERGE, _CONCATENATE] and patterns > 1:
        return Placement(operations[1].dim, operations[0].dim)
    return None


def placed_shape(where: Placement, shapes: list[list[tuple[int, ...]]]) -> tuple[int, ...] | None:
    """The output shape of a placement for sources of ``shapes`` (per source pattern, one per module), computed
    without running the operations; ``None`` where the shapes do not fit together (the operations, run on meta
    tensors, then raise their own error)."""
    blocks = []
    for module_shapes in shapes:
        first = module_shapes[0]
        if any(shape != first for shape in module_shapes) or not first:
            return None
        block = list(first)
        if where.stack_dim is not None:
            if not -len(block) - 1 <= where.stack_dim <= len(block):
                return None
            block.insert(where.stack_dim % (len(block) + 1), len(module_shapes))
        blocks.append(block)
    ndim = len(blocks[0])
    if not -ndim <= where.dim < ndim or any(len(block) != ndim for block in blocks):
        return None
    dim = where.dim % ndim
    if any(block[:dim] + block[dim + 1 :] != blocks[0][:dim] + blocks[0][dim + 1 :] for block in blocks):
        return None
    return tuple(blocks[0][:dim] + [sum(block[dim] for block in blocks)] + blocks[0][dim + 1 :])


def fill(where: Placement, sources: list[list], shape, dtype: torch.dtype, read) -> tuple[torch.Tensor, list]:
    """Allocate the output (``shape``, ``dtype``, CPU) and copy each source into its block as it is read.

    Args:
        where: the rule's :class:`Placement`.
        sources: per source pattern, in the rule's order, its tensor-likes (one, or one per module in index order).
        shape: the output shape (the meta dry run's).
        dtype: the output dtype: the sources' own, or the dtype the loader casts the output to (each source is
            cast while it is copied, rounding exactly like ``Tensor.to``).
        read: ``tensor_like -> Tensor`` (a safetensors slice is read as a view of the file map: one copy in all).

    Returns:
        ``(output, tensors read)``, the latter so that their pages can be given back (:mod:`.pages`).

    Raises:
        ConversionError: a source does not fit its block (which the dry run rules out for checkpoint tensors).
    """
    out = torch.empty(shape, dtype=dtype)
    read_tensors: list = []
    offset = 0
    with torch.no_grad():
        for objs in sources:
            first = read(objs[0])
            if where.stack_dim is None:
                size = first.shape[where.dim]
            else:
                stacked = list(first.shape)
                stacked.insert(where.stack_dim % out.dim(), len(objs))
                size = stacked[where.dim % out.dim()]
            if offset + size > out.shape[where.dim]:
                raise ConversionError(f"sources overflow the {out.shape[where.dim]} places along dim {where.dim}")
            block = out.narrow(where.dim, offset, size)
            for index, obj in enumerate(objs):
                tensor = first if index == 0 else read(obj)
                _copy(block if where.stack_dim is None else block.select(where.stack_dim, index), tensor)
                read_tensors.append(tensor)
            offset += size
    if offset != out.shape[where.dim]:
        raise ConversionError(f"sources fill {offset} of the {out.shape[where.dim]} places along dim {where.dim}")
    return out, read_tensors


def _copy(block: torch.Tensor, tensor: torch.Tensor) -> None:
    if block.shape != tensor.shape:  # copy_ would broadcast
        raise ConversionError(f"a source of shape {tuple(tensor.shape)} does not fit its block {tuple(block.shape)}")
    block.copy_(tensor)
