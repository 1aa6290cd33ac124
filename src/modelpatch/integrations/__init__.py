"""Integrations with the libraries modelpatch works inside (each installed right after the module it wraps is
imported: :class:`modelpatch.lazy_imports.PostImportHook`).

``transformers``  the wrappers on ``PreTrainedModel`` (``from_pretrained``, ``_from_config``, ``__init__``,
                  ``post_init``) and the output-recorder registry extension, with ``install()`` / ``uninstall()``;
                  :mod:`modelpatch` installs them on import, together with ``peft``'s
``peft``          PEFT on patched models: only the built-in conversion rules a patched model's layout has reach
                  PEFT's adapter conversion (per-expert LoRA targets and weights kept), and PEFT's LoRA layers are
                  seen through when a patched base model is saved; wrappers on PEFT's lazily imported
                  ``peft.utils.transformers_weight_conversion``, installed when it is imported
``kernels``       hub kernels (``kernels.kernelize``, Transformers' ``use_kernels``) never silently replace a patched
                  forward: after ``set_use_kernels`` the patch or the kernel wins by rule, recorded for the report
``loaders``       the checkpoint loaders of other libraries on patched models (Transformers'
                  ``load_sharded_checkpoint``, accelerate's ``load_checkpoint_in_model``, ``safetensors.torch.
                  load_model``): the original layout loads exactly, or is refused before anything is written;
                  installed with ``transformers``'
``trainer``       ``transformers.Trainer``'s ``optimizer.pt`` in the original layout for patched models, converted on
                  resume (wrappers of ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``, installed
                  when ``transformers.trainer`` is imported)
``tensor_parallel``  ``from_pretrained(..., tp_plan=...)`` of patched models: each replacement's own plan
                  (``modelpatch_tp_plan``) replaces the original's entries, two parallel styles for fused QKV, and
                  the refusals (:class:`~.tensor_parallel.TensorParallelError`) of what cannot be split exactly
``trl``           :class:`~.trl.RoutingReplayGRPOTrainer`, GRPO with MoE routing replay (``pip install
                  "modelpatch[trl]"``; imported only when used)
"""
