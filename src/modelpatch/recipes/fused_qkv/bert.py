"""Fused QKV BERT self-attention: one ``qkv`` projection instead of ``query``/``key``/``value``.

``qkv.weight`` has shape ``(3 * hidden_size, hidden_size)`` (query rows, key rows, value rows) and ``qkv.bias``
``(3 * hidden_size,)``. Only ``BertSelfAttention`` is replaced (exact class name): the container ``BertAttention``
and ``BertCrossAttention`` keep their classes: a pattern such as ``.*Attention`` would also replace the container,
whose replacement never builds the inner classes (see :mod:`modelpatch.patching.conflicts`).

Conversion rule (``bert``): ``attention.self.{query,key,value}`` → ``attention.self.qkv`` with
``Concatenate(dim=0)``; the reverse splits with the recorded sizes, so the saved checkpoint is the original.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import ClassVar

import torch.nn as nn

from ...conversion import Concatenate, WeightConverter
from ...errors import ModelpatchValueError
from ..base import Recipe, RuleSpec

__all__ = ["FusedQKVBertSelfAttention", "bert_fused_qkv_rules", "BERT_FUSED_QKV"]


class FusedQKVBertSelfAttention(nn.Module):
    """Replacement of ``BertSelfAttention`` with the same constructor ``(config, is_causal=False, layer_idx=None)``
    and forward ``(hidden_states (B, T, H), attention_mask, past_key_values, **kwargs) -> (context (B, T, H),
    attn_weights | None)``; the KV cache (a decoder BERT) is taken as ``past_key_values`` (Transformers 5.23) or as
    ``cache`` (5.24 and later)."""

    modeling: ClassVar[ModuleType]
    """``transformers.models.bert.modeling_bert``, set on the class by its first ``__init__`` (not imported with
    modelpatch: it imports ``transformers.modeling_utils``, seconds and torchao's log lines). ``forward`` reads
    ``eager_attention_forward``, ``ALL_ATTENTION_FUNCTIONS`` and ``EncoderDecoderCache`` from it, without an import
    per call, which ``torch.compile`` cannot trace."""

    def __init__(self, config, is_causal: bool = False, layer_idx: int | None = None):
        super().__init__()
        if "modeling" not in FusedQKVBertSelfAttention.__dict__:  # subclasses (FSDP2's) inherit it
            FusedQKVBertSelfAttention.modeling = importlib.import_module("transformers.models.bert.modeling_bert")
        if config.hidden_size % config.num_attention_heads != 0:
            raise ModelpatchValueError(
                f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention heads "
                f"({config.num_attention_heads})"
            )
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = self.attention_head_size**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.is_decoder = config.is_decoder
        self.is_causal = is_causal
        self.layer_idx = layer_idx

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        module = self.modeling
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        query, key, value = (t.view(hidden_shape).transpose(1, 2) for t in self.qkv(hidden_states).chunk(3, dim=-1))
        # Transformers >= 5.24 passes the KV cache as ``cache`` and hands the call's kwargs to its update
        given = kwargs.pop("cache", None)
        update_kwargs = {"kwargs": kwargs} if given is not None else {}
        given = past_key_values if given is None else given
        if given is not None:
            cache = given.self_attention_cache if isinstance(given, module.EncoderDecoderCache) else given
            key, value = cache.update(key, value, self.layer_idx, **update_kwargs)  # set when a cache is used
        attention = module.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, module.eager_attention_forward
        )
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout.p,
            scaling=self.scaling,
            **kwargs,
        )
        return output.reshape(*input_shape, -1).contiguous(), weights


def bert_fused_qkv_rules() -> list:
    """``attention.self.{query,key,value}.{weight,bias}`` → ``attention.self.qkv.*`` by ``Concatenate(dim=0)``."""
    return [
        WeightConverter(
            ["attention.self.query", "attention.self.key", "attention.self.value"],
            ["attention.self.qkv"],
            [Concatenate(dim=0)],
        )
    ]


BERT_FUSED_QKV = Recipe(
    name="bert-fused-qkv",
    description="BertSelfAttention -> one qkv projection (exact class name: containers untouched)",
    patch_mapping={"BertSelfAttention": FusedQKVBertSelfAttention},
    conversion={"bert": RuleSpec(bert_fused_qkv_rules)},
    model_types=("bert",),
)
