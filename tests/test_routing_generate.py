"""``record_routing`` around ``generate``: the trace holds exactly the routes of the generated sequence (prefill and
one token per decode step, every cache kind, padding), and modes that do not extend the sequence one token at a time
(beam search, no cache, assisted decoding, guidance) are refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
from transformers import GenerationConfig

import modelpatch.routing.generate as routing_session
from modelpatch.routing import RoutingTraceError, record_routing
from routing_models import tiny_model

IDS = torch.tensor([[3, 5, 9, 17, 33, 4, 4, 4], [3, 8, 21, 40, 2, 7, 4, 4]])


def test_record_refuses_beam_search_and_restores_generate():
    model = tiny_model("qwen3_moe").eval()
    with pytest.raises(RoutingTraceError, match="num_beams=3"):
        with torch.no_grad(), record_routing(model):
            model.generate(IDS[:, :5], max_new_tokens=2, num_beams=3, do_sample=False, pad_token_id=0)
    assert "generate" not in model.__dict__
    with torch.no_grad(), record_routing(model) as trace:  # greedy still records prefill + decode steps
        model.generate(IDS[:1, :5], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert trace[trace.layers[0]][0].shape[0] == 5 + 2


# -- modes whose forwards do not extend the recorded sequences one token at a time are refused ------------------------


_PROMPT = torch.tensor([[5, 9, 17, 5, 9, 17, 5, 9]])


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(use_cache=False), r"use_cache=False: every decode step re-runs the whole prefix"),
        (dict(prompt_lookup_num_tokens=3), r"assisted / speculative decoding \(prompt_lookup_num_tokens=3\)"),
        (dict(assistant_model="copy"), r"assisted / speculative decoding \(assistant_model\)"),
        (dict(guidance_scale=1.5), r"classifier-free guidance \(guidance_scale=1.5\)"),
        (dict(generation_config="no_cache"), r"use_cache=False"),
    ],
)
def test_record_refuses_generate_modes_that_do_not_extend_one_token_at_a_time(options, message):
    # was: use_cache=False recorded 6 sequences of 8..13 tokens, prompt lookup 1 sequence of 16 (13 expected)
    model = tiny_model("qwen3_moe").eval()
    if options.get("assistant_model") == "copy":
        options = dict(assistant_model=copy.deepcopy(model))
    if options.get("generation_config") == "no_cache":
        options = dict(generation_config=GenerationConfig(use_cache=False, max_new_tokens=6, pad_token_id=0))
    else:
        options = dict(options, max_new_tokens=6, pad_token_id=0)
    with pytest.raises(RoutingTraceError, match="record_routing cannot record generate with " + message):
        with torch.no_grad(), record_routing(model):
            model.generate(_PROMPT, do_sample=False, **options)
    assert "generate" not in model.__dict__


def test_generate_steps_are_checked_to_continue_the_cache(monkeypatch):
    # the backstop behind the option checks: a step that re-runs the prefix or restarts inside the cache raises
    model = tiny_model("qwen3_moe").eval()
    monkeypatch.setattr(routing_session, "_refused_generation", lambda *a: None)
    with pytest.raises(RoutingTraceError, match="ran the whole sequence again instead of continuing the KV cache"):
        with torch.no_grad(), record_routing(model):
            model.generate(_PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=False)
    with pytest.raises(
        RoutingTraceError,
        match=r"continues the KV cache from position \d+, the previous forward "
        r"ended at \d+: the cache was cropped",
    ):
        with torch.no_grad(), record_routing(model):
            model.generate(_PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("family", ["minimax", "qwen3_moe"])
def test_generate_trace_equals_routes_of_the_generated_sequence(family):
    # was (minimax): layer 0's cache holds no keys (linear attention), decode steps were read as new sequences
    model = tiny_model(family).eval()
    with torch.no_grad(), record_routing(model) as trace:
        out = model.generate(_PROMPT[:, :6], max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad(), record_routing(model) as full:
        model(out)
    assert trace.sequence_lengths == [out.shape[1] - 1]
    for layer in trace.layers:
        assert torch.equal(trace[layer][0], full[layer][0][:-1])


@pytest.mark.parametrize(
    ("family", "overrides", "cache"),
    [
        ("qwen3_moe", {}, "static"),
        ("mixtral", {"sliding_window": 4}, "static"),
        ("mixtral", {"sliding_window": 4}, None),
    ],
)
def test_generate_with_any_cache_records_exactly_the_real_tokens(family, overrides, cache):
    model = tiny_model(family, **overrides)
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 20, 21, 22, 23, 24, 25]])
    mask = (ids != 0).long()
    with torch.no_grad(), record_routing(model) as reference:  # the default cache, a 2-D mask at every forward
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with torch.no_grad(), record_routing(model) as trace:
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation=cache
        )
    assert trace.sequence_lengths == [9 + 2, 6 + 2]  # left padding is not a token; the last token is never fed
    for layer in trace.layers:
        assert all(torch.equal(a, b) for a, b in zip(trace[layer], reference[layer]))


@pytest.mark.parametrize("cache", ["static", None])
def test_generate_with_num_return_sequences_expands_the_padding_mask(cache):
    """``num_return_sequences=2`` repeats each prompt row: with a static cache (4-D masks, padding read from the
    prompt's 2-D mask) the padded row's pad positions were recorded as tokens ([10, 10, 10, 10] instead of
    [7, 7, 10, 10] here: the prompt mask was not expanded to the generated batch)."""
    model = tiny_model("qwen3_moe")
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 20, 21, 22, 23, 24, 25]])
    mask = (ids != 0).long()
    # sampling with top_k=1: what num_return_sequences needs, and deterministic
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=True, top_k=1, num_return_sequences=2)
    with torch.no_grad(), record_routing(model) as reference:  # the default cache: a 2-D mask at every forward
        model.generate(**kwargs)
    with torch.no_grad(), record_routing(model) as trace:
        model.generate(**kwargs, cache_implementation=cache)
    assert reference.sequence_lengths == [10, 10, 7, 7]
    assert trace.sequence_lengths == [10, 10, 7, 7]
    for layer in trace.layers:
        assert all(torch.equal(a, b) for a, b in zip(trace[layer], reference[layer]))
