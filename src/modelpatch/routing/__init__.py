"""Record and replay of Mixture-of-Experts routing for any Transformers model.

- :func:`record_routing` — context manager yielding a :class:`RoutingTrace` filled by forward passes and
  ``model.generate``.
- :func:`replay_routing` — context manager forcing a trace's expert indices (Megatron-LM router replay / R3,
  arXiv 2510.11370: indices fixed, weights recomputed from the live router so gradients flow).
- :class:`RoutingTrace` — per MoE layer (keyed by decoder-layer index) a LongTensor ``(num_tokens, top_k)`` per
  sequence; converts to and from inference-engine arrays ``(seq_len, num_layers, top_k)`` (vLLM
  ``CompletionOutput.routed_experts``) and saves to safetensors.

Modules, top-down: each imports only modules listed below it (none imports one above, not even inside a
function).

- ``agreement`` — routing drift (R3's measures): :func:`compare_routing` of two traces of the same tokens,
  :func:`routing_drift` of a model against a trace, :class:`RoutingAgreement`.
- ``record`` — :func:`record_routing` and its session, which fills a new trace.
- ``replay`` — :func:`replay_routing` and its session, which forces a trace's experts and checks all were consumed.
- ``generate`` — the generate guard of a record block: decoding modes that cannot be recorded are refused.
- ``driver`` — what both sessions share: the driver that patches router instances for the length of a block
  through an ``UndoStack``, the layout hooks and the dispatch of each router call.
- ``compiled`` — record and replay inside ``torch.compile`` graphs: the per-forward bookkeeping as ordered
  custom operators (layout, route, end) run by the compiled graph, so blocks add no graph break.
- ``trace`` — :class:`RoutingTrace`: compact storage, public reading/appending methods, safetensors files, and
  the conversions from and to engine arrays.
- ``engine_arrays`` — engine routed-experts arrays to per-layer routes and back, on plain tensors.
- ``recompute`` — binds the indices of a checkpointed forward to its recomputation in backward.
- ``layout`` — where each sequence's tokens sit in the flat token grid of one forward.
- ``sites`` — discovery of a model's routers (:class:`RouterSite`: layer, experts, top-k, kind).
- ``kinds`` — router math per kind (one ``torch.topk``, PhiMoE's sparsemixer) and the family table.
- ``measures`` — R3's agreement measures accumulated forward by forward (:class:`RoutingDriftMeter`,
  :class:`RoutingAgreement`), used by ``agreement`` and by ``replay_routing(..., drift=meter)``.
- ``errors`` — the routing exceptions, all :class:`modelpatch.errors.ModelpatchError`.
"""

from .agreement import compare_routing, routing_drift
from .errors import RouterContractError, RoutingDiscoveryError, RoutingReplayError, RoutingTraceError
from .kinds import FAMILY_KINDS, kind_for_family
from .measures import LayerAgreement, RoutingAgreement, RoutingDriftMeter
from .record import record_routing
from .replay import replay_routing
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
    "compare_routing",
    "routing_drift",
    "RoutingAgreement",
    "LayerAgreement",
    "RoutingDriftMeter",
]
