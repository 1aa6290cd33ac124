"""Placement-only rules (``Concatenate``; ``MergeModulelist`` + ``Concatenate``) read their sources straight into one
output allocated once, in the parameter's dtype: the same values, bit for bit, as converting and then casting."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from conversion_models import (
    QKV_RULE,
    checkpoint,
    clean_conversions,  # noqa: F401 - autouse fixture
    expected_fused,
    randomize_,
)
from helpers import tiny_llama_config
from modelpatch.conversion import (
    Chunk,
    Concatenate,
    ConversionError,
    MergeModulelist,
    Transpose,
    WeightConverter,
)
from modelpatch.conversion import plan as engine
from modelpatch.conversion.placement import Placement, fill, placement
from modelpatch.conversion.plan import build_plan
from modelpatch.recipes import get_recipe


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-placement")
    randomize_(LlamaForCausalLM(tiny_llama_config())).save_pretrained(folder)
    return folder, checkpoint(folder)


@pytest.fixture
def fills(monkeypatch):
    """The dtype of every output :func:`fill` allocated during the test (a spy on modelpatch's own function)."""
    seen: list[torch.dtype] = []

    def spy(where, sources, shape, dtype, read):
        seen.append(dtype)
        return fill(where, sources, shape, dtype, read)

    monkeypatch.setattr(engine, "fill", spy)
    return seen


@pytest.mark.parametrize(
    "kwargs, dtype",
    [
        ({}, torch.float32),
        ({"dtype": torch.bfloat16}, torch.bfloat16),
        ({"dtype": torch.float16, "device_map": "cpu"}, torch.float16),
    ],
)
def test_fused_qkv_load_fills_the_parameter_dtype_with_the_values_of_cat_then_cast(llama, fills, kwargs, dtype):
    folder, ck = llama
    with get_recipe("llama-fused-qkv").apply():
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    layers = model.config.num_hidden_layers
    assert fills == [dtype] * layers  # one output per layer, allocated in the parameter's dtype
    state = model.state_dict()
    for name, value in expected_fused(state, ck).items():
        assert state[name].dtype == dtype, name
        assert torch.equal(state[name], value.to(dtype)), name  # q/k/v rows, each rounded once like Tensor.to


def test_placement_recognises_placing_operations_only():
    assert placement(QKV_RULE, patterns=3, modules=1) == Placement(0, None)
    stacked = WeightConverter(
        ["experts.*.gate_proj", "experts.*.up_proj"], "experts.gate_up_proj", [MergeModulelist(0), Concatenate(1)]
    )
    assert placement(stacked, patterns=2, modules=4) == Placement(1, 0)
    assert placement(QKV_RULE, patterns=3, modules=2) is None  # Concatenate of module lists is not a single block each
    for operations in ([Concatenate(0), Transpose(0, 1)], [MergeModulelist(0)]):
        assert placement(WeightConverter(["a", "b"], "c", operations), patterns=2, modules=1) is None, operations
    assert placement(WeightConverter("a", ["b", "c"], [Chunk(0)]), patterns=1, modules=1) is None

    class Doubling(Concatenate):
        def convert(self, input_dict, **kwargs):  # overrides convert: not a placement any more
            return {k: 2 * v for k, v in super().convert(input_dict, **kwargs).items()}

    assert placement(WeightConverter(["a", "b"], "c", [Doubling(0)]), patterns=2, modules=1) is None


def test_stacked_fill_equals_merge_then_concatenate():
    generator = torch.Generator().manual_seed(1)
    experts, inter, hidden = 3, 4, 5
    state = {
        f"mlp.experts.{e}.{part}.weight": torch.randn(inter, hidden, generator=generator)
        for e in range(experts)
        for part in ("gate_proj", "up_proj")
    }
    rule = WeightConverter(
        ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
        "mlp.experts.gate_up_proj",
        [MergeModulelist(1), Concatenate(2)],
    )
    plan = build_plan(state.items(), [rule])
    (group,) = plan.groups.values()
    where = placement(rule, len(group.sources), experts)
    assert where == Placement(2, 1)
    sources = [[obj for _, obj in group.sources[p]] for p in rule.source_patterns]
    out, read = fill(where, sources, (inter, experts, 2 * hidden), torch.float32, lambda t: t)
    gate = torch.stack([state[f"mlp.experts.{e}.gate_proj.weight"] for e in range(experts)], dim=1)
    up = torch.stack([state[f"mlp.experts.{e}.up_proj.weight"] for e in range(experts)], dim=1)
    assert torch.equal(out, torch.cat([gate, up], dim=2))
    assert len(read) == 2 * experts
    (converted,) = plan.convert_all().values()  # the generic path gives the same tensor
    assert torch.equal(converted, out)


def test_sources_of_different_dtypes_take_the_generic_path_and_promote_like_cat():
    generator = torch.Generator().manual_seed(2)
    prefix = "model.layers.0.self_attn."
    state = {
        prefix + "q_proj.weight": torch.randn(8, 4, generator=generator),
        prefix + "k_proj.weight": torch.randn(4, 4, generator=generator).to(torch.bfloat16),
        prefix + "v_proj.weight": torch.randn(4, 4, generator=generator),
    }
    plan = build_plan(state.items(), [QKV_RULE])
    dry = plan.dry_run()
    (name,) = dry
    lazy = plan.lazy_outputs(dry, cast={name: torch.float16})
    (group,) = plan.groups.values()
    assert engine._fused_output(group, [(name, dry[name][0], dry[name][1])], {}) is None
    tensor = lazy[name][...]
    assert tensor.dtype == torch.float32  # promoted, not cast: the consumer casts as it would any tensor
    assert torch.equal(tensor, torch.cat([state[prefix + p + "_proj.weight"].float() for p in "qkv"]))


def test_a_source_that_does_not_fit_its_block_is_refused_naming_both_shapes():
    with pytest.raises(ConversionError, match=r"\(3, 4\) does not fit its block \(3, 5\)"):
        fill(Placement(0, None), [[torch.ones(2, 5)], [torch.ones(3, 4)]], (5, 5), torch.float32, lambda t: t)
    with pytest.raises(ConversionError, match="overflow the 4 places along dim 0"):
        fill(Placement(0, None), [[torch.ones(2, 5)], [torch.ones(3, 5)]], (4, 5), torch.float32, lambda t: t)
    with pytest.raises(ConversionError, match="fill 4 of the 5 places along dim 0"):
        fill(Placement(0, None), [[torch.ones(2, 5)], [torch.ones(2, 5)]], (5, 5), torch.float32, lambda t: t)


STACKED = {f"e.{i}.{part}": (3, 5) for i in range(4) for part in ("g", "u")}


@pytest.mark.parametrize(
    "shapes, operations",
    [
        ({"a.q": (8, 4), "a.k": (4, 4), "a.v": (4, 4)}, [Concatenate(0)]),
        ({"a.q": (8, 4), "a.k": (8, 2), "a.v": (8, 6)}, [Concatenate(-1)]),
        ({"a.q": (8,), "a.k": (4,), "a.v": (4,)}, [Concatenate(0)]),
        (STACKED, [MergeModulelist(1), Concatenate(2)]),
        (STACKED, [MergeModulelist(-1), Concatenate(0)]),
    ],
)
def test_dry_run_shapes_of_placements_are_those_of_the_operations_on_meta(shapes, operations):
    sources = ["e.*.g", "e.*.u"] if shapes is STACKED else ["q", "k", "v"]
    rule = WeightConverter(sources, "fused", operations)
    state = {key: torch.zeros(shape) for key, shape in shapes.items()}
    plan = build_plan(state.items(), [rule])
    (group,) = plan.groups.values()
    fast = engine._placed_output(group)
    collected = {p: [torch.empty(t.shape, device="meta") for _, t in items] for p, items in group.sources.items()}
    on_meta = engine._run_group(group, collected, None, with_names=False)
    assert fast == [(k, tuple(t.shape), t.dtype) for k, t in on_meta.items()]


def test_placements_that_do_not_fit_are_left_to_the_operations_error():
    state = {"a.q_proj": torch.zeros(8, 4), "a.k_proj": torch.zeros(4, 5), "a.v_proj": torch.zeros(4, 4)}
    plan = build_plan(state.items(), [QKV_RULE])
    assert [engine._placed_output(g) for g in plan.groups.values()] == [None]
    with pytest.raises(
        ConversionError, match=r"Concatenate\(dim=0\) of .* failed on 'a.qkv_proj'.*Expected 4 in dimension 1"
    ):
        plan.dry_run()
