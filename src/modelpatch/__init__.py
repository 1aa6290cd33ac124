"""modelpatch: change the structure of 🤗 Transformers models without editing modeling code.

Swap module classes while a model is built (exact class name or regex keys), see what changed, and keep
output capture working on replacement classes. Importing modelpatch installs thin wrappers on
``PreTrainedModel`` (see :mod:`modelpatch.integration`) so the registry applies to every
``from_pretrained``/``from_config`` build; nothing else in the process is changed.
"""

from .conflicts import Conflict
from .integration import install as _install
from .recorders import OutputRecorder, patch_output_recorders, register_output_recorder, unregister_output_recorder
from .registry import (
    clear_patch_mapping,
    get_patch_mapping,
    is_strict_patching,
    register_patch_mapping,
    set_strict_patching,
    unregister_patch_mapping,
)
from .report import PatchReport, PatchRow, patch_report
from .scope import PatchScope, UnmatchedPatchKeyError, apply_patches

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
    "PatchScope",
    "UnmatchedPatchKeyError",
    "patch_output_recorders",
    "register_output_recorder",
    "unregister_output_recorder",
    "OutputRecorder",
    "patch_report",
    "PatchReport",
    "PatchRow",
    "Conflict",
]
