"""Where patching and conversion meet a model: the layer that applies them to a build, a load, a save or a model
already built.

``blocks``         :func:`apply_patches`: a patch mapping and conversion rules in force for one ``with`` block
``model_patch``    :func:`patch_model` / :class:`ModelPatch`: swap modules of a model already built, revert, optimizers
``swap``           the swap of one module by ``patch_model``: refusals, targets, constructor arguments, validation on
                   ``meta``, the hand-over of tensors
``transformers``   every wrapper modelpatch installs on Transformers (``PreTrainedModel``'s build, ``post_init``, save
                   and kernel methods; ``transformers.modeling_utils``' load / ZeRO-3 load / revert functions) and the
                   installation of the optional adapters of :mod:`modelpatch.integrations`, all behind one
                   :class:`~modelpatch.undo.UndoStack`

May import: errors, versions, undo, lazy_imports, patching, conversion, outputs, routing, integrations. May not import:
recipes, cli, or :mod:`modelpatch` itself.
"""

from .blocks import apply_patches
from .model_patch import InstancePatchError, InstancePatchRow, ModelPatch, patch_model

__all__ = ["apply_patches", "patch_model", "ModelPatch", "InstancePatchRow", "InstancePatchError"]
