"""Checkpoint weight conversion for patched models.

Rules (:class:`WeightConverter`, :class:`WeightRenaming`) and operations map checkpoint tensors onto a patched
model's parameter layout on load, and back to the original layout on save. Modules, bottom to top (each imports only
modules above it in this list, and from outside the package only :mod:`modelpatch.errors` and :mod:`modelpatch.patching`):

``errors``    :class:`ConversionError`, :class:`ConversionShapeError`, :class:`NothingToConvertError`,
              :class:`OptimizerStateError`, :class:`StateDictLayoutError`
``ops``       operations with exact inverses (``Concatenate``, ``Chunk``, ``MergeModulelist``, ...)
``rules``     rules with module-path-boundary matching; Transformers' rule classes rebuilt as ours
``overlap``   which rules touch the same parameters; keys already in a rule's target layout
``registry``  global and scoped rule registry (:func:`apply_conversion_rules`)
``compose``   per-model resolution, composition with Transformers' built-in rules
``pages``     giving the pages of converted memory-mapped sources back to the kernel
``placement`` rules that only place their sources (``Concatenate``): read straight into one output allocated once
``plan``      grouping keys by rule, meta dry run, lazy conversion (:class:`ConversionRow`)
``reference`` shapes used to split fused tensors back exactly
``state``     per-model conversion state, kept on the model instance
``io``        lazy safetensors checkpoint access
``wrappers``  seeing through wrapper modules of other libraries (PEFT's LoRA layers) on save; views registered by
              :mod:`modelpatch.integrations`
``streaming`` the reverse to the original layout group by group (Transformers' built-in reverse, then the user rules)
``quantized`` quantized weights through conversion rules: components per quantizer, exact row splits, the save
              refusal (:class:`QuantizedSaveError`), pre-quantized loads of a converted layout
``loading``   the ``from_pretrained`` path             ``saving``    the ``save_pretrained`` reverse and
              :func:`iter_original_state_dict` (weight sync), one path
``unloaded``  replacement parameters the checkpoint did not provide (:func:`allow_init_values`)
``buffers``   replacement non-persistent buffers after ``from_pretrained``: the values their ``__init__`` computes
``report``    :func:`conversion_report`
``manual``    :func:`load_converted_state_dict`      ``offline``   :func:`convert_checkpoint`
``loaders``   which layout a state dict or a checkpoint's headers are in, for a model, and what loading them does
              (:class:`StateDictLayoutError` before any write): the logic of ``statedict`` and of the loader wrappers
              of :mod:`modelpatch.integrations.loaders`
``statedict`` ``model.load_state_dict`` in both layouts (hooks on every model that carries conversion state)
``optimizer`` optimizer state dicts in the original layout (:func:`original_optimizer_state_dict`) and back
              (:func:`load_original_optimizer_state_dict`): per-element state through the weights' rules
``transfer``  one module's tensors of a built model between layouts (what :func:`~modelpatch.patch_model` runs)
``zero3``     DeepSpeed ZeRO-3 loads: the checkpoint converted before Transformers' ZeRO-3 loader reads it, shapes
              of partitioned parameters (``ds_shape``), and the refusals for ungathered partitions
"""

from .errors import (
    ConversionError,
    ConversionShapeError,
    NothingToConvertError,
    OptimizerStateError,
    StateDictLayoutError,
)
from .manual import load_converted_state_dict
from .offline import convert_checkpoint
from .ops import Chunk, Concatenate, Deinterleave, Interleave, MergeModulelist, SplitModulelist, SwapDims, Transpose
from .optimizer import (
    load_original_optimizer_state_dict,
    optimizer_state_dict_in_model_layout,
    original_optimizer_state_dict,
)
from .plan import ConversionRow
from .quantized import QuantizedSaveError
from .registry import (
    apply_conversion_rules,
    clear_checkpoint_conversion_mappings,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
    unregister_checkpoint_conversion_mapping,
)
from .report import conversion_report
from .rules import Layout, LayoutWeightConverter, LayoutWeightRenaming, WeightConverter, WeightRenaming
from .saving import bind_conversion_rules, iter_original_state_dict
from .statedict import has_state_dict_hooks
from .streaming import OriginalLayoutIterator  # registers the state listener that installs the hooks
from .unloaded import allow_init_values

__all__ = [
    "allow_init_values",
    "Chunk",
    "Concatenate",
    "ConversionError",
    "ConversionRow",
    "ConversionShapeError",
    "Deinterleave",
    "Interleave",
    "Layout",
    "LayoutWeightConverter",
    "LayoutWeightRenaming",
    "MergeModulelist",
    "OptimizerStateError",
    "OriginalLayoutIterator",
    "QuantizedSaveError",
    "SplitModulelist",
    "StateDictLayoutError",
    "NothingToConvertError",
    "SwapDims",
    "Transpose",
    "WeightConverter",
    "WeightRenaming",
    "bind_conversion_rules",
    "clear_checkpoint_conversion_mappings",
    "conversion_report",
    "apply_conversion_rules",
    "convert_checkpoint",
    "get_checkpoint_conversion_mapping",
    "has_state_dict_hooks",
    "iter_original_state_dict",
    "load_converted_state_dict",
    "load_original_optimizer_state_dict",
    "optimizer_state_dict_in_model_layout",
    "original_optimizer_state_dict",
    "register_checkpoint_conversion_mapping",
    "unregister_checkpoint_conversion_mapping",
]
