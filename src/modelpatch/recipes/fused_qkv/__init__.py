"""Fused QKV attention: one ``qkv_proj`` instead of ``q_proj`` / ``k_proj`` / ``v_proj``, with the conversion rule
that concatenates the checkpoint's three projections on load and splits them back on save.

``decoder``  the decoder families (llama, mistral, qwen2, qwen2_moe, qwen3): one :class:`AttentionFamily` row per
             family, the replacement class ``FusedQKV<Family>Attention`` and the recipe ``<model_type>-fused-qkv``
             derived from it
``bert``     BERT's self-attention (``bert-fused-qkv``): a template for a new kind of recipe

May import: errors, undo, patching, conversion, integrations, apply, and :mod:`modelpatch.recipes.base`. May not
import: cli, or :mod:`modelpatch` itself.
"""

from typing import Any

from . import decoder
from .bert import BERT_FUSED_QKV, FusedQKVBertSelfAttention
from .decoder import FAMILIES, FUSED_QKV_CLASSES, AttentionFamily, FusedQKVAttention, fused_qkv_recipe

__all__ = [
    "AttentionFamily",
    "BERT_FUSED_QKV",
    "FAMILIES",
    "FUSED_QKV_CLASSES",
    "FusedQKVAttention",
    "FusedQKVBertSelfAttention",
    "fused_qkv_recipe",
]


def __getattr__(name: str) -> Any:
    """The per-family classes (``FusedQKVLlamaAttention``, ...), defined by :mod:`.decoder` from ``FAMILIES``."""
    if name.startswith("FusedQKV") and hasattr(decoder, name):
        return getattr(decoder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
