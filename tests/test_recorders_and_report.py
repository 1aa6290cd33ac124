"""Output recorders follow replacements per instance; patch_report and its warnings."""

import copy
import logging
import pickle

import pytest
import torch
import torch.nn as nn
from transformers import (
    BertModel,
    LlamaForCausalLM,
    LlamaModel,
    Qwen2MoeForCausalLM,
    Qwen2MoeModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.bert import modeling_bert
from transformers.models.llama import modeling_llama
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe
from transformers.utils.output_capturing import OutputRecorder

from helpers import INPUT_IDS, save_tiny, tiny_bert_config, tiny_llama_config, tiny_qwen2_moe_config
from modelpatch import (
    UnmatchedPatchKeyError,
    apply_patches,
    patch_report,
    register_output_recorder,
    register_patch_mapping,
    set_strict_patching,
    unregister_output_recorder,
)
from modelpatch.errors import ModelpatchTypeError


class SubclassAttention(modeling_llama.LlamaAttention):
    pass


class StandaloneAttention(nn.Module):
    """Not a subclass: same parameters and math as LlamaAttention, computed by a private copy."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.impl = modeling_llama.LlamaAttention(config, layer_idx)

    def forward(self, *args, **kwargs):
        return self.impl(*args, **kwargs)


class StandaloneDecoderLayer(nn.Module):
    """Not a subclass, does not wrap the original: a from-scratch layer (identity with a Linear)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states + self.proj(hidden_states)


class StandaloneRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        logits = nn.functional.linear(hidden_states, self.weight)
        probs = logits.softmax(-1)
        values, indices = probs.topk(self.top_k, dim=-1)
        return logits, values, indices


def eager(config):
    config._attn_implementation = "eager"
    return config


@pytest.mark.parametrize("replacement", [SubclassAttention, StandaloneAttention])
def test_attentions_captured_for_replacements(replacement):
    with apply_patches({"LlamaAttention": replacement}):
        model = LlamaModel(eager(tiny_llama_config()))
    out = model(INPUT_IDS, output_attentions=True)
    assert len(out.attentions) == 2
    assert out.attentions[0].shape == (1, 4, INPUT_IDS.shape[1], INPUT_IDS.shape[1])


def test_hidden_states_captured_for_non_subclass_layer():
    with apply_patches({"LlamaDecoderLayer": StandaloneDecoderLayer}):
        model = LlamaModel(tiny_llama_config())
    out = model(INPUT_IDS, output_hidden_states=True)
    assert len(out.hidden_states) == 3  # embeddings + one per layer
    # later unpatched model of the same class: unaffected, one entry per layer, no extra recorder
    vanilla = LlamaModel(tiny_llama_config())
    assert len(vanilla(INPUT_IDS, output_hidden_states=True).hidden_states) == 3


def test_router_logits_captured_for_non_subclass_router():
    with apply_patches({"Qwen2MoeTopKRouter": StandaloneRouter}):
        model = Qwen2MoeModel(tiny_qwen2_moe_config())
    out = model(INPUT_IDS, output_router_logits=True)
    assert len(out.router_logits) == 2
    assert torch.equal(out.router_logits[0], torch.zeros(INPUT_IDS.shape[1], 4))  # zero weights -> zero logits


def test_class_attribute_never_mutated():
    before = dict(modeling_qwen2_moe.Qwen2MoeModel._can_record_outputs)
    with apply_patches({"Qwen2MoeTopKRouter": StandaloneRouter}):
        Qwen2MoeModel(tiny_qwen2_moe_config())
    assert modeling_qwen2_moe.Qwen2MoeModel._can_record_outputs == before


@pytest.mark.parametrize(
    "spec",
    [
        modeling_llama.LlamaAttention,
        OutputRecorder(modeling_llama.LlamaAttention, index=1),
        [OutputRecorder(modeling_llama.LlamaAttention, index=1)],
    ],
    ids=["class", "OutputRecorder", "list"],
)
def test_every_recorder_spec_form_follows_replacement(spec, monkeypatch):
    monkeypatch.setattr(
        modeling_llama.LlamaModel,
        "_can_record_outputs",
        {
            "hidden_states": modeling_llama.LlamaDecoderLayer,
            "attentions": spec,
        },
    )
    with apply_patches({"LlamaAttention": StandaloneAttention}):
        model = LlamaModel(eager(tiny_llama_config()))
    # StandaloneAttention wraps the original, so the inner original is captured exactly once per layer
    assert len(model(INPUT_IDS, output_attentions=True).attentions) == 2


def test_register_output_recorder_survives_other_builds():
    model = Qwen2MoeModel(tiny_qwen2_moe_config())
    register_output_recorder(model, "selected_experts", OutputRecorder(modeling_qwen2_moe.Qwen2MoeTopKRouter, index=2))
    Qwen2MoeModel(tiny_qwen2_moe_config())  # building another model resets Transformers' per-class entry
    seen = []
    model.layers[1].mlp.gate.register_forward_hook(lambda module, args, output: seen.append(output[2]))
    out = model(INPUT_IDS, output_selected_experts=True)
    assert len(out.selected_experts) == 2
    assert out.selected_experts[0].shape == (INPUT_IDS.shape[1], 2)
    assert torch.equal(out.selected_experts[1], seen[0])


def test_register_output_recorder_errors():
    model = Qwen2MoeModel(tiny_qwen2_moe_config())
    with pytest.raises(ValueError, match="identifier"):
        register_output_recorder(model, "not valid", modeling_qwen2_moe.Qwen2MoeTopKRouter)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        register_output_recorder(nn.Linear(1, 1), "x", modeling_qwen2_moe.Qwen2MoeTopKRouter)
    with pytest.raises(TypeError, match="OutputRecorder"):
        register_output_recorder(model, "x", "not a class")


def test_report_rows_and_unmatched_warning(tmp_path, caplog):
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    register_patch_mapping({"LlamaAttention": SubclassAttention, "NoSuchClass": StandaloneAttention})
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        model = LlamaForCausalLM.from_pretrained(tmp_path)
    assert "'NoSuchClass'" in caplog.text
    report = patch_report(model)
    assert [(r.path, r.original, r.replacement, r.key) for r in report.rows] == [
        (f"model.layers.{i}.self_attn", modeling_llama.LlamaAttention, SubclassAttention, "LlamaAttention")
        for i in range(2)
    ]
    assert report.unmatched_keys == ["NoSuchClass"]
    assert "model.layers.0.self_attn" in str(report)
    assert patch_report(LlamaModel(tiny_llama_config())).rows == []


def test_strict_block_and_registry_wide_strict(tmp_path):
    with pytest.raises(UnmatchedPatchKeyError, match="NoSuchClass"):
        with apply_patches({"LlamaAttention": SubclassAttention, "NoSuchClass": StandaloneAttention}, strict=True):
            LlamaModel(tiny_llama_config())
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path)
    register_patch_mapping({"NoSuchClass": StandaloneAttention})
    set_strict_patching(True)
    with pytest.raises(UnmatchedPatchKeyError, match="NoSuchClass"):
        LlamaForCausalLM.from_pretrained(tmp_path)
    set_strict_patching(False)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    assert type(model.model.layers[0].self_attn) is modeling_llama.LlamaAttention


