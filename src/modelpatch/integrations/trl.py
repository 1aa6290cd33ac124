"""Routing replay inside TRL's GRPO: :class:`RoutingReplayGRPOTrainer`, a drop-in ``trl.GRPOTrainer``.

An RL step of a Mixture-of-Experts policy scores tokens that a rollout produced; if the training forward routes
them to other experts than the rollout did, the policy gradient is computed for a different network (R3,
arXiv 2510.11370: ~10% of routers and 94% of tokens differ on Qwen3-30B-A3B). This trainer makes every
training-side forward use the rollout's experts (Megatron-LM's router replay, for ordinary Transformers models):

* **rollout**: ``model.generate`` inside the trainer is recorded (:func:`~modelpatch.routing.record_routing`); or,
  with a ``rollout_func`` (TRL's hook for vLLM and other engines) that returns ``routed_experts`` (one engine
  array ``(seq_len or seq_len - 1, num_layers, top_k)`` per completion, vLLM's
  ``CompletionOutput.routed_experts`` with ``enable_return_routed_experts=True``), those routes are used instead
  (:meth:`~modelpatch.routing.RoutingTrace.from_routed_experts`, validated).
* **training**: each completion's routes travel with it through TRL's batch shuffling and splitting (they are a
  per-sample field of the generation batch), across ``num_iterations`` and gradient accumulation; every call of
  ``_get_per_token_logps_and_entropies`` (the policy's loss forward, the old-policy and the reference forwards)
  replays them (:func:`~modelpatch.routing.replay_routing`), padding and masked tokens included.
* **logs**: ``routing/router_disagreement``, ``routing/token_flip_rate`` and ``routing/topk_overlap`` per
  logged step: how the policy's *natural* routing of the training tokens differs from the rollout's (R3's
  measures), measured inside the replayed loss forwards themselves (``replay_routing(..., drift=meter)``: one
  comparison per layer, no extra forward).

Text-only models; the tool-calling loop (``tools=``) is refused (its completions mix tool tokens the model did
not route). Tested with TRL 1.16.0 (the ``trl`` extra pins it): the private methods overridden here are
``_generate``, ``_generate_and_score_completions``, ``_compute_loss`` and ``_get_per_token_logps_and_entropies``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelpatchValueError
from ..routing import RoutingDriftMeter, RoutingTrace, record_routing, replay_routing
from ..undo import UndoStack
from ..versions import missing_dependency

try:
    from trl import GRPOTrainer
except ModuleNotFoundError as exc:
    raise missing_dependency(exc, "trl", "trl", "modelpatch.integrations.trl (RoutingReplayGRPOTrainer)") from None

__all__ = ["RoutingReplayGRPOTrainer", "SampleRoutes", "ROUTES_KEY"]

ROUTES_KEY = "modelpatch_routes"
"""The generation-batch field holding one :class:`SampleRoutes` per completion."""


@dataclass(frozen=True)
class SampleRoutes:
    """The rollout routes of one completion: ``routes[layer]`` is a LongTensor ``(prompt_tokens + completion
    tokens, top_k)`` in token order (``-1``: no route, e.g. the last token, which generation never feeds back)."""

    routes: dict[int, torch.Tensor]
    prompt_tokens: int
    num_experts: dict[int, int]
    top_k: dict[int, int]


def _samples_from_trace(trace: RoutingTrace, prompt_ids: list, completion_ids: list) -> list[SampleRoutes]:
    samples = []
    per_layer = {layer: trace.layer_routes(layer) for layer in trace.layers}  # decoded once, not once per sample
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        n = len(prompt) + len(completion)
        routes = {}
        for layer in trace.layers:
            rows = per_layer[layer][i][:n]
            if rows.shape[0] < n:
                rows = torch.cat([rows, rows.new_full((n - rows.shape[0], trace.top_k[layer]), -1)])
            routes[layer] = rows
        samples.append(SampleRoutes(routes, len(prompt), dict(trace.num_experts), dict(trace.top_k)))
    return samples


def _replay_trace(samples: list[SampleRoutes], attention_mask: torch.Tensor, completion_width: int) -> RoutingTrace:
    """The trace of one forward of ``input_ids = cat(prompt (left-padded), completion (right-padded))``: for each row,
    the routes of its real tokens (``attention_mask`` 1) in order; prompt tokens map to the sample's prompt rows,
    completion position ``j`` to row ``prompt_tokens + j``."""
    width = attention_mask.shape[1] - completion_width
    first = samples[0]
    layers = sorted(first.routes)
    per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    for sample, mask in zip(samples, attention_mask.bool().cpu()):
        prompt_real = int(mask[:width].sum())
        if prompt_real != sample.prompt_tokens:
            raise ModelpatchValueError(
                f"routing replay: a batch row has {prompt_real} prompt tokens, its rollout had {sample.prompt_tokens}"
            )
        completion_positions = mask[width:].nonzero()[:, 0]
        index = torch.cat([torch.arange(prompt_real), sample.prompt_tokens + completion_positions])
        for layer in layers:
            rows = sample.routes[layer]
            padded = torch.cat([rows, rows.new_full((1, rows.shape[1]), -1)])
            per_layer[layer].append(padded[index.clamp(max=rows.shape[0])])
    return RoutingTrace(per_layer, num_experts=first.num_experts, top_k=first.top_k)


class RoutingReplayGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose training forwards replay the rollout's MoE routing (see the module docstring).

    Same constructor as ``GRPOTrainer``. The model must have top-k routers that :mod:`modelpatch.routing` finds
    (the families of the README table); the reference model, when TRL uses one, replays the same routes.

    Raises:
        ModelpatchValueError: ``tools=`` (tool-calling completions are not replayed), or a batch row whose prompt
            length differs from its rollout's (the batch and its routes went out of step).
        RoutingTraceError / RoutingReplayError: routes that do not fit the model (from :mod:`modelpatch.routing`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.tools:
            raise ModelpatchValueError(
                "RoutingReplayGRPOTrainer does not replay tool-calling rollouts (tools=...): tool output tokens are "
                "not routed by the policy during generation"
            )
        self._replay_samples: list[SampleRoutes] | None = None
        self._drift: RoutingDriftMeter | None = None

    # -- rollout ------------------------------------------------------------------------------------------------
    def _generate(self, prompts: list) -> Any:
        if self.rollout_func is not None:
            result = super()._generate(prompts)
            prompt_ids, completion_ids, _, _, _, extra_fields = result[:6]
            arrays = extra_fields.pop("routed_experts", None)
            if arrays is None:
                raise ModelpatchValueError(
                    "RoutingReplayGRPOTrainer with rollout_func: return 'routed_experts' (one engine array per "
                    "completion, e.g. vLLM's CompletionOutput.routed_experts) so the rollout's routes can be replayed"
                )
            model = self.accelerator.unwrap_model(self.model)
            lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
            trace = RoutingTrace.from_routed_experts(list(arrays), model, seq_lens=lengths)
        else:
            with record_routing(self.accelerator.unwrap_model(self.model)) as trace:
                result = super()._generate(prompts)
            prompt_ids, completion_ids = result[0], result[1]
        self._replay_samples = _samples_from_trace(trace, prompt_ids, completion_ids)
        return result

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        with UndoStack() as undo:
            undo.callback(setattr, self, "_replay_samples", None)  # _generate sets the rollout's routes: cleared after
            output = super()._generate_and_score_completions(inputs)
            output[ROUTES_KEY] = self._replay_samples
        return output

    # -- training -----------------------------------------------------------------------------------------------
    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        drift = RoutingDriftMeter()
        with UndoStack() as undo:  # the batch's routes and drift meter, for this loss only
            undo.setattr(self, "_replay_samples", inputs[ROUTES_KEY])
            undo.setattr(self, "_drift", drift)
            loss = super()._compute_loss(model, inputs)
            agreement = drift.result()
        if agreement.tokens:
            metrics = self._metrics["train" if model.training else "eval"]
            metrics["routing/router_disagreement"].append(agreement.router_disagreement_rate)
            metrics["routing/token_flip_rate"].append(agreement.token_flip_rate)
            metrics["routing/topk_overlap"].append(agreement.mean_topk_overlap)
        return loss

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        samples = self._replay_samples
        if samples is None:  # e.g. evaluation before any rollout of this trainer: nothing to replay
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        if len(samples) != input_ids.shape[0]:
            raise ModelpatchValueError(
                f"routing replay: {input_ids.shape[0]} batch rows but routes for {len(samples)} completions"
            )
        trace = _replay_trace(samples, attention_mask, logits_to_keep)
        batch_size = kwargs.pop("batch_size", None) or input_ids.shape[0]
        multimodal = any(v is not None for k, v in kwargs.items() if k not in ("compute_entropy", "compute_aux_loss"))
        if multimodal:
            batch_size = input_ids.shape[0]  # TRL's per-chunk slicing of image tensors is its own: one chunk
        results = []
        for start in range(0, input_ids.shape[0], batch_size):
            end = min(start + batch_size, input_ids.shape[0])
            chunk = trace.select(list(range(start, end)))
            with replay_routing(model, chunk, drift=self._drift):
                results.append(
                    super()._get_per_token_logps_and_entropies(
                        model, input_ids[start:end], attention_mask[start:end], logits_to_keep, *args, **kwargs
                    )
                )
        if len(results) == 1:
            return results[0]
        logps = torch.cat([r[0] for r in results])
        entropies = torch.cat([r[1] for r in results]) if results[0][1] is not None else None
        aux = torch.stack([r[2] for r in results]).mean() if results[0][2] is not None else None
        return logps, entropies, aux
