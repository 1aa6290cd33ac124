"""Adapters for the libraries modelpatch works beside: each wraps one library's functions, installed by
:func:`modelpatch.apply.transformers.install` right after the module it wraps is imported
(:class:`modelpatch.lazy_imports.PostImportHook`), never importing it itself.

``peft``             PEFT on patched models: only the built-in conversion rules a patched model's layout has reach
                     PEFT's adapter conversion (per-expert LoRA targets and weights kept), and PEFT's LoRA layers are
                     seen through when a patched base model is saved; wrappers on PEFT's lazily imported
                     ``peft.utils.transformers_weight_conversion``, installed when it is imported
``kernels``          hub kernels (``kernels.kernelize``, Transformers' ``use_kernels``) never silently replace a patched
                     forward: after ``set_use_kernels`` the patch or the kernel wins by rule, recorded for the report
``loaders``          the checkpoint loaders of other libraries on patched models (Transformers'
                     ``load_sharded_checkpoint``, accelerate's ``load_checkpoint_in_model``, ``safetensors.torch.
                     load_model``): the original layout loads exactly, or is refused before anything is written
``tensor_parallel``  a ``tp_plan`` on patched models: the plan's entries of replaced modules swapped for the
                     replacements' own, a plan that cannot be exact refused
``trainer``          ``transformers.Trainer``'s ``optimizer.pt`` in the original layout for patched models, converted on
                     resume (wrappers of ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``,
                     installed when ``transformers.trainer`` is imported)
``trl``              :class:`~.trl.RoutingReplayGRPOTrainer`, GRPO with MoE routing replay (``pip install
                     "modelpatch[trl]"``; imported only when used)

May import: errors, versions, undo, lazy_imports, patching, outputs, conversion, routing. May not import: apply (which
installs these adapters), recipes, cli, or :mod:`modelpatch` itself.
"""