class BroadAttention(nn.Module):
    def __init__(self, config, *args, **kwargs):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, *args, **kwargs):
        return (self.proj(hidden_states), None)


def test_bert_container_conflict_warns_before_model_is_returned(caplog):
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        with apply_patches({".*Attention": BroadAttention}) as scope:
            model = BertModel(tiny_bert_config())
    assert "BertAttention" in caplog.text and "BertSelfAttention" in caplog.text
    assert type(model.encoder.layer[0].attention) is BroadAttention
    report = patch_report(model)
    pairs = {(c.container, c.inner) for c in report.conflicts}
    assert (modeling_bert.BertAttention, modeling_bert.BertSelfAttention) in pairs
    assert scope.fired == {".*Attention": 2}


def test_narrow_pattern_has_no_conflict(caplog):
    class SelfAttn(modeling_bert.BertSelfAttention):
        pass

    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        with apply_patches({".*SelfAttention$": SelfAttn}):
            model = BertModel(tiny_bert_config())
    assert caplog.text == ""
    assert type(model.encoder.layer[0].attention.self) is SelfAttn
    assert patch_report(model).conflicts == []


def test_user_recorder_follows_a_non_subclass_replacement():
    """A user recorder targeting the original class captures from its non-subclass replacement (found by a
    fresh-user test: it returned an empty tuple while the built-in router_logits followed the replacement)."""
    from transformers import Qwen2MoeModel
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    from modelpatch import OutputRecorder, register_output_recorder

    class ReimplementedRouter(nn.Module):
        def __init__(self, config):
            super().__init__()
            reference = Qwen2MoeTopKRouter(config)
            self.top_k, self.num_experts = reference.top_k, reference.num_experts
            self.norm_topk_prob, self.hidden_dim, self.weight = (
                reference.norm_topk_prob,
                reference.hidden_dim,
                reference.weight,
            )

        def forward(self, hidden_states):
            return Qwen2MoeTopKRouter.forward(self, hidden_states)

    config = tiny_qwen2_moe_config()
    with apply_patches({"Qwen2MoeTopKRouter": ReimplementedRouter}):
        patched = Qwen2MoeModel(config)
    vanilla = Qwen2MoeModel(config)
    vanilla.load_state_dict(patched.state_dict())
    ids = torch.tensor([[1, 5, 9, 17]])
    captured = {}
    for label, model in (("patched", patched), ("vanilla", vanilla)):
        register_output_recorder(model, "selected_experts", OutputRecorder(Qwen2MoeTopKRouter, index=2))
        captured[label] = model(ids, output_selected_experts=True).selected_experts
    assert len(captured["patched"]) == config.num_hidden_layers
    assert all(torch.equal(p, v) for p, v in zip(captured["patched"], captured["vanilla"]))


