"""Checkpoint weight conversion for patched models (SPEC section 3).

Rules (:class:`WeightConverter`, :class:`WeightRenaming`) and operations map checkpoint tensors onto a patched
model's parameter layout on load, and back to the original layout on save. Modules, one concern each:

``ops``       operations with exact inverses          ``rules``     rules with module-path-boundary matching
``registry``  global and scoped rule registry         ``compose``   per-model resolution, built-in composition
``engine``    grouping, meta dry run, lazy conversion ``loading``   ``from_pretrained`` integration
``saving``    ``save_pretrained`` reverse             ``hooks``     the only wrappers of Transformers functions
``manual``    :func:`load_converted_state_dict`       ``offline``   :func:`convert_checkpoint`
``io``        lazy safetensors checkpoint access         ``state``     per-model conversion state
``report``    :func:`conversion_report`               ``reference`` shapes used to split fused tensors exactly
"""

from .plan import ConversionRow
from .errors import ConversionError, ConversionShapeError
from .manual import load_converted_state_dict
from .offline import convert_checkpoint
from .ops import Chunk, Concatenate, MergeModulelist, SplitModulelist, Transpose
from .registry import (
    clear_checkpoint_conversion_mappings,
    apply_conversion_rules,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
    unregister_checkpoint_conversion_mapping,
)
from .report import conversion_report
from .rules import WeightConverter, WeightRenaming
from .saving import bind_conversion_rules

__all__ = [
    "Chunk",
    "Concatenate",
    "ConversionError",
    "ConversionRow",
    "ConversionShapeError",
    "MergeModulelist",
    "SplitModulelist",
    "Transpose",
    "WeightConverter",
    "WeightRenaming",
    "bind_conversion_rules",
    "clear_checkpoint_conversion_mappings",
    "conversion_report",
    "apply_conversion_rules",
    "convert_checkpoint",
    "get_checkpoint_conversion_mapping",
    "load_converted_state_dict",
    "register_checkpoint_conversion_mapping",
    "unregister_checkpoint_conversion_mapping",
]
