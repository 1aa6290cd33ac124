"""The command line with patches files written as scripts for Transformers' own registries are (registrations at
import, Transformers' rule classes, helper modules beside the file), converted and broken checkpoint folders, and the small things
(``--version``, ``--help`` text, messages).

Every test runs the real ``modelpatch.cli.main`` on tiny real checkpoints (llama, hidden 64, 2 layers, GQA, q/k/v
biases) saved once per module.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import sys
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers import conversion_mapping as transformers_conversion
from transformers.models.llama.modeling_llama import LlamaAttention

from helpers import one_line_error
from modelpatch import apply_patches, get_patch_mapping, register_patch_mapping
from modelpatch.cli import main
from modelpatch.cli.inputs import model_inputs
from modelpatch.conversion import registry as conversion_registry
from recipes_support import save_case, tensors

SCALE = 1.5


class ScaledAttention(LlamaAttention):
    """The patch under test in several files: attention output times ``SCALE`` (changes the logits)."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * SCALE, weights


SCALED_CLASS = f"""
from transformers.models.llama.modeling_llama import LlamaAttention

class ScaledAttention(LlamaAttention):
    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * {SCALE}, weights
"""

# the script way: registrations at import, Transformers' rule classes, a helper module beside the file
SCRIPT_STYLE = """
from transformers import Concatenate, WeightConverter
from modelpatch import register_checkpoint_conversion_mapping, register_patch_mapping
from {helper} import MyAttention

register_patch_mapping(mapping={{"LlamaAttention": MyAttention}})
register_checkpoint_conversion_mapping(
    model_type_or_class_name="llama",
    mapping=[WeightConverter(source_patterns=["q_proj", "k_proj", "v_proj"], target_patterns=["qkv_proj"],
                             operations=[Concatenate(dim=0)])],
    overwrite=True,
)
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return save_case("llama-fused-qkv", tmp_path_factory.mktemp("llama") / "ck")


@pytest.fixture(scope="module")
def expected_scaled_diff(llama) -> float:
    """Max abs difference of the logits that ``ScaledAttention`` really causes, on the input verify uses."""
    inputs, _ = model_inputs(llama, AutoConfig.from_pretrained(llama))
    vanilla = AutoModelForCausalLM.from_pretrained(llama).eval()
    with apply_patches({"LlamaAttention": ScaledAttention}):
        scaled = AutoModelForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        return float((scaled(**inputs).logits - vanilla(**inputs).logits).abs().max())


def write(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return str(path)


def run_json(capsys, argv) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, json.loads(captured.out)


def user_conversion_names() -> set[str]:
    with conversion_registry._lock:
        return set(conversion_registry._global)


# -- defect: patches registered at import patched the reference load too (false PASS) ---------------------------


@pytest.mark.parametrize("style", ["registers", "defines and registers"])
def test_registered_patch_that_changes_the_outputs_fails(style, llama, expected_scaled_diff, tmp_path, capsys):
    """``register_patch_mapping`` at import used to patch the reference load as well: "max abs diff 0", PASS."""
    body = SCALED_CLASS + "\nfrom modelpatch import register_patch_mapping\n"
    body += "register_patch_mapping({'LlamaAttention': ScaledAttention})\n"
    if style == "defines and registers":
        body += "PATCH_MAPPING = {'LlamaAttention': ScaledAttention}\n"
    patches = write(tmp_path / "scaled.py", body)
    code, report = run_json(capsys, ["verify", "--model", llama, "--patches", patches, "--no-progress"])
    assert code == 1 and report["ok"] is False
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["patches"]["ok"] and checks["patches"]["detail"] == "2 module(s) replaced"
    assert checks["outputs"]["ok"] is False
    assert expected_scaled_diff > 0.05
    assert report["output"]["max_abs_diff"] == pytest.approx(expected_scaled_diff, rel=1e-5)
    assert f"max abs diff of logits {expected_scaled_diff:.3g}" in checks["outputs"]["detail"]
    assert get_patch_mapping() == {}  # what the file registered is gone again


def test_script_style_file_passes_and_leaves_the_process_as_it_was(llama, tmp_path, capsys):
    """Registrations at import + Transformers' WeightConverter/Concatenate + a helper module beside the file."""
    write(
        tmp_path / "patches" / "script_helpers_a.py",
        "from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention as MyAttention\n",
    )
    patches = write(tmp_path / "patches" / "script_style.py", SCRIPT_STYLE.format(helper="script_helpers_a"))
    path_before = list(sys.path)
    code, report = run_json(capsys, ["verify", "--model", llama, "--patches", patches, "--no-progress"])
    assert code == 0, report["checks"]
    assert report["rules_that_matched_nothing"] == []
    assert report["output"]["max_abs_diff"] <= 1e-5
    loads = sorted(r["target_keys"][0] for r in report["conversion_report"] if r["direction"] == "load")
    assert loads == [f"model.layers.{i}.self_attn.qkv_proj.{p}" for i in (0, 1) for p in ("bias", "weight")]
    provenance = next(c["detail"] for c in report["checks"] if c["name"] == "provenance")
    assert provenance == f"all {len(report['provenance'])} parameters from the checkpoint"  # not "17/17"
    # the process is left as it was: registries, sys.path, the helper module
    assert get_patch_mapping() == {} and user_conversion_names() == set()
    assert sys.path == path_before
    assert [name for name in sys.modules if name.startswith(("script_helpers", "modelpatch_patches_"))] == []