# -- registration, overwrite, class-level recorders, copies -----------------------------------------------------------


class QuietMLP(modeling_llama.LlamaMLP):
    pass


def eager_llama():
    config = tiny_llama_config()
    config._attn_implementation = "eager"
    return LlamaModel(config)


def modelpatch_hooks(model) -> int:
    """How many forward hooks defined by modelpatch (user output recorders' hooks) ``model`` holds."""
    return sum(
        type(hook).__module__.startswith("modelpatch") for m in model.modules() for hook in m._forward_hooks.values()
    )


def test_builtin_recorder_name_is_rejected():
    model = eager_llama()
    for name in ("hidden_states", "attentions"):
        with pytest.raises(ValueError, match=name):
            register_output_recorder(model, name, modeling_llama.LlamaMLP)
    assert len(model(INPUT_IDS, output_hidden_states=True).hidden_states) == 3


def test_reregistering_needs_overwrite_and_replaces_hooks():
    model = eager_llama()
    register_output_recorder(model, "x", OutputRecorder(modeling_llama.LlamaMLP, index=0))
    assert [t.shape for t in model(INPUT_IDS, output_x=True).x] == [(1, 8, 64)] * 2
    with pytest.raises(ValueError, match="overwrite"):
        register_output_recorder(model, "x", OutputRecorder(modeling_llama.LlamaAttention, index=1))
    register_output_recorder(model, "x", OutputRecorder(modeling_llama.LlamaAttention, index=1), overwrite=True)
    assert [t.shape for t in model(INPUT_IDS, output_x=True).x] == [(1, 4, 8, 8)] * 2
    assert modelpatch_hooks(model) == 2  # one per attention layer; the MLP hooks were removed
    unregister_output_recorder(model, "x")
    assert "x" not in model(INPUT_IDS, output_x=True)  # asked for, but no longer registered: nothing captured
    assert modelpatch_hooks(model) == 0  # unregistering removed the hooks it installed, exactly
    with pytest.raises(KeyError):
        unregister_output_recorder(model, "x")


def test_class_level_recorder_reaches_instances_already_used():
    used = eager_llama()
    used(INPUT_IDS, output_hidden_states=True)  # Transformers installs its hooks now

    class MyLlama(LlamaModel):
        pass

    register_output_recorder(LlamaModel, "mlp_out", OutputRecorder(modeling_llama.LlamaMLP, index=0))
    try:
        assert len(used(INPUT_IDS, output_mlp_out=True).mlp_out) == 2
        assert len(eager_llama()(INPUT_IDS, output_mlp_out=True).mlp_out) == 2
    finally:
        unregister_output_recorder(LlamaModel, "mlp_out")
    assert "mlp_out" not in used(INPUT_IDS, output_mlp_out=True)  # asked for: the class entry is gone
    assert "mlp_out" not in eager_llama()(INPUT_IDS, output_mlp_out=True)


def test_recorders_and_report_survive_deepcopy_and_pickle():
    with apply_patches({"LlamaMLP": QuietMLP, "LlamaMLq": QuietMLP}):
        model = LlamaModel(tiny_llama_config())
    register_output_recorder(model, "mlp_out", OutputRecorder(QuietMLP, index=0))
    clones = (copy.deepcopy(model), pickle.loads(pickle.dumps(model)))  # before Transformers' own hooks exist
    expected = model(INPUT_IDS, output_mlp_out=True).mlp_out
    for clone in clones:
        got = clone(INPUT_IDS, output_mlp_out=True).mlp_out
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, expected))
        report = patch_report(clone)
        assert [r.path for r in report.rows] == ["layers.0.mlp", "layers.1.mlp"]
        assert report.unmatched_keys == ["LlamaMLq"]


# -- a recorder registered on a head model ----------------------------------------------------------------------------


