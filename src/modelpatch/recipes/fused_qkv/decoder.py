"""Fused QKV self-attention for the llama family: one ``qkv_proj`` instead of ``q_proj``/``k_proj``/``v_proj``.

``qkv_proj.weight`` has shape ``((num_attention_heads + 2 * num_key_value_heads) * head_dim, hidden_size)``: the
query rows, then the key rows, then the value rows (grouped-query attention: fewer key/value rows). Everything else
follows the family's own attention class exactly:

=============  ==================  ==============  ===============  =============================================
family         q/k/v bias           o_proj bias     q/k norm         sliding window
=============  ==================  ==============  ===============  =============================================
llama          ``attention_bias``   same            —                —
mistral        no                   no              —                ``config.sliding_window`` on every layer
qwen2          yes                  no              —                per ``layer_types`` (``sliding_attention``)
qwen2_moe      ``qkv_bias``         no              —                attribute per ``layer_types`` (mask only)
qwen3          ``attention_bias``   same            RMSNorm per head per ``layer_types``
=============  ==================  ==============  ===============  =============================================

The family's ``apply_rotary_pos_emb``, ``eager_attention_forward`` and RMSNorm are taken from its modeling module,
and the attention kernel from ``ALL_ATTENTION_FUNCTIONS`` (``config._attn_implementation``), so the forward pass
equals the original's up to float rounding of the fused matmul (fp32 logits within 1e-5).

Conversion rule (per family ``model_type``): ``self_attn.{q,k,v}_proj`` → ``self_attn.qkv_proj`` with
``Concatenate(dim=0)``, for weights and biases; the reverse (save) splits with the sizes recorded at load.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch.nn as nn

from ...conversion import Concatenate, WeightConverter
from ...integrations.tensor_parallel import PACKED_QKV_COLWISE, QKV_HEADS, TensorParallelError
from ..base import Recipe, RuleSpec

__all__ = ["AttentionFamily", "FusedQKVAttention", "FUSED_QKV_CLASSES", "fused_qkv_rules", "fused_qkv_recipe"]

# How the sliding window reaches the kernel.
NO_WINDOW = "none"  # llama
WINDOW_ALL_LAYERS = "all"  # mistral: kwarg sliding_window=config.sliding_window
WINDOW_PER_LAYER = "per_layer"  # qwen2/qwen3: attribute + kwarg, None on full-attention layers
WINDOW_ATTRIBUTE_ONLY = "attribute"  # qwen2_moe: attribute on sliding layers only, not passed to the kernel


@dataclass(frozen=True)
class AttentionFamily:
    """What differs between the llama-family attention classes (see the module table).

    Attributes:
        model_type: ``config.model_type`` (also the conversion registry name).
        original: class name replaced (``"Qwen3Attention"``).
        qkv_bias / o_bias: ``config -> bool``.
        qk_norm: name of the per-head RMSNorm class in the modeling module (``"Qwen3RMSNorm"``) or ``None``.
        window: one of the ``*_WINDOW*`` modes.
    """

    model_type: str
    original: str
    qkv_bias: Callable[[Any], bool]
    o_bias: Callable[[Any], bool]
    qk_norm: str | None = None
    window: str = NO_WINDOW

    @property
    def module(self) -> ModuleType:
        """The family's modeling module (imported on each access: :class:`FusedQKVAttention` resolves it once
        per class, in its first ``__init__``, so that ``forward`` stays traceable by ``torch.compile``)."""
        return importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")


def _attention_bias(config) -> bool:
    return bool(getattr(config, "attention_bias", False))


def _never(config) -> bool:
    return False


FAMILIES = (
    AttentionFamily("llama", "LlamaAttention", _attention_bias, _attention_bias),
    AttentionFamily("mistral", "MistralAttention", _never, _never, window=WINDOW_ALL_LAYERS),
    AttentionFamily("qwen2", "Qwen2Attention", lambda c: True, _never, window=WINDOW_PER_LAYER),
    AttentionFamily("qwen2_moe", "Qwen2MoeAttention", lambda c: bool(c.qkv_bias), _never, window=WINDOW_ATTRIBUTE_ONLY),
    AttentionFamily("qwen3", "Qwen3Attention", _attention_bias, _attention_bias, "Qwen3RMSNorm", WINDOW_PER_LAYER),
)


def _layer_type(config, layer_idx: int) -> str | None:
    layer_types = getattr(config, "layer_types", None)
    return layer_types[layer_idx] if layer_types is not None else None


class FusedQKVAttention(nn.Module):
    """Decoder self-attention with one ``qkv_proj``; a subclass per family sets :attr:`family`.

    Built with the original's constructor arguments ``(config, layer_idx)``; ``forward`` has the original's
    signature ``(hidden_states (B, T, hidden), position_embeddings=(cos, sin), attention_mask, past_key_values,
    **kwargs) -> (attn_output (B, T, hidden), attn_weights | None)``; the KV cache is taken as ``past_key_values``
    (Transformers 5.23) or as ``cache`` (5.24 and later, which pass it under that name).
    """

    family: ClassVar[AttentionFamily]
    modeling: ClassVar[ModuleType]
    """The family's modeling module, set on the family class by its first ``__init__``. ``forward`` reads
    ``apply_rotary_pos_emb`` / ``eager_attention_forward`` / ``ALL_ATTENTION_FUNCTIONS`` from it at each call, as the original reads its
    module globals (so kernels patched into that module later are used too), without an import per call, which
    ``torch.compile`` cannot trace. A class attribute, not an instance one: instances stay picklable."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        family = self.family
        owner = next(c for c in type(self).__mro__ if "family" in c.__dict__)  # through dynamic subclasses (FSDP2)
        if "modeling" not in owner.__dict__:
            setattr(owner, "modeling", family.module)  # noqa: B010 - ``owner`` is a plain ``type`` to mypy
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_size = config.num_attention_heads * self.head_dim
        self.kv_size = config.num_key_value_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=family.qkv_bias(config))
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=family.o_bias(config))
        if family.qk_norm is not None:
            norm = getattr(self.modeling, family.qk_norm)
            self.q_norm = norm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, eps=config.rms_norm_eps)
        sliding = _layer_type(config, layer_idx) == "sliding_attention"
        if family.window == WINDOW_PER_LAYER:
            self.sliding_window = config.sliding_window if sliding else None
        elif family.window == WINDOW_ATTRIBUTE_ONLY and sliding:
            self.sliding_window = config.sliding_window

    def modelpatch_tp_plan(self, tp_size: int | None) -> dict[str, str]:
        """Tensor-parallel plan (see :mod:`modelpatch.integrations.tensor_parallel`), each rank ``1/tp_size`` of the
        heads of each of q, k and v, ``o_proj`` row-wise, as Transformers splits ``q_proj``/``k_proj``/``v_proj``
        and ``o_proj``. Multi-head attention: ``qkv_proj`` split by rows (``"modelpatch_packed_qkv_colwise"``);
        grouped-query attention (q and k/v of different sizes): ``qkv_proj`` kept whole on every rank, each rank
        computing its heads' rows (``"modelpatch_qkv_heads"`` on this module).

        Raises:
            TensorParallelError: ``tp_size`` does not divide the number of query or of key/value heads.
        """
        heads, kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        if tp_size is not None and (heads % tp_size or kv_heads % tp_size):
            raise TensorParallelError(
                f"{heads} query heads and {kv_heads} key/value heads do not split over tp_size={tp_size} ranks"
            )
        if heads != kv_heads:
            return {"": QKV_HEADS, "o_proj": "rowwise"}
        return {"qkv_proj": PACKED_QKV_COLWISE, "o_proj": "rowwise"}

    def _window_kwargs(self) -> dict:
        if self.family.window == WINDOW_ALL_LAYERS:
            return {"sliding_window": getattr(self.config, "sliding_window", None)}
        if self.family.window == WINDOW_PER_LAYER:
            return {"sliding_window": self.sliding_window}
        return {}

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        # Transformers >= 5.24 passes the KV cache as ``cache`` (``past_key_values`` is deprecated there) and hands
        # the call's kwargs to its update; read as ``past_key_values`` alone, the cache was never written and every
        # decode step attended to its own token only (``modelpatch verify``'s cache checks caught it)
        cache = kwargs.pop("cache", None)
        module = self.modeling
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.q_size, self.kv_size
        if qkv.shape[-1] != q_size + 2 * kv_size:  # tensor parallelism: this rank's heads of q, k and v
            q_size, kv_size = (size * qkv.shape[-1] // (q_size + 2 * kv_size) for size in (q_size, kv_size))
        query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
        query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
        if self.family.qk_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cos, sin = position_embeddings
        query, key = module.apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        elif past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        # the modeling module's binding of transformers.modeling_utils' registry (not imported here: import cost)
        attention = module.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, module.eager_attention_forward
        )
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **self._window_kwargs(),
            **kwargs,
        )
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def _make_class(family: AttentionFamily) -> type[FusedQKVAttention]:
    name = f"FusedQKV{family.original}"
    cls = type(
        name,
        (FusedQKVAttention,),
        {
            "family": family,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"Fused QKV replacement of ``{family.original}``.",
        },
    )
    globals()[name] = cls  # importable / picklable as modelpatch.recipes.fused_qkv.decoder.<name>
    return cls


FUSED_QKV_CLASSES: dict[str, type[FusedQKVAttention]] = {f.model_type: _make_class(f) for f in FAMILIES}
"""``{model_type: replacement class}`` (``FUSED_QKV_CLASSES["qwen3"].__name__ == "FusedQKVQwen3Attention"``)."""


def fused_qkv_rules() -> list:
    """``self_attn.{q,k,v}_proj.{weight,bias}`` → ``self_attn.qkv_proj.*`` by ``Concatenate(dim=0)``."""
    return [
        WeightConverter(
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.qkv_proj"], [Concatenate(dim=0)]
        )
    ]


def fused_qkv_recipe(family: AttentionFamily) -> Recipe:
    return Recipe(
        name=f"{family.model_type}-fused-qkv",
        description=f"{family.original} -> one qkv_proj (GQA, biases, q/k norms, sliding windows as the original)",
        patch_mapping={family.original: FUSED_QKV_CLASSES[family.model_type]},
        conversion={family.model_type: RuleSpec(fused_qkv_rules)},
        model_types=(family.model_type,),
    )
