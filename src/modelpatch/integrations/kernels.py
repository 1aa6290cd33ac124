"""Hub kernels (the ``kernels`` library) and patched modules: the replacement's forward is never silently lost.

Transformers marks layers that a kernel from the Hugging Face Hub may replace: ``@use_kernel_forward_from_hub("RMSNorm")``
sets ``kernel_layer_name`` on the class (``LlamaRMSNorm``, ...). With ``use_kernels`` on (5.25's default when
``kernels`` is installed and ``USE_HUB_KERNELS`` is not ``NO``; opt-in before), ``from_pretrained`` and every later
``model.train()`` / ``model.eval()`` call ``PreTrainedModel.set_use_kernels``, which runs ``kernels.kernelize``: for
each module whose class carries a ``kernel_layer_name`` and a kernel for the device and mode, it assigns the
kernel's forward to the instance (``module.forward = kernel.forward``). A replacement that subclasses such a class
inherits the name, so its own forward (the point of the patch) would be replaced by a kernel written for the
original class's forward, silently.

:func:`settle_kernels` runs after every ``set_use_kernels`` (the wrapper is installed by
:func:`modelpatch.apply.transformers.install`): on each module modelpatch replaced that a kernel just
replaced,

* the **patch wins** when the replacement defines its own ``forward`` and no ``kernel_layer_name`` of its own: the
  kernel's forward is removed from the instance (the replacement's forward runs), and a warning names the modules;
* the **kernel wins** when the replacement keeps the original's ``forward`` (the kernel was written for it), or
  declares ``kernel_layer_name`` itself (it asks for kernels).

Either way the decision is recorded on the module (:class:`~modelpatch.patching.provenance.KernelDecision`) and
:func:`~modelpatch.patch_report` shows it on the module's row; a kernel applied outside Transformers
(``kernels.kernelize(model)`` called directly) shows there too, read from the module itself.
"""

from __future__ import annotations

import functools

import torch.nn as nn
from transformers.utils import logging

from ..patching.provenance import KernelDecision, hub_kernel_forward, provenance, set_kernel_decision

__all__ = ["settle_kernels", "set_use_kernels_wrapper"]

logger = logging.get_logger("modelpatch")


def _replacement_keeps_forward(module: nn.Module, original: type) -> bool:
    return getattr(type(module), "forward", None) is getattr(original, "forward", None)


def settle_kernels(model: nn.Module) -> list[tuple[str, KernelDecision]]:
    """Decide, for each replaced module of ``model`` that a hub kernel replaced, which forward runs (see the module
    docstring); undo the kernel where the patch wins.

    Returns:
        ``[(module path, decision)]`` for the modules a kernel met in this call.
    """
    decided: list[tuple[str, KernelDecision]] = []
    for path, module in model.named_modules():
        found = provenance(module)
        if found is None or hub_kernel_forward(module) is None:
            continue
        layer = str(getattr(type(module), "kernel_layer_name", "?"))
        repo = vars(module).get("_kernel_repo")
        repo_name = str(repo) if repo is not None else "unknown repository"
        asks_for_kernels = "kernel_layer_name" in vars(type(module))
        if _replacement_keeps_forward(module, found.original) or asks_for_kernels:
            decision = KernelDecision(layer, repo_name, "kernel")
        else:
            del module.__dict__["forward"]
            module.__dict__.pop("_kernel_repo", None)
            decision = KernelDecision(layer, repo_name, "patch")
        set_kernel_decision(module, decision)
        decided.append((path or "<root>", decision))
    kept = [path for path, decision in decided if decision.winner == "patch"]
    if kept:
        first = next(decision for _, decision in decided if decision.winner == "patch")
        logger.warning(
            f"modelpatch: hub kernel {first.layer!r} ({first.repo}) not applied to {len(kept)} replaced module(s) "
            f"({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}): their replacement defines its own forward, "
            "which runs. Set kernel_layer_name on the replacement class to let hub kernels replace it; "
            "patch_report(model) lists the decision per module."
        )
    return decided


def set_use_kernels_wrapper(original):
    """``PreTrainedModel.set_use_kernels`` followed by :func:`settle_kernels` (installed by
    :func:`modelpatch.apply.transformers.install`)."""

    @functools.wraps(original)
    def set_use_kernels(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        settle_kernels(self)
        return result

    return set_use_kernels
