"""Class replacement while Transformers builds a model: the patch mapping and where it is in force.

Modules, bottom to top (each imports only those above it in this list, and nothing of
:mod:`modelpatch.conversion`, :mod:`modelpatch.routing` or :mod:`modelpatch.outputs`):

``catalog``       which classes may be replaced (``nn.Module`` classes of Transformers' modeling modules)
``registry``      validated patch mappings, key resolution, the process-wide registry
``upstream``      what Transformers itself replaces while it builds a model (the fusions of ``fusion_config``)
``interception``  the reference-counted ``__init__`` hook through which an original builds its replacement
``provenance``    what modelpatch remembers on the instances it builds (provenance, build record)
``keys``          which classes a mapping replaces, and the hints for keys that replace nothing
``conflicts``     container/inner conflicts (a pattern replacing ``BertAttention`` and ``BertSelfAttention``)
``scopes``        :class:`PatchScope`: one activation of a mapping, per thread / asyncio task
``report``        :func:`patch_report`, read from the model itself
"""

from .provenance import replacement_of
from .registry import (
    clear_patch_mapping,
    get_patch_mapping,
    is_strict_patching,
    register_patch_mapping,
    set_strict_patching,
    unregister_patch_mapping,
)
from .report import PatchReport, PatchRow, patch_report
from .scopes import PatchScope, UnmatchedPatchKeyError
from .upstream import FusionConflictError, UpstreamFusion, upstream_fusions

__all__ = [
    "FusionConflictError",
    "UpstreamFusion",
    "upstream_fusions",
    "PatchReport",
    "PatchRow",
    "PatchScope",
    "UnmatchedPatchKeyError",
    "clear_patch_mapping",
    "get_patch_mapping",
    "is_strict_patching",
    "patch_report",
    "register_patch_mapping",
    "replacement_of",
    "set_strict_patching",
    "unregister_patch_mapping",
]