def test_reference_load_ignores_what_the_caller_registered(llama, capsys):
    """In-process, a registration made before ``main()`` is out of force during the command and back after it."""
    register_patch_mapping({"LlamaAttention": ScaledAttention})
    code, report = run_json(capsys, ["verify", "--model", llama, "--recipe", "llama-fused-qkv", "--no-progress"])
    assert code == 0, report["checks"]
    assert report["output"]["max_abs_diff"] <= 1e-5
    assert get_patch_mapping() == {"LlamaAttention": ScaledAttention}


def test_explain_takes_what_the_file_registers(tmp_path, capsys):
    patches = write(
        tmp_path / "scaled.py",
        SCALED_CLASS + "\nfrom modelpatch import register_patch_mapping\n"
        "register_patch_mapping({'LlamaAttention': ScaledAttention})\n",
    )
    code, report = run_json(capsys, ["explain", "--model-type", "llama", "--patches", patches])
    assert code == 0
    layers = LlamaConfig().num_hidden_layers  # --model-type: the default config
    assert report["replaced"] == {"LlamaAttention": {"LlamaAttention -> ScaledAttention": layers}}
    assert get_patch_mapping() == {}


def test_a_file_that_defines_and_registers_nothing_is_an_error(tmp_path, capsys):
    patches = write(tmp_path / "nothing.py", "import modelpatch\nX = 1\n")
    err = one_line_error(capsys, ["explain", "--model-type", "llama", "--patches", patches])
    assert f"{patches} defines no PATCH_MAPPING dict (or RECIPE) and registers nothing" in err


def test_registrations_into_transformers_own_registries_are_refused_and_undone(tmp_path, capsys):
    """Transformers applies its own registries to every load, the reference included: refused, and undone."""
    patches = write(
        tmp_path / "transformers_registry.py",
        """
        from transformers import Concatenate, WeightConverter
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        register_checkpoint_conversion_mapping("llama", [WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"],
                                                                         [Concatenate(dim=0)])], overwrite=True)
    """,
    )
    users_before = set(transformers_conversion.USER_REGISTERED_MAPPINGS)
    try:
        err = one_line_error(capsys, ["explain", "--model-type", "llama", "--patches", patches])
    finally:
        leaked = set(transformers_conversion.USER_REGISTERED_MAPPINGS) - users_before
        for name in leaked:  # keep later tests clean even when this one fails
            transformers_conversion.USER_REGISTERED_MAPPINGS.discard(name)
            transformers_conversion._checkpoint_conversion_mapping_cache.pop(name, None)
    assert "registers into Transformers' own registries (register_checkpoint_conversion_mapping('llama'))" in err
    assert "from modelpatch import register_patch_mapping, register_checkpoint_conversion_mapping" in err
    assert leaked == set() and transformers_conversion.get_checkpoint_conversion_mapping("llama") is None


# -- defect: Transformers' rule classes counted as "matched no checkpoint key" -----------------------------------

TRANSFORMERS_RULE = 'WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])'


@pytest.mark.parametrize("form", ["CONVERSION_RULES", "RECIPE"])
def test_transformers_rule_classes_count_as_matched(form, llama, tmp_path, capsys):
    header = (
        "from transformers.core_model_loading import WeightConverter, Concatenate\n"
        "from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention\n"
    )
    if form == "CONVERSION_RULES":
        body = (
            "PATCH_MAPPING = {'LlamaAttention': FusedQKVLlamaAttention}\n"
            f"CONVERSION_RULES = {{'llama': [{TRANSFORMERS_RULE}]}}\n"
        )
    else:
        body = (
            "from modelpatch.recipes import Recipe, RuleSpec\n"
            "RECIPE = Recipe('mine', 'fused qkv', {'LlamaAttention': FusedQKVLlamaAttention},\n"
            f"                {{'llama': RuleSpec(lambda: [{TRANSFORMERS_RULE}])}})\n"
        )
    patches = write(tmp_path / "rules.py", header + body)
    code, report = run_json(capsys, ["verify", "--model", llama, "--patches", patches, "--no-progress"])
    assert code == 0, report["checks"]
    assert report["rules_that_matched_nothing"] == []
    assert len([r for r in report["conversion_report"] if r["direction"] == "load"]) == 4  # 2 layers x weight, bias


