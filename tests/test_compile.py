"""torch.compile of patched models: fused-QKV attention, linear experts, record/replay blocks.

Every compile goes through :class:`Recorder`, a backend that notes the compile id of each graph Dynamo hands it
(``frame_compile_id > 0``: a recompilation of a frame already compiled) and then runs ``aot_eager`` (forward
and backward graphs traced by AOTAutograd, as inductor gets them, without inductor's C++ build). Graph breaks
are read from ``torch._dynamo.utils.counters["graph_break"]``; ``fullgraph=True`` would raise on any break.
"""

from __future__ import annotations

import os
import runpy
import sys

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, BertModel

from helpers import tiny_bert_config, tiny_qwen2_moe_config, tiny_qwen3_moe_config
from modelpatch.errors import ModelpatchValueError
from modelpatch.recipes import get_recipe
from modelpatch.recipes.linear_experts import LinearExperts
from modelpatch.routing import RoutingDriftMeter, RoutingReplayError, RoutingTrace, record_routing, replay_routing
from recipes_support import CASES, randomize_

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "compile_fused_qkv.py")


class Recorder:
    """Compile backend recording ``(frame_id, frame_compile_id)`` per graph, then ``aot_eager`` (or ``backend``)."""

    def __init__(self, backend: str = "aot_eager"):
        self.backend = lookup_backend(backend)
        self.ids: list[tuple[int, int]] = []

    def __call__(self, gm, example_inputs):
        cid = torch._guards.CompileContext.current_compile_id()
        self.ids.append((cid.frame_id, cid.frame_compile_id))
        return self.backend(gm, example_inputs)

    @property
    def graphs(self) -> int:
        return len(set(self.ids))  # Dynamo may hand the same compile to the backend twice (restart analysis)

    @property
    def recompiles(self) -> int:
        return sum(1 for _, n in self.ids if n)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def _patched(name: str, config=None):
    with get_recipe(name).apply():
        model = AutoModelForCausalLM.from_config(config if config is not None else CASES[name]())
    return randomize_(model)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- fused QKV -----------------------------------------------------------------------------------------------------


def _check_fused_qkv(name: str, backend: str = "aot_eager") -> None:
    model = _patched(name).train()  # dropout is 0 in the tiny configs; train() keeps the training branch traced
    assert type(model.model.layers[0].self_attn).__name__.startswith("FusedQKV")
    ids = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10]])
    rec = Recorder(backend)
    compiled = torch.compile(model, backend=rec, fullgraph=True)
    out = compiled(input_ids=ids).logits
    out.square().mean().backward()
    got = _grads(model)
    ref = model(input_ids=ids).logits
    ref.square().mean().backward()
    want = _grads(model)
    assert (rec.graphs, rec.recompiles, _breaks()) == (1, 0, 0)
    assert (out - ref).abs().max().item() < 1e-5
    assert len(got) == len(want) == len(list(model.parameters()))
    assert _max_diff(got, want) < 1e-5


def test_llama_fused_qkv_compiles_fullgraph_forward_and_backward():
    _check_fused_qkv("llama-fused-qkv")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("qwen3-fused-qkv", "aot_eager"),  # q/k norms: forward and backward graphs through AOTAutograd
        # the others: Dynamo's graph (breaks, recompiles) and eager autograd through it, to keep the suite short
        ("mistral-fused-qkv", "eager"),
        ("qwen2-fused-qkv", "eager"),
        ("qwen2_moe-fused-qkv", "eager"),
    ],
)
def test_every_decoder_fused_qkv_recipe_compiles_fullgraph(name, backend):
    _check_fused_qkv(name, backend)


