"""Record and replay of Mixture-of-Experts routing for any Transformers model (SPEC section 4, issue 4).

- :func:`record_routing` — context manager yielding a :class:`RoutingTrace` filled by forward passes and
  ``model.generate``.
- :func:`replay_routing` — context manager forcing a trace's expert indices (Megatron-LM router replay / R3,
  arXiv 2510.11370: indices fixed, weights recomputed from the live router so gradients flow).
- :class:`RoutingTrace` — per MoE layer (keyed by decoder-layer index) a LongTensor ``(num_tokens, top_k)`` per
  sequence; converts to and from inference-engine arrays ``(seq_len, num_layers, top_k)`` (vLLM
  ``CompletionOutput.routed_experts``) and saves to safetensors.
"""

from .errors import RouterContractError, RoutingDiscoveryError, RoutingReplayError, RoutingTraceError
from .kinds import FAMILY_KINDS, kind_for_family
from .session import record_routing, replay_routing
from .sites import RouterSite, find_router_sites
from .trace import RoutingTrace, from_routed_experts, to_routed_experts

__all__ = [
    "record_routing",
    "replay_routing",
    "RoutingTrace",
    "RoutingTraceError",
    "RoutingReplayError",
    "RoutingDiscoveryError",
    "RouterContractError",
    "RouterSite",
    "find_router_sites",
    "from_routed_experts",
    "to_routed_experts",
    "FAMILY_KINDS",
    "kind_for_family",
]
