"""modelpatch: change the structure of 🤗 Transformers models without editing modeling code.

Swap module classes while a model is built (exact class name or regex keys) or in a model already built
(:func:`patch_model`, revertible), convert checkpoint weights to the new layout on load and back on save (or hand
them out in the original layout one conversion group at a time, :func:`iter_original_state_dict`, for weight sync to
an inference engine; optimizer state too, :func:`original_optimizer_state_dict`, so a run resumes across layouts), see
what changed, keep output capture working on
replacement classes, and record/replay MoE routing (:mod:`modelpatch.routing`). Importing modelpatch installs thin wrappers on
``PreTrainedModel`` (see :mod:`modelpatch.apply.transformers`) so the registry applies to every
``from_pretrained``/``from_config`` build, and, once ``transformers.trainer`` is imported, on the two ``Trainer``
methods that save and load ``optimizer.pt`` (:mod:`modelpatch.integrations.trainer`); nothing else in the process is
changed.
"""

from typing import Any

import transformers as _transformers

from .apply.blocks import apply_patches
from .apply.model_patch import InstancePatchError, InstancePatchRow, ModelPatch, OptimizerGroupError, patch_model
from .apply.transformers import install as _install
from .conversion import (
    Chunk,
    Concatenate,
    ConversionError,
    ConversionRow,
    ConversionShapeError,
    MergeModulelist,
    OptimizerStateError,
    QuantizedSaveError,
    SplitModulelist,
    StateDictLayoutError,
    Transpose,
    WeightConverter,
    WeightRenaming,
    allow_init_values,
    apply_conversion_rules,
    bind_conversion_rules,
    clear_checkpoint_conversion_mappings,
    conversion_report,
    convert_checkpoint,
    get_checkpoint_conversion_mapping,
    iter_original_state_dict,
    load_converted_state_dict,
    load_original_optimizer_state_dict,
    optimizer_state_dict_in_model_layout,
    original_optimizer_state_dict,
    register_checkpoint_conversion_mapping,
    unregister_checkpoint_conversion_mapping,
)
from .errors import ModelpatchError
from .outputs import OutputRecorder, patch_output_recorders, register_output_recorder, unregister_output_recorder
from .patching.conflicts import Conflict
from .patching.provenance import Replacement, replacement_of
from .patching.registry import (
    clear_patch_mapping,
    get_patch_mapping,
    is_strict_patching,
    register_patch_mapping,
    set_strict_patching,
    unregister_patch_mapping,
)
from .patching.report import PatchReport, PatchRow, patch_report
from .patching.scopes import PatchScope, UnmatchedPatchKeyError
from .patching.upstream import FusionConflictError
from .versions import check_transformers_release as _check_transformers_release

_check_transformers_release(_transformers.__version__)  # one warning outside the tested range (strict: an error)
_install()

__version__ = "0.1.0"

__all__ = [
    "register_patch_mapping",
    "unregister_patch_mapping",
    "clear_patch_mapping",
    "get_patch_mapping",
    "set_strict_patching",
    "is_strict_patching",
    "apply_patches",
    "patch_model",
    "ModelPatch",
    "InstancePatchRow",
    "InstancePatchError",
    "OptimizerGroupError",
    "replacement_of",
    "Replacement",
    "ModelpatchError",
    "PatchScope",
    "UnmatchedPatchKeyError",
    "FusionConflictError",
    "patch_output_recorders",
    "register_output_recorder",
    "unregister_output_recorder",
    "OutputRecorder",
    "patch_report",
    "PatchReport",
    "PatchRow",
    "Conflict",
    # checkpoint weight conversion
    "WeightConverter",
    "WeightRenaming",
    "Chunk",
    "Concatenate",
    "MergeModulelist",
    "SplitModulelist",
    "StateDictLayoutError",
    "Transpose",
    "ConversionError",
    "ConversionShapeError",
    "QuantizedSaveError",
    "ConversionRow",
    "register_checkpoint_conversion_mapping",
    "get_checkpoint_conversion_mapping",
    "unregister_checkpoint_conversion_mapping",
    "clear_checkpoint_conversion_mappings",
    "apply_conversion_rules",
    "allow_init_values",
    "conversion_report",
    "load_converted_state_dict",
    "convert_checkpoint",
    "bind_conversion_rules",
    "iter_original_state_dict",
    # optimizer state across layouts (resume a run with or without a recipe)
    "original_optimizer_state_dict",
    "load_original_optimizer_state_dict",
    "optimizer_state_dict_in_model_layout",
    "OptimizerStateError",
    # quantisation
    "calibrate_all_experts",
]


def __getattr__(name: str) -> Any:
    """Names imported on first use (PEP 562), so ``import modelpatch`` does not import the recipes."""
    if name == "calibrate_all_experts":
        from .recipes.linear_experts.calibration import calibrate_all_experts

        return calibrate_all_experts
    raise AttributeError(f"module 'modelpatch' has no attribute {name!r}")
