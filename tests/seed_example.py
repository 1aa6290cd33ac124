"""The seed example's classes (qwen2_moe: ``MoeMLP``, ``ModuleListExperts``, ``FusedQKVAttention``: the full
example written as a user would write it against Transformers' own API), defined once for all tests in
``conversion_models``.

``FusedQKVAttention`` there honours ``num_key_value_heads`` (the seed's version assumes MHA) and
``ModuleListExperts`` also reads ``num_local_experts`` (mixtral).
"""

from conversion_models import FusedQKVAttention, ModuleListExperts, MoeMLP

__all__ = ["FusedQKVAttention", "ModuleListExperts", "MoeMLP"]
