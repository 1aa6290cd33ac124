""":class:`GenerateGuard`: while recording, refuses ``model.generate`` calls in decoding modes that cannot be recorded and
checks that each decode step continues the KV cache.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..undo import UndoStack
from .errors import RoutingTraceError
from .layout import ForwardLayout

if TYPE_CHECKING:
    pass

__all__ = ["GenerateGuard"]


class GenerateGuard:
    """While recording, ``model.generate`` refuses the decoding modes whose forwards do not extend the recorded
    sequences one token at a time (beam search, assisted / prompt-lookup decoding, ``use_cache=False``, ...),
    and :meth:`check_step` checks at every forward of an accepted call that it continues the KV cache where the
    previous forward ended.

    :meth:`install` puts the guarded ``generate`` on the model instance through the caller's
    :class:`~modelpatch.undo.UndoStack`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.active = False  # inside a guarded generate call
        self.end: int | None = None  # inside generate: grid length after the last forward
        self.prompt_mask: torch.Tensor | None = None  # inside generate: its 2-D attention_mask (batch, prompt)

    def install(self, undo: UndoStack) -> None:
        model = self.model
        original = getattr(model, "generate", None)
        if original is None:  # a bare wrapper (DDP) or a base model without generate
            return

        def generate(*args: Any, **kwargs: Any) -> Any:
            why = _refused_generation(model, args, kwargs)
            if why is not None:
                raise RoutingTraceError(f"record_routing cannot record generate with {why}")
            if self.active:  # generate calling generate: let the outer call's checks stand
                return original(*args, **kwargs)
            mask = kwargs.get("attention_mask")
            with UndoStack() as state:
                state.setattr(self, "active", True)
                state.setattr(self, "end", None)
                state.setattr(self, "prompt_mask", mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)
                return original(*args, **kwargs)

        undo.setattr(model, "generate", generate, raw=True)

    def check_step(self, layout: ForwardLayout) -> None:
        """Inside ``generate``: every forward after the first must continue the KV cache exactly where the
        previous one ended (the backstop behind :func:`_refused_generation`).

        Raises:
            RoutingTraceError: the forward re-runs the whole sequence, or continues the cache elsewhere.
        """
        if not self.active:
            return
        end = self.end
        if end is not None:
            if not layout.continuation:
                raise RoutingTraceError(
                    "record_routing: a generate step ran the whole sequence again instead of continuing the KV "
                    "cache (use_cache=False, or a decoding mode without cache); each step would be recorded as "
                    "new sequences. Generate with use_cache=True, greedy or sampling"
                )
            if layout.past != end:
                raise RoutingTraceError(
                    f"record_routing: a generate step continues the KV cache from position {layout.past}, the "
                    f"previous forward ended at {end}: the cache was cropped or reordered (assisted / speculative "
                    "decoding, beam search?), so routes of discarded tokens were recorded. Generate greedy or "
                    "sampling, without an assistant"
                )
        self.end = layout.past + layout.seq_len

    def padding_mask(self, mask: Any, seq_len: int, batch: int) -> Any:
        """Inside ``generate``: the 2-D mask ``(batch, past + seq_len)`` of the forward about to run, built from the
        prompt's 2-D mask (every generated token is real), when the forward itself gets no 2-D mask: a static or
        otherwise compiled cache hands the model a 4-D mask, from which padding cannot be read. Else ``mask``.

        ``generate`` expands the prompt batch ``B`` to ``batch = B * n`` rows (``num_return_sequences``: each
        prompt row repeated ``n`` times, ``repeat_interleave`` as ``_expand_inputs_for_generation`` does), so the
        prompt mask is expanded the same way.

        Raises:
            RoutingTraceError: ``batch`` is not a multiple of the prompt batch (the rows cannot be aligned).
        """
        prompt = self.prompt_mask
        if not self.active or prompt is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            return mask
        total = (self.end if self.end is not None else prompt.shape[1]) + (seq_len if self.end is not None else 0)
        if total < prompt.shape[1]:
            return mask
        if batch != prompt.shape[0]:
            if batch % prompt.shape[0]:
                raise RoutingTraceError(
                    f"record_routing: a generate forward of {batch} rows for a prompt batch of {prompt.shape[0]} "
                    "rows: its padding cannot be aligned with the prompt's attention_mask"
                )
            prompt = prompt.repeat_interleave(batch // prompt.shape[0], dim=0)
        extra = prompt.new_ones((prompt.shape[0], total - prompt.shape[1]))
        return torch.cat([prompt, extra], dim=1)


# Options of ``generate`` whose forwards do not extend the recorded sequences one step at a time.
_ASSISTED_OPTIONS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


def _generation_config(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The generation config ``generate(*args, **kwargs)`` will run with (``None`` if it cannot be read)."""
    config: Any = kwargs.get("generation_config")
    if config is None and len(args) > 1:
        config = args[1]
    rest = {k: v for k, v in kwargs.items() if k not in ("generation_config", "assistant_model", "custom_generate")}
    prepare: Any = getattr(model, "_prepare_generation_config", None)
    try:
        return prepare(config, **rest)[0]
    except Exception:  # noqa: BLE001 - private helper of Transformers: fall back to the plain merge
        pass
    try:
        config = copy.deepcopy(config if config is not None else model.generation_config)
        config.update(**rest)
        return config
    except Exception:  # noqa: BLE001 - generate itself will report a bad config
        return None


def _refused_generation(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``record_routing`` cannot record this ``generate`` call, or ``None``."""
    config = _generation_config(model, args, kwargs)
    if kwargs.get("custom_generate") is not None:
        return (
            f"custom_generate={kwargs['custom_generate']!r}: a custom decoding loop may run forwards that do not "
            "extend the generated sequences one step at a time"
        )
    if config is None:
        return None
    beams = getattr(config, "num_beams", 1) or 1
    if beams > 1:
        return (
            f"beam search (num_beams={beams}): beams reorder the KV cache between decode steps; generate with "
            "num_beams=1 (greedy or sampling), as RL rollouts do"
        )
    assisted = []
    for name in _ASSISTED_OPTIONS:
        value = kwargs.get(name) if name == "assistant_model" else getattr(config, name, None)
        if value is not None and value is not False:
            assisted.append(name if name == "assistant_model" else f"{name}={value!r}")
    if assisted:
        return (
            f"assisted / speculative decoding ({', '.join(assisted)}): the model verifies draft tokens in one "
            "forward, the rejected ones are routed too and then cropped from the KV cache; generate without it"
        )
    if getattr(config, "use_cache", True) is False:
        return (
            "use_cache=False: every decode step re-runs the whole prefix, so each step would be recorded as new "
            "sequences; generate with use_cache=True"
        )
    guidance = getattr(config, "guidance_scale", None)
    if guidance is not None and guidance != 1:
        return (
            f"classifier-free guidance (guidance_scale={guidance}): it runs extra unconditional forwards of the "
            "model that would be recorded as routes of the generated sequences"
        )
    try:
        mode = str(getattr(config.get_generation_mode(kwargs.get("assistant_model")), "value", ""))
    except Exception:  # noqa: BLE001 - a config generate cannot classify: generate itself reports it
        mode = ""
    if mode and mode not in ("greedy_search", "sample"):
        return f"generation mode {mode!r}: only greedy decoding and sampling extend the sequences one step at a time"
    return None
