"""Integrations with the libraries modelpatch works inside.

``transformers``  the wrappers on ``PreTrainedModel`` (``from_pretrained``, ``_from_config``, ``__init__``,
                  ``post_init``) and the output-recorder registry extension, with ``install()`` / ``uninstall()``;
                  :mod:`modelpatch` installs them on import
``trl``           :class:`~.trl.RoutingReplayGRPOTrainer`, GRPO with MoE routing replay (``pip install
                  "modelpatch[trl]"``; imported only when used)
"""
