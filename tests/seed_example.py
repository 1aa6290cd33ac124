"""The founding document's full-example classes (qwen2_moe: ``MoeMLP``, ``ModuleListExperts``,
``FusedQKVAttention``), defined once for all tests in ``conversion_models``.

``FusedQKVAttention`` there honours ``num_key_value_heads`` (the document's version assumes MHA) and
``ModuleListExperts`` also reads ``num_local_experts`` (mixtral).
"""

from conversion_models import FusedQKVAttention, ModuleListExperts, MoeMLP

__all__ = ["FusedQKVAttention", "ModuleListExperts", "MoeMLP"]