def test_fused_qkv_attention_resolves_its_modeling_module_once_per_class_and_pickles():
    import pickle

    import transformers.models.llama.modeling_llama as modeling_llama

    model = _patched("llama-fused-qkv")
    attn = model.model.layers[0].self_attn
    cls = type(attn)
    assert "modeling" in cls.__dict__ and cls.modeling is modeling_llama
    assert "modeling" not in attn.__dict__  # a class attribute: the instance pickles as before
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone.model.layers[0].self_attn) is cls
    ids = torch.tensor([[1, 5, 9, 17]])
    assert torch.equal(clone(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.slow
def test_bert_fused_qkv_compiles_fullgraph():
    with get_recipe("bert-fused-qkv").apply():
        model = BertModel(tiny_bert_config())
    randomize_(model).eval()
    ids = torch.tensor([[1, 5, 9, 17, 33, 64, 2, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    rec = Recorder()
    out = torch.compile(model, backend=rec, fullgraph=True)(input_ids=ids, attention_mask=mask).last_hidden_state
    ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (rec.graphs, rec.recompiles, _breaks()) == (1, 0, 0)
    assert (out - ref).abs().max().item() < 1e-5


# -- linear experts ------------------------------------------------------------------------------------------------

_LENGTHS = (5, 7, 12)  # three lengths: a recompile per length would show on the second and third


def _experts_model(dispatch: str | None = None):
    model = _patched("qwen3_moe-linear-experts", tiny_qwen3_moe_config(num_hidden_layers=1)).train()
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, LinearExperts)
    if dispatch is not None:
        experts.compiled_dispatch = dispatch
    return model, experts


def _run_lengths(model, compiled, backward: bool = True) -> tuple[float, float]:
    """Max output and gradient differences, compiled vs eager, of the MoE block (router + linear experts, what the
    recipe changes; the rest of the model is Transformers' own) over :data:`_LENGTHS` (batch 2; gradients at the
    first and last length, which is enough to see the backward graph is not recompiled either)."""
    block = model.model.layers[0].mlp
    gen = torch.Generator().manual_seed(0)
    out_diff = grad_diff = 0.0
    for length in _LENGTHS:
        hidden = torch.randn(2, length, block.experts.hidden_dim, generator=gen)
        out = compiled(hidden)
        ref = block(hidden)
        out_diff = max(out_diff, (out - ref).abs().max().item())
        if backward and length in (_LENGTHS[0], _LENGTHS[-1]):
            compiled(hidden).square().mean().backward()
            got = _grads(block)
            block(hidden).square().mean().backward()
            grad_diff = max(grad_diff, _max_diff(got, _grads(block)))
    return out_diff, grad_diff


@pytest.mark.slow
def test_dense_dispatch_compiles_fullgraph_without_recompiling_per_length():
    model, _ = _experts_model("dense")
    rec = Recorder()
    compiled = torch.compile(model.model.layers[0].mlp, backend=rec, fullgraph=True, dynamic=True)
    out_diff, grad_diff = _run_lengths(model, compiled)
    assert (rec.graphs, rec.recompiles, _breaks()) == (1, 0, 0), (rec.ids, dict(counters["graph_break"]))
    assert out_diff < 1e-5 and grad_diff < 1e-5


@pytest.mark.slow
def test_sparse_dispatch_is_whole_with_dynamic_output_shapes():
    model, experts = _experts_model()
    assert experts.compiled_dispatch == "sparse"
    rec = Recorder()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(model.model.layers[0].mlp, backend=rec, fullgraph=True, dynamic=True)
        out_diff, grad_diff = _run_lengths(model, compiled)
    assert (rec.graphs, rec.recompiles, _breaks()) == (1, 0, 0), (rec.ids, dict(counters["graph_break"]))
    assert out_diff < 1e-5 and grad_diff < 1e-5


@pytest.mark.slow
def test_sparse_dispatch_is_whole_without_dynamic_output_shapes_and_never_recompiles_per_length():
    # the per-expert token positions are one operator (modelpatch::expert_positions), not a nonzero Dynamo breaks at
    model, _ = _experts_model()
    assert not torch._dynamo.config.capture_dynamic_output_shape_ops
    rec = Recorder("eager")
    compiled = torch.compile(model.model.layers[0].mlp, backend=rec, dynamic=True)
    out_diff, _ = _run_lengths(model, compiled, backward=False)
    assert (rec.graphs, rec.recompiles, _breaks()) == (1, 0, 0), (rec.ids, dict(counters["graph_break"]))
    assert out_diff < 1e-5


def test_compiled_experts_still_call_every_expert_linear():
    model, experts = _experts_model("dense")
    calls: list[int] = []
    for e, expert in enumerate(experts):
        expert.gate_proj.register_forward_hook(lambda m, a, o, e=e: calls.append(e))
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    out = torch.compile(model, backend=Recorder("eager"), fullgraph=True)(input_ids=ids).logits
    assert calls == list(range(len(experts)))
    calls.clear()
    assert (out - model(input_ids=ids).logits).abs().max().item() < 1e-5
    assert sorted(set(calls)) == sorted(calls) and set(calls) <= set(range(len(experts)))  # eager: experts hit


def test_unknown_compiled_dispatch_is_refused_naming_the_value():
    model, _ = _experts_model("grouped")
    with pytest.raises(Exception) as info:
        torch.compile(model, backend=Recorder("eager"), fullgraph=True)(input_ids=torch.tensor([[1, 2, 3]]))
    chain = [info.value, info.value.__cause__, info.value.__context__]
    assert any(isinstance(e, ModelpatchValueError) for e in chain) or "compiled_dispatch='grouped'" in str(info.value)
    assert "'grouped'" in str(info.value) and "('sparse', 'dense')" in str(info.value)


# -- whole models over sequence lengths (issue 21, item 11) -------------------------------------------------------


def _check_lengths_without_recompiling(name: str, config) -> None:
    """Model compiled with ``dynamic=True`` and Dynamo's defaults (no ``fullgraph``, no
    ``capture_dynamic_output_shape_ops``), run in eval mode with the KV cache (Transformers' default) over four
    lengths: one graph, no recompile, no break, logits within 1e-5 of eager (measured: 0.0)."""
    torch.manual_seed(0)
    model = _patched(name, config).eval()
    rec = Recorder()
    compiled = torch.compile(model, backend=rec, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    diff = 0.0
    for length in (5, 7, 9, 12):
        ids = torch.randint(0, 100, (2, length), generator=gen)
        diff = max(diff, (compiled(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item())
    assert (rec.graphs, rec.recompiles, _breaks()) == (1, 0, 0), (rec.ids, dict(counters["graph_break"]))
    assert diff < 1e-5


@pytest.mark.slow
def test_full_example_compiles_once_over_sequence_lengths():
    # before: the nonzero of the sparse dispatch broke each decoder layer's frame, compiled then once per layer
    # (the cache's guard past_key_values.layers[0].is_initialized: 1 recompile with 2 layers, one per layer beyond),
    # and each expert's frame was recompiled when its row count met 0 or 1 (3 recompiles, 7 breaks here)
    _check_lengths_without_recompiling("qwen2_moe-full-example", tiny_qwen2_moe_config())


@pytest.mark.slow
def test_fused_qkv_compiles_once_over_sequence_lengths():
    _check_lengths_without_recompiling("llama-fused-qkv", CASES["llama-fused-qkv"]())


# -- routing -------------------------------------------------------------------------------------------------------


def _moe():
    torch.manual_seed(0)
    return randomize_(AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(num_hidden_layers=1)))


# batch 2 everywhere: Dynamo specialises sizes 0 and 1 even with dynamic=True
_IDS = [
    torch.tensor([[1, 5, 9, 17, 33], [2, 6, 10, 18, 34]]),
    torch.tensor([[3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3]]),
]
_MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])


def _forwards(fn):
    return [fn(input_ids=x, attention_mask=torch.ones_like(x)).logits for x in _IDS] + [
        fn(input_ids=_IDS[1], attention_mask=_MASK).logits
    ]


def _shifted(trace: RoutingTrace, model) -> RoutingTrace:
    """``trace`` with every expert id moved by one (mod the number of experts): routes the router never chose."""
    layer = trace.layers[0]
    e = trace.num_experts[layer]
    routes = {layer: [(r + 1) % e for r in trace.layer_routes(layer)]}
    return RoutingTrace(routes, num_experts=trace.num_experts, top_k=trace.top_k, num_hidden_layers=1)


# With dynamic=True, Dynamo first traces Python floats of the model (attention scaling, dropout 0.0) as symbols, then
# AOTAutograd's tensorify pass specialises them to their values and Dynamo redoes the whole trace; starting with
# them specialised skips the discarded first attempt (about half the compile time) and ends in the same graph.
_SPECIALIZE_FLOATS = torch._dynamo.config.patch(specialize_float=True)


@pytest.mark.slow
@_SPECIALIZE_FLOATS
def test_record_and_replay_on_a_model_compiled_before_the_blocks():
    model = _moe()
    with record_routing(model) as want:
        _forwards(model)
    assert want.sequence_lengths == [5, 5, 7, 7, 5, 7]
    rec = Recorder()
    compiled = torch.compile(model, backend=rec, fullgraph=True, dynamic=True)
    _forwards(compiled)  # the plain graph
    assert rec.recompiles == 0
    for _ in range(2):  # the second round reuses the first one's graph
        with record_routing(model) as got:
            _forwards(compiled)
        assert got.sequence_lengths == want.sequence_lengths
        layer = want.layers[0]
        assert all(torch.equal(a, b) for a, b in zip(got.layer_routes(layer), want.layer_routes(layer)))
    shifted = _shifted(want, model)
    with replay_routing(model, shifted):
        eager = _forwards(model)
        eager[0].sum().backward()
    eager_grads = _grads(model)
    for _ in range(2):
        with replay_routing(model, shifted):
            outs = _forwards(compiled)
            outs[0].sum().backward()
        assert max((a - b).abs().max().item() for a, b in zip(outs, eager)) < 1e-5
        assert _max_diff(_grads(model), eager_grads) < 1e-5
    # a "no route" row (-1) in a batch without padding: that token takes the live router's choice, as in eager
    layer = shifted.layers[0]
    routes = shifted.layer_routes(layer)
    routes[0][0] = -1
    freed = RoutingTrace({layer: routes}, num_experts=shifted.num_experts, top_k=shifted.top_k, num_hidden_layers=1)
    with replay_routing(model, freed):
        eager_freed = _forwards(model)
    with replay_routing(model, freed):
        compiled_freed = _forwards(compiled)
    assert max((a - b).abs().max().item() for a, b in zip(compiled_freed, eager_freed)) < 1e-5
    assert (compiled_freed[0][0, 0] - outs[0][0, 0]).abs().max() > 1e-3  # token 0: natural, not the shifted route
    assert torch.allclose(compiled_freed[0][1], outs[0][1], atol=1e-5)  # the other sequence: as replayed before
    plain = _forwards(model)
    assert min((a - b).abs().max().item() for a, b in zip(outs, plain)) > 1e-3  # replay forced other experts
    after = _forwards(compiled)  # outside the blocks: the plain graph again
    assert max((a - b).abs().max().item() for a, b in zip(after, plain)) < 1e-5
    assert _breaks() == 0
    # one recompile, when the first block drives the routers (record and replay share that graph); none per block
    # or per forward, and the plain graph is still cached
    assert rec.recompiles == 1, rec.ids


@pytest.mark.slow
def test_compiled_replay_of_one_sequence_and_with_a_drift_meter():
    # one sequence per forward (its trace rows handed to the graph as one copy) and a drift meter (the general
    # path, comparing the live router's choice): as in eager
    model = _moe()
    ids = _IDS[1][:1]
    with record_routing(model) as want:
        model(input_ids=ids)
    shifted = _shifted(want, model)
    compiled = torch.compile(model, backend=Recorder(), fullgraph=True)
    results = []
    for fn in (model, compiled):
        with replay_routing(model, shifted):
            logits = fn(input_ids=ids).logits
        meter = RoutingDriftMeter()
        with replay_routing(model, shifted, drift=meter):
            drifted = fn(input_ids=ids).logits
        results.append((logits, drifted, meter.result()))
    (eager, eager_drifted, eager_drift), (got, got_drifted, got_drift) = results
    assert (got - eager).abs().max() < 1e-5 and (got_drifted - eager).abs().max() < 1e-5
    assert (eager_drifted - eager).abs().max() == 0
    assert (got - model(input_ids=ids).logits).abs().max() > 1e-3  # the shifted routes were forced
    assert got_drift == eager_drift and got_drift.router_disagreement_rate == 1.0  # every route shifted
    # a batch taking the first 5 of 7 routes of two sequences (slices of each, not one range): as in eager, and the
    # routes left over are refused at the end of the block either way
    with record_routing(model) as both:
        model(input_ids=_IDS[1])
    partial = []
    for fn in (model, compiled):
        with pytest.raises(RoutingReplayError, match="leftover"), replay_routing(model, _shifted(both, model)):
            partial.append(fn(input_ids=_IDS[1][:, :5]).logits)
    assert (partial[1] - partial[0]).abs().max() < 1e-5
    assert (partial[0] - model(input_ids=_IDS[1][:, :5]).logits).abs().max() > 1e-3
    assert _breaks() == 0


@pytest.mark.slow
def test_record_on_a_model_compiled_inside_the_block():
    model = _moe()
    with record_routing(model) as want:
        _forwards(model)
    rec = Recorder("eager")  # Dynamo only: the operators under AOTAutograd are covered by the test above
    with record_routing(model) as got:
        compiled = torch.compile(model, backend=rec, fullgraph=True, dynamic=True)
        _forwards(compiled)
    layer = want.layers[0]
    assert got.sequence_lengths == want.sequence_lengths
    assert all(torch.equal(a, b) for a, b in zip(got.layer_routes(layer), want.layer_routes(layer)))
    with replay_routing(model, want):
        _forwards(compiled)
    assert (_breaks(), rec.recompiles) == (0, 0)


# -- example -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compile_example_runs_and_matches_eager(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [EXAMPLE, "--backend", "aot_eager"])
    result = runpy.run_path(EXAMPLE, run_name="__main__")
    out = capsys.readouterr().out
    assert "graph breaks: 0" in out
    assert result["MAX_DIFF"] < 1e-5
