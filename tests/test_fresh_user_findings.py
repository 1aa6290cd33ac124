"""Inputs a fresh user tried that failed: each kept as a test."""

import json

import pytest
import torch.nn as nn
from transformers import LlamaForCausalLM, LlamaModel
from transformers.models.llama.modeling_llama import LlamaAttention

from helpers import save_tiny, tiny_llama_config
from modelpatch import Concatenate, WeightConverter, apply_patches
from modelpatch.cli import main
from modelpatch.errors import ModelpatchTypeError
from modelpatch.recipes import Recipe
from modelpatch.recipes.attention import FusedQKVLlamaAttention

QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])


def test_recipe_takes_a_plain_list_of_rules(tmp_path, capsys):
    """``Recipe(conversion={"llama": [rule]})`` crashed with AttributeError at apply/register and a traceback in the
    CLI; a list is the form CONVERSION_RULES takes."""
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path / "ck")
    (tmp_path / "recipe_style.py").write_text(
        "from modelpatch import Concatenate, WeightConverter\n"
        "from modelpatch.recipes import Recipe\n"
        "from modelpatch.recipes.attention import FusedQKVLlamaAttention\n"
        "RECIPE = Recipe(name='mine', description='x', patch_mapping={'LlamaAttention': FusedQKVLlamaAttention},\n"
        "                conversion={'llama': [WeightConverter(['q_proj', 'k_proj', 'v_proj'], ['qkv_proj'],\n"
        "                                                       [Concatenate(dim=0)])]})\n"
    )
    assert main(["verify", "--model", str(tmp_path / "ck"), "--patches", str(tmp_path / "recipe_style.py")]) == 0
    recipe = Recipe("mine", "x", {"LlamaAttention": FusedQKVLlamaAttention}, conversion={"llama": [QKV]})
    first, second = recipe.build_conversion_rules()["llama"], recipe.build_conversion_rules()["llama"]
    assert len(first) == 1 and first[0] is not second[0] and first[0] is not QKV  # fresh copies per application
    with pytest.raises(ModelpatchTypeError, match=r"conversion\['llama'\] must be a RuleSpec or a list"):
        Recipe("bad", "x", {"LlamaAttention": FusedQKVLlamaAttention}, conversion={"llama": QKV})


def test_verify_json_is_strict_json_when_the_outputs_are_nan(tmp_path, capsys):
    save_tiny(LlamaForCausalLM, tiny_llama_config(), tmp_path / "ck")
    (tmp_path / "nan.py").write_text(
        "from transformers.models.llama.modeling_llama import LlamaAttention\n"
        "from modelpatch import register_patch_mapping\n"
        "class NanAttention(LlamaAttention):\n"
        "    def forward(self, *a, **k):\n"
        "        out, w = super().forward(*a, **k)\n"
        "        return out * float('nan'), w\n"
        "register_patch_mapping({'LlamaAttention': NanAttention})\n"
    )
    capsys.readouterr()
    status = main(["verify", "--model", str(tmp_path / "ck"), "--patches", str(tmp_path / "nan.py"), "--json"])
    out = capsys.readouterr().out
    assert status == 1
    document = json.loads(out, parse_constant=lambda token: pytest.fail(f"non-standard JSON token {token}"))
    assert "NaN" in json.dumps(document)


def test_hint_never_suggests_the_key_itself(caplog):
    class Custom(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    with caplog.at_level("WARNING", logger="modelpatch"):
        with apply_patches({"Linear": Custom, "LlamaAttention": LlamaAttention}):
            LlamaModel(tiny_llama_config())
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "['Linear'] matched no class" in text  # the warning is there ...
    assert "did you mean 'Linear'" not in text  # ... without suggesting the key itself


def test_bad_chunk_sizes_and_a_truncated_trace_file_raise_modelpatch_errors(tmp_path):
    from modelpatch import Chunk
    from modelpatch.errors import ModelpatchError, ModelpatchValueError
    from modelpatch.routing import RoutingTrace, RoutingTraceError

    with pytest.raises(ModelpatchValueError, match=r"Chunk\(sizes='x'\)"):
        Chunk(dim=0, sizes="x")
    with pytest.raises(ModelpatchValueError, match="non-negative"):
        Chunk(dim=0, sizes=[64, -1])
    assert Chunk(dim=0, sizes=(64, 32, 32)).sizes == [64, 32, 32]
    truncated = tmp_path / "trace.safetensors"
    truncated.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(RoutingTraceError, match="cannot read a routing trace") as caught:
        RoutingTrace.load(truncated)
    assert isinstance(caught.value, ModelpatchError)
