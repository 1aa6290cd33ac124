"""Output capture on patched models: Transformers' ``output_<name>=True`` keeps working on replacement classes, and
new outputs can be added.

``recorders``     user-defined recorders (:func:`register_output_recorder`), their hooks and the relay through task heads
``replacements``  recorders that follow replacement classes (:func:`patch_output_recorders`) and the extension of
                  Transformers' recorder registry that merges both in

May import: errors, undo, lazy_imports, patching. May not import: conversion, routing, integrations, apply, recipes,
cli, or :mod:`modelpatch` itself.
"""

from transformers.utils.output_capturing import OutputRecorder

from .recorders import register_output_recorder, unregister_output_recorder
from .replacements import install_registry_extension, patch_output_recorders

__all__ = [
    "OutputRecorder",
    "install_registry_extension",
    "patch_output_recorders",
    "register_output_recorder",
    "unregister_output_recorder",
]