def test_convert_with_transformers_rule_classes(llama, tmp_path, capsys):
    patches = write(
        tmp_path / "rules.py",
        "from transformers import WeightConverter, Concatenate\n"
        "from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention\n"
        "PATCH_MAPPING = {'LlamaAttention': FusedQKVLlamaAttention}\n"
        f"CONVERSION_RULES = {{'llama': [{TRANSFORMERS_RULE}]}}\n",
    )
    fused, back = tmp_path / "fused", tmp_path / "back"
    assert main(["convert", llama, str(fused), "--patches", patches]) == 0
    assert main(["convert", str(fused), str(back), "--patches", patches, "--reverse"]) == 0
    original, converted, restored = tensors(llama), tensors(fused), tensors(back)
    assert torch.equal(
        converted["model.layers.1.self_attn.qkv_proj.bias"],
        torch.cat([original[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]),
    )
    assert sorted(restored) == sorted(original) and all(torch.equal(restored[k], original[k]) for k in original)
    assert "converted" in capsys.readouterr().out


# -- defect: a helper module beside the patches file was not importable -------------------------------------------


def test_helper_module_beside_the_file(tmp_path, capsys):
    """Imported at the top of the file and, later, inside the replacement's ``__init__`` (while the model is built)."""
    write(
        tmp_path / "pkg" / "beside_helpers_b.py",
        """
        from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention

        class MyAttention(FusedQKVLlamaAttention):
            def __init__(self, *args, **kwargs):
                from beside_helpers_c import SUFFIX  # imported late, while the model is built
                super().__init__(*args, **kwargs)
                self.suffix = SUFFIX
    """,
    )
    write(tmp_path / "pkg" / "beside_helpers_c.py", "SUFFIX = 'late import ok'\n")
    patches = write(
        tmp_path / "pkg" / "uses_helper.py",
        "from beside_helpers_b import MyAttention\nPATCH_MAPPING = {'LlamaAttention': MyAttention}\n",
    )
    path_before = list(sys.path)
    code, report = run_json(capsys, ["explain", "--model-type", "llama", "--patches", patches])
    assert code == 0
    assert report["replaced"] == {"LlamaAttention": {"LlamaAttention -> MyAttention": LlamaConfig().num_hidden_layers}}
    assert sys.path == path_before
    assert "beside_helpers_b" not in sys.modules and "beside_helpers_c" not in sys.modules


# -- defect: verify on a folder written by `modelpatch convert` ---------------------------------------------------


def test_verify_explain_and_convert_on_a_converted_folder_say_so(llama, tmp_path, capsys):
    fused = str(tmp_path / "fused")
    assert main(["convert", llama, fused, "--recipe", "llama-fused-qkv"]) == 0
    capsys.readouterr()
    err = one_line_error(capsys, ["verify", "--model", fused, "--recipe", "llama-fused-qkv", "--no-progress"])
    assert f"'{fused}' is already in the converted layout of llama-fused-qkv" in err
    assert "(it has 'model.layers.0.self_attn.qkv_proj.bias' and no key matching self_attn.q_proj" in err
    # q/k/v weight+bias x 2 layers, and the example is one of them
    assert (
        "the unpatched reference load would leave 12 parameter(s) random (e.g. 'model.layers.0.self_attn.k_proj" in err
    )
    assert (
        f"verify the original checkpoint instead, or write it back first with `modelpatch convert {fused} OUT "
        "--recipe llama-fused-qkv --reverse`" in err
    )
    # explain is verify's plan: the same one-line error and exit status, from the headers alone
    assert one_line_error(capsys, ["explain", "--model", fused, "--recipe", "llama-fused-qkv"]) == err
    # convert says it too, and writes nothing
    again = tmp_path / "again"
    err = one_line_error(capsys, ["convert", fused, str(again), "--recipe", "llama-fused-qkv"])
    assert err == (
        f"modelpatch: error: '{fused}' is already in the converted layout of llama-fused-qkv (it has "
        "'model.layers.0.self_attn.qkv_proj.bias' and no key matching self_attn.q_proj, self_attn.k_proj, "
        f"self_attn.v_proj); nothing was written. To write it back to the original layout: `modelpatch convert "
        f"{fused} DST --recipe llama-fused-qkv --reverse`"
    )
    assert not again.exists()


def test_a_tied_checkpoint_is_not_in_a_converted_layout(tmp_path, capsys):
    """User trial: a valid qwen2_moe checkpoint with ``tie_word_embeddings=True`` (no ``lm_head.weight`` in the
    file) made explain exit 2, "already in the converted layout ... leave 1 parameter(s) random (e.g.
    'lm_head.weight')", while verify passed it. A tied key is not missing (Transformers ties it on load), and a
    missing key the converter's sources do not name never makes a folder "already converted"."""
    from transformers import Qwen2MoeForCausalLM

    from helpers import save_tiny, tiny_qwen2_moe_config
    from modelpatch.cli.checkpoint import read_config
    from modelpatch.cli.plan import static_findings
    from modelpatch.cli.verify import converted_layout_error, converted_layout_rule
    from modelpatch.recipes import get_recipe

    folder = str(tmp_path / "tied")
    save_tiny(Qwen2MoeForCausalLM, tiny_qwen2_moe_config(tie_word_embeddings=True), folder)
    assert "lm_head.weight" not in tensors(folder) and "model.embed_tokens.weight" in tensors(folder)
    config = read_config(folder)
    for name in ("qwen2_moe-linear-experts", "qwen2_moe-full-example"):
        _, findings = static_findings(get_recipe(name), config, folder)
        assert (findings.vanilla_missing, findings.missing, findings.unexpected) == ([], [], [])
        code, report = run_json(capsys, ["explain", "--model", folder, "--recipe", name])
        assert code == 0 and report["problems"] == {"patches": [], "loading": []}
        assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    # verify agrees: the same checkpoint passes
    code, report = run_json(
        capsys, ["verify", "--model", folder, "--recipe", "qwen2_moe-linear-experts", "--no-progress"]
    )
    assert code == 0 and report["ok"] is True
    assert report["loading"]["missing_keys"] == [] and report["loading"]["unexpected_keys"] == []
    # the per-expert keys are the target layout of the fused-experts converter, whose source the file lacks ...
    recipe = get_recipe("qwen2_moe-linear-experts")
    assert converted_layout_rule(folder, recipe, config) == (
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "experts.gate_up_proj",
    )
    # ... but only a missing key that converter would have provided blames the layout
    assert converted_layout_rule(folder, recipe, config, missing=["lm_head.weight"]) is None
    assert converted_layout_error(folder, recipe, config, {"missing_keys": {"lm_head.weight"}}, "--recipe x") is None
    missing = {"lm_head.weight", "model.layers.1.mlp.experts.down_proj"}
    assert converted_layout_error(folder, recipe, config, {"missing_keys": missing}, "--recipe x") == (
        f"'{folder}' is already in the converted layout of qwen2_moe-linear-experts (it has "
        "'model.layers.0.mlp.experts.0.down_proj.weight' and no key matching experts.down_proj), so the unpatched "
        "reference load would leave 2 parameter(s) random (e.g. 'model.layers.1.mlp.experts.down_proj') and nothing "
        f"can be compared; verify the original checkpoint instead, or write it back first with `modelpatch convert "
        f"{folder} OUT --recipe x --reverse` and verify OUT"
    )


def test_from_pretrained_ties_what_the_static_analysis_does_not_count_missing():
    """:func:`reported_missing` decides as ``tie_weights(missing_keys=...)`` and ``_keys_to_ignore_on_load_missing``
    do in ``from_pretrained``."""
    from transformers import Qwen2MoeForCausalLM

    from helpers import tiny_qwen2_moe_config
    from modelpatch.cli.plan import reported_missing

    with torch.device("meta"):
        tied = Qwen2MoeForCausalLM(tiny_qwen2_moe_config(tie_word_embeddings=True))
        untied = Qwen2MoeForCausalLM(tiny_qwen2_moe_config(tie_word_embeddings=False))
    assert tied.all_tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    assert reported_missing(tied, {head}) == set()  # filled from the embeddings
    assert reported_missing(tied, {embed}) == set()  # the head in the file fills the embeddings
    assert reported_missing(tied, {head, embed}) == {head, embed}  # nothing to tie to
    given = {head, "model.norm.weight"}
    assert reported_missing(tied, given) == {"model.norm.weight"} and given == {head, "model.norm.weight"}
    assert untied.all_tied_weights_keys == {} and reported_missing(untied, {head}) == {head}
    untied._keys_to_ignore_on_load_missing = {r"\.norm\."}
    assert reported_missing(untied, {head, "model.norm.weight"}) == {head}


# -- defect: patches that break the KV cache, the attention mask or the load got PASS (or exit 2) ------------------

# exact on one unpadded forward (the "outputs" check passes), wrong on the paths users run
BAD_ATTENTION = {
    # the cache is never written: decoding attends to the new token only
    # (the cache comes as past_key_values on Transformers 5.23, as cache on 5.24 and later)
    "ignores past_key_values": """
        class BadAttention(LlamaAttention):
            def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
                kwargs.pop("past_key_values", None), kwargs.pop("cache", None)
                return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)
    """,
    # the keys are cached before the rotary embedding (this step's own keys are rotated): position 0 (no rotation)
    # agrees, position 1 does not
    "caches unrotated keys": """
        import torch
        import transformers.models.llama.modeling_llama as llama
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        class BadAttention(LlamaAttention):
            def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
                cache = kwargs.pop("cache", None)
                cache = kwargs.pop("past_key_values", None) if cache is None else cache
                shape = (*hidden_states.shape[:-1], -1, self.head_dim)
                q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
                k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
                v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
                q, rotated = llama.apply_rotary_pos_emb(q, k, *position_embeddings)
                if cache is not None:
                    k, v = cache.update(k, v, self.layer_idx)  # appends the unrotated keys ...
                    rotated = torch.cat([k[:, :, : k.shape[2] - rotated.shape[2]], rotated], dim=2)
                attend = ALL_ATTENTION_FUNCTIONS.get_interface(
                    self.config._attn_implementation, llama.eager_attention_forward
                )
                out, weights = attend(self, q, rotated, v, attention_mask, scaling=self.scaling, **kwargs)
                return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights
    """,
    # no mask at all: SDPA falls back to is_causal, exact without padding
    "ignores the attention mask": """
        class BadAttention(LlamaAttention):
            def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
                return super().forward(hidden_states, position_embeddings, None, **kwargs)
    """,
}


def _bad_attention(tmp_path, name: str) -> str:
    body = "from transformers.models.llama.modeling_llama import LlamaAttention\n"
    body += textwrap.dedent(BAD_ATTENTION[name]) + "\nPATCH_MAPPING = {'LlamaAttention': BadAttention}\n"
    return write(tmp_path / "bad_attention.py", body)


@pytest.mark.parametrize("name", ["ignores past_key_values", "caches unrotated keys"])
def test_attention_that_mishandles_the_kv_cache_fails_the_cache_check(name, llama, tmp_path, capsys):
    argv = ["verify", "--model", llama, "--patches", _bad_attention(tmp_path, name), "--no-progress"]
    code, report = run_json(capsys, [*argv, "--checks", "padding,cache", "--new-tokens", "2"])
    assert code == 1 and report["ok"] is False
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["outputs"]["ok"] and checks["padding"]["ok"]  # one forward cannot tell
    assert checks["outputs"]["detail"] == "max abs diff of logits 0 (atol 1e-05)"
    paths = {p["name"]: p for p in report["paths"]}
    dynamic, static = paths["cache (dynamic)"], paths["cache (static)"]
    assert dynamic["status"] == static["status"] == "FAIL" and not checks["cache (dynamic)"]["ok"]
    if name == "ignores past_key_values":
        # the dynamic cache holds the tokens fed (the last new token is not)
        assert dynamic["detail"] == "prefill: layer 0 keys not cached, unpatched (2, 2, 12, 16)"
        assert dynamic["first_divergence"] == {"layer": 0, "step": 0}
        # a static cache never written: the decode step's mask (the whole cache) does not fit its keys
        assert static["detail"].startswith("the patched model's generate fails with a static cache: RuntimeError: ")
    else:
        for cache in (dynamic, static):
            assert cache["detail"].startswith("prefill: layer 0 keys differ by ")
            assert cache["detail"].endswith("; first: row 0, token 1, layer 0")
            assert cache["first_divergence"] == {"row": 0, "token": 1, "layer": 0, "step": 0}
            assert cache["figure"] > 0.01


def test_a_cache_corrupted_by_a_decode_step_is_blamed_on_that_step(llama, tmp_path, capsys):
    """A decode step that overwrites the prompt's first cached keys: the cache compared after decoding was labelled
    "prefill" (its position is a prompt token), though the prefill's cache was right. Each step's cache is compared
    as that step left it."""
    patches = write(
        tmp_path / "decode_corrupts.py",
        """
        from transformers.models.llama.modeling_llama import LlamaAttention

        class DecodeCorrupts(LlamaAttention):
            def forward(self, hidden_states, *args, **kwargs):
                out = super().forward(hidden_states, *args, **kwargs)
                cache = kwargs.get("cache", kwargs.get("past_key_values"))  # the name of Transformers >= 5.24, 5.23
                if hidden_states.shape[1] == 1 and self.layer_idx == 1:
                    cache.layers[1].keys[:, :, :4] += 1.0  # after the step's attention: its logits are exact
                return out

        PATCH_MAPPING = {"LlamaAttention": DecodeCorrupts}
        """,
    )
    argv = ["verify", "--model", llama, "--patches", patches, "--no-progress", "--checks", "cache"]
    code, report = run_json(capsys, [*argv, "--new-tokens", "2"])
    assert code == 1
    for cache in report["paths"]:
        assert cache["detail"].startswith("decode step 1: layer 1 keys differ by "), cache
        assert cache["first_divergence"] == {"row": 0, "token": 0, "layer": 1, "step": 1}


def test_a_hybrid_models_linear_attention_state_is_compared_and_named(tmp_path, capsys):
    """Qwen3-Next (linear attention, then attention): a patch whose linear attention caches a wrong conv state
    (its own output right) was blamed on the next attention layer's keys at decode step 1; every state the cache
    holds is compared now, and the first diverging one is named: layer 0's conv state, written by the prefill."""
    from routing_models import tiny_model

    tiny_model("qwen3_next").save_pretrained(tmp_path / "qwen3_next")
    patches = write(
        tmp_path / "bad_conv_state.py",
        """
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        class BadConvState(Qwen3NextGatedDeltaNet):
            def forward(self, hidden_states, *args, **kwargs):
                out = super().forward(hidden_states, *args, **kwargs)
                cache = kwargs.get("cache_params", kwargs.get("cache"))  # 5.23 names it cache_params, 5.24+ cache
                if cache is not None and hidden_states.shape[1] > 1:
                    if hasattr(cache, "get_conv_state"):  # 5.24+
                        cache.get_conv_state(self.layer_idx, state_idx=0).mul_(1.5)
                    else:
                        cache.layers[self.layer_idx].conv_states[0].mul_(1.5)
                return out

        PATCH_MAPPING = {"Qwen3NextGatedDeltaNet": BadConvState}
        """,
    )
    argv = ["verify", "--model", str(tmp_path / "qwen3_next"), "--patches", patches, "--no-progress"]
    capsys.readouterr()  # what the save printed (DeepSpeed logs to stdout when a save first imports it)
    code, report = run_json(capsys, [*argv, "--checks", "cache", "--new-tokens", "2"])
    assert code == 1
    dynamic = {p["name"]: p for p in report["paths"]}["cache (dynamic)"]
    assert dynamic["detail"].startswith("prefill: layer 0 conv_states[0] differ by "), dynamic
    assert dynamic["first_divergence"] == {"row": 0, "layer": 0, "step": 0}


def test_attention_that_raises_on_decode_steps_fails_not_crashes(llama, tmp_path, capsys):
    """A replacement without decode support (it raises once the cache holds tokens): the one-forward checks pass,
    the decoding checks fail with its message; exit 1, no traceback."""
    patches = write(
        tmp_path / "prefill_only.py",
        """
        from transformers.models.llama.modeling_llama import LlamaAttention

        class PrefillOnlyAttention(LlamaAttention):
            def forward(self, hidden_states, *args, **kwargs):
                cache = kwargs.get("cache", kwargs.get("past_key_values"))  # the name of Transformers >= 5.24, 5.23
                if cache is not None and cache.get_seq_length(self.layer_idx) > 0:
                    raise NotImplementedError("decoding with a KV cache")
                return super().forward(hidden_states, *args, **kwargs)

        PATCH_MAPPING = {"LlamaAttention": PrefillOnlyAttention}
        """,
    )
    argv = ["verify", "--model", llama, "--patches", patches, "--no-progress", "--checks", "padding,cache,generate"]
    code, report = run_json(capsys, argv)
    assert code == 1
    status = {c["name"]: (c["status"], c["detail"]) for c in report["checks"]}
    assert status["outputs"][0] == status["padding"][0] == "ok"
    error = "NotImplementedError: decoding with a KV cache"
    for kind in ("dynamic", "static"):
        assert status[f"cache ({kind})"] == ("FAIL", f"the patched model's generate fails with a {kind} cache: {error}")
    assert status["generate"] == ("FAIL", f"the patched model's generate fails: {error}")


def test_attention_that_always_raises_fails_the_outputs_check(llama, tmp_path, capsys):
    patches = write(
        tmp_path / "raising_forward.py",
        """
        from transformers.models.llama.modeling_llama import LlamaAttention

        class NotYetAttention(LlamaAttention):
            def forward(self, *args, **kwargs):
                raise RuntimeError("not implemented yet")

        PATCH_MAPPING = {"LlamaAttention": NotYetAttention}
        """,
    )
    argv = ["verify", "--model", llama, "--patches", patches, "--no-progress", "--checks", "padding,routing"]
    code, report = run_json(capsys, argv)
    assert code == 1
    status = {c["name"]: (c["status"], c["detail"]) for c in report["checks"]}
    assert status["outputs"] == ("FAIL", "the patched model's forward fails: RuntimeError: not implemented yet")
    assert status["padding"] == (
        "FAIL",
        "the patched model fails on a left-padded batch: RuntimeError: not implemented yet",
    )
    assert status["routing"] == ("skipped", "LlamaForCausalLM has no MoE router")  # a dense model, whatever the patch
    assert status["round trip"][0] == "ok"


def test_attention_that_ignores_the_mask_fails_the_padding_check(llama, tmp_path, capsys):
    patches = _bad_attention(tmp_path, "ignores the attention mask")
    argv = ["verify", "--model", llama, "--patches", patches, "--no-progress", "--checks", "padding"]
    code, report = run_json(capsys, argv)
    assert code == 1
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["outputs"]["ok"] and [p["name"] for p in report["paths"]] == ["padding"]
    padding = report["paths"][0]
    # row 1 is left-padded by 4 (12 -> 8 tokens): its first real token attends the pads
    assert padding["status"] == "FAIL" and padding["first_divergence"] == {"row": 1, "token": 4}
    assert checks["padding"]["detail"] == (
        f"max abs diff of logits at 20 non-pad positions {padding['figure']:.3g} (atol 1e-05; 4 left pad(s)); first "
        "beyond atol: row 1, token 4"
    )


def test_one_new_token_decodes_nothing_so_the_cache_checks_are_skipped(llama, tmp_path, capsys):
    """--new-tokens 1 runs the prefill only: an attention that drops the mask on decode steps passed the cache
    checks ("prefill 12 + 0 decode step(s)", exit 0); with no decode step they are skipped, never ok."""
    patches = write(
        tmp_path / "decode_without_mask.py",
        """
        from transformers.models.llama.modeling_llama import LlamaAttention

        class DecodeWithoutMask(LlamaAttention):
            def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
                if hidden_states.shape[1] == 1:
                    attention_mask = None
                return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

        PATCH_MAPPING = {"LlamaAttention": DecodeWithoutMask}
        """,
    )
    argv = ["verify", "--model", llama, "--patches", patches, "--no-progress", "--checks", "cache"]
    _, report = run_json(capsys, [*argv, "--new-tokens", "1"])
    paths = {p["name"]: p for p in report["paths"]}
    for kind in ("dynamic", "static"):
        assert paths[f"cache ({kind})"]["status"] == "skipped"
        assert "no decode step: --new-tokens 1" in paths[f"cache ({kind})"]["detail"]
    code, report = run_json(capsys, [*argv, "--new-tokens", "2"])
    assert code == 1 and {p["name"]: p["status"] for p in report["paths"]}["cache (dynamic)"] == "FAIL"


def test_round_trip_fails_when_the_save_writes_keys_a_plain_load_drops(llama, tmp_path, capsys):
    """A replacement with a parameter of its own: the save writes self_attn.gain, which a plain Transformers load
    drops as unexpected; the state dicts after that load agree, yet the round trip is not bit-exact."""
    patches = write(
        tmp_path / "gain.py",
        """
        import torch
        from torch import nn
        from transformers.models.llama.modeling_llama import LlamaAttention

        class GainAttention(LlamaAttention):
            def __init__(self, config, layer_idx):
                super().__init__(config, layer_idx)
                self.gain = nn.Parameter(torch.ones(1))

        PATCH_MAPPING = {"LlamaAttention": GainAttention}
        """,
    )
    code, report = run_json(capsys, ["verify", "--model", llama, "--patches", patches, "--no-progress"])
    assert code == 1
    trip = report["round_trip"]
    assert trip["bit_exact"] is False
    assert trip["first_difference"].startswith("a plain load of the save reports keys the checkpoint's load does not")
    assert "model.layers.0.self_attn.gain" in trip["first_difference"]


WIDE_ATTENTION = """
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention

class WideAttention(LlamaAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size + 8, bias=False)

PATCH_MAPPING = {"LlamaAttention": WideAttention}
"""

GATED_ATTENTION = """
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention

class GatedAttention(LlamaAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.gate = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * self.gate, weights

PATCH_MAPPING = {"LlamaAttention": GatedAttention}
"""

UNFIRED_RULE = """
from modelpatch.conversion import Concatenate, WeightConverter, WeightRenaming
from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention

PATCH_MAPPING = {"LlamaAttention": FusedQKVLlamaAttention}
CONVERSION_RULES = {"llama": [
    WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], operations=[Concatenate(dim=0)]),
    WeightRenaming("attn_old", "self_attn"),  # a layout this checkpoint is not in
]}
"""

BROKEN_INIT = """
from transformers.models.llama.modeling_llama import LlamaAttention

class BrokenAttention(LlamaAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        raise ValueError("no fused projection for " + type(config).__name__)

PATCH_MAPPING = {"LlamaAttention": BrokenAttention}
"""


def test_a_replacement_that_cannot_be_built_fails_verify_and_explain(llama, tmp_path, capsys):
    """A patch whose replacement raises while the model is built: a FAIL of the patch (exit 1), not a traceback."""
    patches = write(tmp_path / "broken_init.py", BROKEN_INIT)
    words = "the patched model cannot be built: ValueError: no fused projection for LlamaConfig"
    code, plan = run_json(capsys, ["explain", "--model", llama, "--patches", patches])
    assert code == 1 and plan["problems"] == {"patches": [words], "loading": []}
    code, report = run_json(capsys, ["verify", "--model", llama, "--patches", patches, "--no-progress"])
    assert code == 1
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["patches"] == {"name": "patches", "ok": False, "status": "FAIL", "detail": words}
    assert (
        checks["loading"]["ok"] is False
        and "ValueError: no fused projection for LlamaConfig" in checks["loading"]["detail"]
    )
    assert {c["status"] for name, c in checks.items() if name not in ("patches", "loading")} == {"skipped"}


PLAN_CASES = {
    "shapes the checkpoint cannot fill": (
        WIDE_ATTENTION,
        "mismatched_keys: model.layers.0.self_attn.o_proj.weight has (64, 64) in the checkpoint, (72, 64) in the "
        "patched model; model.layers.1.self_attn.o_proj.weight has (64, 64) in the checkpoint, (72, 64) in the "
        "patched model",
    ),
    "a parameter left at init": (
        GATED_ATTENTION,
        "missing_keys (left at their initial values): ['model.layers.0.self_attn.gate', 'model.layers.1.self_attn.gate']",
    ),
    "a rule that cannot fire": (
        UNFIRED_RULE,
        "rules that matched no checkpoint key: [\"WeightRenaming(source_patterns=['attn_old'], "
        "target_patterns=['self_attn'])\"]",
    ),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_explain_fails_what_verify_fails_in_the_same_words(case, llama, tmp_path, capsys):
    """What the headers and the meta model show: explain exits 1 with verify's words; a load that raises (the
    shapes) is a FAIL of the patch (exit 1, naming key and shapes), not a bad argument (exit 2)."""
    body, words = PLAN_CASES[case]
    patches = write(tmp_path / "plan_case.py", body)
    code, plan = run_json(capsys, ["explain", "--model", llama, "--patches", patches])
    assert code == 1 and plan["problems"] == {"patches": [], "loading": [words]}
    code, report = run_json(
        capsys, ["verify", "--model", llama, "--patches", patches, "--no-progress", "--checks", "none"]
    )
    assert code == 1
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["patches"] == {"name": "patches", "ok": True, "status": "ok", "detail": "2 module(s) replaced"}
    assert checks["loading"]["ok"] is False and checks["loading"]["detail"] == words
    if case == "shapes the checkpoint cannot fill":
        assert plan["mismatched_keys"][0] == {
            "key": "model.layers.0.self_attn.o_proj.weight", "checkpoint_shape": [64, 64], "model_shape": [72, 64]
        }  # fmt: skip
        # the JSON's "loading" carries the failure (it was {}): the key and both shapes
        assert report["loading"]["failed"] is True and report["loading"]["mismatched_keys"] == plan["mismatched_keys"]
        assert report["loading"]["error"].startswith("RuntimeError: ")  # Transformers' own words
        skipped = {name: c["detail"] for name, c in checks.items() if c["status"] == "skipped"}
        assert skipped == dict.fromkeys(["provenance", "outputs", "round trip"], "the patched load failed")
    assert get_patch_mapping() == {} and user_conversion_names() == set()


def test_explain_lists_the_rules_of_a_sub_model(llama, tmp_path, capsys):
    """Rules registered under a sub-model's class name were in force but not listed (only the model type's)."""
    patches = write(
        tmp_path / "sub_model_rules.py",
        """
        from modelpatch.conversion import Concatenate, WeightConverter
        from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention
        PATCH_MAPPING = {"LlamaAttention": FusedQKVLlamaAttention}
        CONVERSION_RULES = {"LlamaModel": [WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"],
                                                           operations=[Concatenate(dim=0)])]}
        """,
    )
    code, plan = run_json(capsys, ["explain", "--model", llama, "--patches", patches])
    assert code == 0 and plan["problems"] == {"patches": [], "loading": []}
    [rule] = plan["conversion_rules"]
    assert rule["registered_as"] == "LlamaModel" and len(rule["checkpoint_keys"]) == 12  # q/k/v x weight/bias x 2


WRONG_MODEL_TYPE = """
from modelpatch.conversion import Concatenate, WeightConverter
from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention
PATCH_MAPPING = {"LlamaAttention": FusedQKVLlamaAttention}
CONVERSION_RULES = {"mistral": [WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"],
                                                operations=[Concatenate(dim=0)])]}
"""
OTHER_TYPE = (
    "conversion rules are registered for 'mistral' and none for the checkpoint's model type 'llama': they never "
    "apply to it (register them under 'llama')"
)


@pytest.mark.parametrize("command", ["explain", "verify", "convert"])
def test_rules_registered_for_another_model_type_are_named(command, llama, tmp_path, capsys):
    """Rules registered under a real but wrong model type ('mistral' for a llama checkpoint) never apply: every
    command said only what followed (missing/unexpected keys, 'no conversion rules in effect'), naming neither."""
    patches = write(tmp_path / "wrong_model_type.py", WRONG_MODEL_TYPE)
    if command == "convert":
        assert one_line_error(capsys, ["convert", llama, str(tmp_path / "out"), "--patches", patches]).endswith(
            f"; {OTHER_TYPE}"
        )
        return
    argv = [command, "--model", llama, "--patches", patches]
    code, report = run_json(capsys, argv + (["--no-progress", "--checks", "none"] if command == "verify" else []))
    assert code == 1 and report["rules_of_other_model_types"] == OTHER_TYPE
    if command == "explain":
        assert report["problems"]["loading"][-1] == OTHER_TYPE
    else:
        assert {c["name"]: c for c in report["checks"]}["loading"]["detail"].endswith(f"; {OTHER_TYPE}")


# -- defect: tracebacks instead of one-line errors ------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(llama, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sharded") / "ck"
    AutoModelForCausalLM.from_pretrained(llama).save_pretrained(path, max_shard_size="100KB")
    return str(path)


def _shards(folder) -> list[str]:
    with open(os.path.join(folder, "model.safetensors.index.json")) as fh:
        return sorted(set(json.load(fh)["weight_map"].values()))


@pytest.mark.parametrize("command", ["explain", "verify"])
def test_index_naming_a_missing_shard(command, sharded, tmp_path, capsys):
    broken = shutil.copytree(sharded, tmp_path / "broken")
    shards = _shards(broken)
    assert len(shards) > 1
    os.remove(broken / shards[1])
    err = one_line_error(capsys, [command, "--model", str(broken), "--recipe", "llama-fused-qkv"])
    assert f"'{broken / 'model.safetensors.index.json'}' names shard '{shards[1]}', which is not in '{broken}'" in err


def test_index_without_metadata(sharded, tmp_path, capsys):
    """Transformers reads ``index["metadata"]``: this used to end in ``KeyError: 'metadata'``."""
    broken = shutil.copytree(sharded, tmp_path / "broken")
    index = broken / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": json.loads(index.read_text())["weight_map"]}))
    err = one_line_error(capsys, ["verify", "--model", str(broken), "--recipe", "llama-fused-qkv"])
    assert f"'{index}' has no \"metadata\" dict" in err


def test_explain_on_a_truncated_safetensors_file(llama, tmp_path, capsys):
    broken = shutil.copytree(llama, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    err = one_line_error(capsys, ["explain", "--model", str(broken), "--recipe", "llama-fused-qkv"])
    assert f"'{weights}' is not a readable safetensors file (truncated or corrupt?)" in err


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_unusable_cache_folder(where, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    cache = blocker if where == "a file" else blocker / "cache"
    monkeypatch.setenv("MODELPATCH_CACHE", str(cache))
    err = one_line_error(capsys, ["verify", "--no-progress"])
    assert f"cache folder '{cache}' (MODELPATCH_CACHE)" in err and "set MODELPATCH_CACHE to a writable folder" in err


# -- clearer messages -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["CONVERSION_RULES", "registration"])
def test_operation_class_instead_of_instance(where, tmp_path, capsys):
    rule = 'WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate])'
    body = (
        "from transformers import WeightConverter, Concatenate\n"
        "from modelpatch import register_checkpoint_conversion_mapping\n"
        "from modelpatch.recipes.fused_qkv import FusedQKVLlamaAttention\n"
        "PATCH_MAPPING = {'LlamaAttention': FusedQKVLlamaAttention}\n"
    )
    body += (
        f"CONVERSION_RULES = {{'llama': [{rule}]}}\n"
        if where == "CONVERSION_RULES"
        else f"register_checkpoint_conversion_mapping('llama', [{rule}])\n"
    )
    patches = write(tmp_path / "op_class.py", body)
    err = one_line_error(capsys, ["explain", "--model-type", "llama", "--patches", patches])
    assert (
        "operation transformers.core_model_loading.Concatenate is a class, not an instance: write "
        "operations=[Concatenate(dim=0)] instead of operations=[Concatenate]"
    ) in err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"modelpatch {importlib.metadata.version('modelpatch')}"


@pytest.mark.parametrize("command", [[], ["verify"], ["explain"], ["convert"], ["recipes"]])
def test_help_has_no_rest_markup(command, capsys):
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: modelpatch")
    assert "``" not in out and not re.search(r":[a-z]+:`", out), out