def _tiny_qwen3_moe_config():
    return Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=128,
    )


@pytest.mark.parametrize(
    "head_cls, config_fn, router_cls",
    [
        (Qwen2MoeForCausalLM, tiny_qwen2_moe_config, modeling_qwen2_moe.Qwen2MoeTopKRouter),
        (Qwen3MoeForCausalLM, _tiny_qwen3_moe_config, modeling_qwen3_moe.Qwen3MoeTopKRouter),
    ],
    ids=["qwen2_moe", "qwen3_moe"],
)
def test_head_model_returns_a_recorder_registered_on_it(head_cls, config_fn, router_cls):
    torch.manual_seed(0)
    lm = head_cls(config_fn()).eval()
    register_output_recorder(lm, "selected_experts", OutputRecorder(router_cls, index=2))
    with torch.no_grad():
        out = lm(INPUT_IDS, output_selected_experts=True)
        base = lm.model(INPUT_IDS, output_selected_experts=True)
        as_tuple = lm(INPUT_IDS, output_selected_experts=True, return_dict=False)
        plain = lm(INPUT_IDS)
    assert len(base.selected_experts) == 2
    assert len(out.selected_experts) == 2  # one (tokens, top_k) tensor per layer, as the base model captures
    assert [t.shape for t in out.selected_experts] == [torch.Size([INPUT_IDS.shape[1], 2])] * 2
    assert all(torch.equal(a, b) for a, b in zip(out.selected_experts, base.selected_experts))
    assert torch.equal(out.logits, plain.logits)
    assert "selected_experts" not in plain  # not requested: no field
    # return_dict=False: the tuple comes last, as to_tuple() places a new field
    assert len(as_tuple) == len(plain.to_tuple()) + 1
    assert all(torch.equal(a, b) for a, b in zip(as_tuple[-1], base.selected_experts))


def test_head_recorder_survives_deepcopy_and_is_removed_by_unregister():
    torch.manual_seed(0)
    lm = Qwen2MoeForCausalLM(tiny_qwen2_moe_config()).eval()
    register_output_recorder(lm, "selected_experts", OutputRecorder(modeling_qwen2_moe.Qwen2MoeTopKRouter, index=2))
    clone = copy.deepcopy(lm)
    with torch.no_grad():
        expected = lm(INPUT_IDS, output_selected_experts=True).selected_experts
        got = clone(INPUT_IDS, output_selected_experts=True).selected_experts
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, expected))
    unregister_output_recorder(lm, "selected_experts")
    assert (len(lm._forward_pre_hooks), len(lm._forward_hooks)) == (0, 0)
    with torch.no_grad():
        assert "selected_experts" not in lm(INPUT_IDS, output_selected_experts=True)


def test_head_class_registration_is_refused_with_the_fix_named():
    with pytest.raises(ModelpatchTypeError, match=r"register on a model instance .* or on the class of the base model"):
        register_output_recorder(Qwen2MoeForCausalLM, "selected_experts", modeling_qwen2_moe.Qwen2MoeTopKRouter)
    with pytest.raises(TypeError, match="Qwen2MoePreTrainedModel does not capture outputs itself"):
        register_output_recorder(
            modeling_qwen2_moe.Qwen2MoePreTrainedModel, "selected_experts", modeling_qwen2_moe.Qwen2MoeTopKRouter
        )


def test_the_conversion_report_of_a_copy_names_each_rules_registry_entry(tmp_path):
    """The conversion state keys its rules' registry names by ``id(rule)``: a deepcopied or pickled model reported
    ``registered_as=None`` for every row of its save. The names travel with the rules."""
    from modelpatch.conversion import conversion_report
    from modelpatch.recipes import get_recipe

    save_tiny(modeling_qwen2_moe.Qwen2MoeForCausalLM, tiny_qwen2_moe_config(), tmp_path / "ck")
    with get_recipe("qwen2_moe-full-example").apply():
        model = modeling_qwen2_moe.Qwen2MoeForCausalLM.from_pretrained(tmp_path / "ck")
    loaded = [(r.rule, r.registered_as) for r in conversion_report(model)]
    assert loaded and {name for _, name in loaded} == {"qwen2_moe"}
    for number, clone in enumerate((copy.deepcopy(model), pickle.loads(pickle.dumps(model)))):
        assert [(r.rule, r.registered_as) for r in conversion_report(clone)] == loaded
        clone.save_pretrained(tmp_path / f"clone{number}")
        saved = [r for r in conversion_report(clone) if r.direction == "save"]
        assert saved and {r.registered_as for r in saved} == {"qwen2_moe"}
