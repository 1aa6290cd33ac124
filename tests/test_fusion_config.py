"""modelpatch beside Transformers' own fusions (``from_pretrained(..., fusion_config={"patch_embeddings": True})``,
``transformers.fusion_mapping``; present in 5.23, 5.24 and 5.25) and 5.25's ``apply_patches(mapping)``.

A fused load with patches or a recipe gives the fused classes and the patched ones, with the outputs of the plain
fused load; Transformers' fusion discovery never sees a modelpatch replacement, so its per-model-class cache (and,
before 5.25, the patch registry and conversion mapping it writes) end up exactly as a plain fused load leaves them;
a class both replaced and fused is refused; ``patch_report`` and ``explain`` list the fusions.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers
import transformers.conversion_mapping as tcm
import transformers.fusion_mapping as fm
import transformers.monkey_patching as tmp
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl import modeling_qwen2_vl as mq

from modelpatch import FusionConflictError, apply_patches, patch_report
from modelpatch.errors import ModelpatchError
from modelpatch.patching import UpstreamFusion
from modelpatch.patching.upstream import fused_original, fusion_available

FUSION = {"patch_embeddings": True}
_PIXELS = torch.randn(16, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(0))  # 16 patches of 2x2x2x3
_GRID = torch.tensor([[1, 4, 4]])


class _VisionMlp(mq.VisionMlp):
    """Same computation as the original: only the class changes."""


class _PatchEmbed(mq.PatchEmbed):
    pass


def _config() -> Qwen2VLConfig:
    text = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    text |= dict(num_key_value_heads=2, vocab_size=128)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2)
    vision |= dict(temporal_patch_size=2, spatial_merge_size=1, in_channels=3)
    return Qwen2VLConfig(text_config=text, vision_config=vision)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2_vl")
    Qwen2VLForConditionalGeneration(_config()).save_pretrained(path)
    return path


_UPSTREAM_DICTS = (
    (fm, "_FUSION_DISCOVERY_CACHE"),
    (fm, "_REGISTERED_FUSION_SOURCE_PATTERNS"),  # 5.23 / 5.24
    (tmp, "_monkey_patch_mapping_cache"),
    (tcm, "_checkpoint_conversion_mapping_cache"),
)


_BASELINE: list[tuple[dict, dict]] = []


@pytest.fixture(autouse=True)
def upstream_restored():
    """Transformers' own fused loads (before 5.25) register the fused classes and their conversion rules for good
    (every later build of the model class is then fused, fusion_config or not): give each test the same starting
    point and leave the process as it was."""
    _BASELINE[:] = [(d, dict(d)) for m, n in _UPSTREAM_DICTS if isinstance(d := getattr(m, n, None), dict)]
    yield
    _reset()


def _reset() -> None:
    """Transformers' caches and registries as they were before the test (a process with no fused load)."""
    for d, content in _BASELINE:
        d.clear()
        d.update(content)


def _upstream_state() -> dict:
    """What Transformers keeps between loads: the fusion discovery cache and, before 5.25, the patch registry and
    the conversion mapping a fused load writes, plus the modeling module's binding of the patch embedding."""

    def named(cls):
        return (cls.__name__, fused_original(cls))

    cache = {
        fusion: {model: {k: named(v) for k, v in found.items()} for model, found in per_model.items()}
        for fusion, per_model in fm._FUSION_DISCOVERY_CACHE.items()
    }
    registry = {k: named(v) for k, v in tmp.get_patch_mapping().items()}
    rules = [repr(r) for r in tcm.get_checkpoint_conversion_mapping("qwen2_vl") or []]
    return {"cache": cache, "registry": registry, "rules": rules, "binding": mq.PatchEmbed}


def _load(path, **kwargs):
    torch.manual_seed(0)  # what a load initialises (a key the checkpoint lacks) is the same in every load
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = Qwen2VLForConditionalGeneration.from_pretrained(path, **kwargs)
    (loaded[0] if isinstance(loaded, tuple) else loaded).eval()
    return loaded


# 5.25 builds the fused modules' conversion from the instances (get_fusion_weight_transforms); before, it registered
# a conversion that never matches this checkpoint: the fused projection is missing from the load (measured, without
# modelpatch imported too)
_UPSTREAM_FUSED_LOAD_EXACT = "config" in inspect.signature(transformers.PreTrainedModel.get_init_context).parameters


def _vision(model) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.visual(_PIXELS, grid_thw=_GRID)
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


def test_fusion_config_is_in_every_tested_release():
    # measured: 5.23.0, 5.24.0 and 5.25.0 all have fusion_config (5.25 reworked it: no global registration)
    assert fusion_available()
    assert "fusion_config" in inspect.signature(transformers.PreTrainedModel.from_pretrained).parameters
    assert set(fm._FUSION_REGISTRY) == {"patch_embeddings"}


def test_patches_on_a_fused_load_work_and_leave_upstream_as_a_plain_fused_load(checkpoint):
    plain = _load(checkpoint)
    fused, info = _load(checkpoint, fusion_config=FUSION, output_loading_info=True)
    after_plain_fused = _upstream_state()
    fused_cls = type(fused.model.visual.patch_embed)
    assert fused_cls.__name__ == "FusedPatchEmbed" and fused_original(fused_cls) is mq.PatchEmbed
    if _UPSTREAM_FUSED_LOAD_EXACT:
        assert (_vision(fused) - _vision(plain)).abs().max().item() <= 1e-5  # Transformers' Conv3d -> Linear
    else:
        assert info["missing_keys"] == {"model.visual.patch_embed.linear_proj.weight"}

    _reset()
    with apply_patches({"VisionMlp": _VisionMlp}):
        patched = _load(checkpoint, fusion_config=FUSION)
    assert _upstream_state() == after_plain_fused  # modelpatch's patch never reached Transformers' discovery
    assert type(patched.model.visual.patch_embed).__name__ == "FusedPatchEmbed"
    assert [type(b.mlp) for b in patched.model.visual.blocks] == [_VisionMlp, _VisionMlp]
    assert torch.equal(_vision(patched), _vision(fused))

    report = patch_report(patched)
    assert [(r.path, r.original, r.replacement) for r in report.rows] == [
        (f"model.visual.blocks.{i}.mlp", mq.VisionMlp, _VisionMlp) for i in range(2)
    ]
    fusion = report.upstream[0]
    assert report.upstream == [
        UpstreamFusion("model.visual.patch_embed", mq.PatchEmbed, fusion.fused, "patch_embeddings")
    ]
    assert fused_original(fusion.fused) is mq.PatchEmbed
    assert report.as_dict()["upstream"][0]["fusion"] == "patch_embeddings"
    assert "1 module(s) fused by Transformers (fusion_config)" in str(report)
    assert patch_report(plain).upstream == []


@pytest.mark.slow
def test_a_patch_of_the_fused_class_is_refused_and_later_fused_loads_stay_fused(checkpoint):
    reference = _vision(_load(checkpoint, fusion_config=FUSION))
    after_plain_fused = _upstream_state()

    _reset()  # the discovery runs inside the patched load (before: it cached {"_PatchEmbed": Fused_PatchEmbed})
    with apply_patches({"PatchEmbed": _PatchEmbed}):
        with pytest.raises(FusionConflictError, match=r"PatchEmbed is replaced both by modelpatch \(_PatchEmbed\)"):
            _load(checkpoint, fusion_config=FUSION)
    assert issubclass(FusionConflictError, ModelpatchError)
    assert _upstream_state() == after_plain_fused
    _reset()
    with apply_patches({"PatchEmbed": _PatchEmbed}):
        unfused = _load(checkpoint)  # without fusion_config the patch applies
    assert type(unfused.model.visual.patch_embed) is _PatchEmbed
    _reset()
    later = _load(checkpoint, fusion_config=FUSION)  # fused, as if modelpatch had never been there
    assert type(later.model.visual.patch_embed).__name__ == "FusedPatchEmbed"
    assert torch.equal(_vision(later), reference)


@pytest.mark.slow
def test_a_recipe_on_a_fused_load(tmp_path):
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    from modelpatch.recipes import get_recipe
    from modelpatch.recipes.linear_experts import LinearExperts
    from routing_models import tiny_config

    text = tiny_config("glm4v_moe_text", n_routed_experts=4).to_dict()
    vision = dict(depth=1, hidden_size=32, num_heads=2, patch_size=2, temporal_patch_size=2, spatial_merge_size=1)
    vision |= dict(out_hidden_size=64, intermediate_size=32, image_size=8)
    torch.manual_seed(0)
    Glm4vMoeForConditionalGeneration(Glm4vMoeConfig(text_config=text, vision_config=vision)).save_pretrained(tmp_path)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        fused = Glm4vMoeForConditionalGeneration.from_pretrained(tmp_path, fusion_config=FUSION).eval()
        state = _upstream_state()
        torch.manual_seed(0)
        with get_recipe("glm4v_moe-linear-experts").apply():
            both = Glm4vMoeForConditionalGeneration.from_pretrained(tmp_path, fusion_config=FUSION).eval()
    assert _upstream_state() == state
    assert type(both.model.visual.patch_embed) is type(fused.model.visual.patch_embed)
    assert type(both.model.visual.patch_embed).__name__ == "FusedGlm4vMoeVisionPatchEmbed"
    assert isinstance(both.model.language_model.layers[1].mlp.experts, LinearExperts)
    with torch.no_grad():
        assert (both(ids).logits - fused(ids).logits).abs().max().item() <= 1e-5
    assert [u.path for u in patch_report(both).upstream] == ["model.visual.patch_embed"]
    both.save_pretrained(tmp_path / "back")  # the recipe saves what it loaded, bit for bit
    from safetensors.torch import load_file

    saved, back = load_file(tmp_path / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(saved) == sorted(back) and all(torch.equal(saved[k], back[k]) for k in saved)


def test_explain_lists_transformers_fusions_and_the_conflicts(checkpoint):
    from modelpatch.cli.errors import CliError
    from modelpatch.cli.explain import explain
    from modelpatch.recipes import Recipe

    before = _upstream_state()
    recipe = Recipe("vision-mlp", "test", {"VisionMlp": _VisionMlp}, model_types=("qwen2_vl",))
    report = explain(recipe, model_dir=str(checkpoint), fusion_config=FUSION)
    assert report["upstream_fusions"] == [
        {
            "path": "model.visual.patch_embed",
            "original": "PatchEmbed",
            "replacement": "FusedPatchEmbed",
            "fusion": "patch_embeddings",
        }
    ]
    assert report["replaced"] == {"VisionMlp": {"VisionMlp -> _VisionMlp": 2}} and report["conflicts"] == []
    assert explain(recipe, model_dir=str(checkpoint))["upstream_fusions"] == []
    both = Recipe("patch-embed", "test", {"PatchEmbed": _PatchEmbed}, model_types=("qwen2_vl",))
    report = explain(both, model_dir=str(checkpoint), fusion_config=FUSION)
    assert report["upstream_fusions"] == []
    assert report["conflicts"] == [
        "model.visual.patch_embed: PatchEmbed is replaced by the recipe (_PatchEmbed) and fused by Transformers' "
        "'patch_embeddings': a load with fusion_config refuses it"
    ]
    # counted as what it is: a fusion conflict, not a container/inner one (a fresh-user finding)
    assert report["problems"]["patches"] == [
        "1 fusion conflict(s) (a class replaced by the patch and fused by Transformers)"
    ]
    with pytest.raises(CliError, match="Unknown fusion type: qkv"):
        explain(recipe, model_dir=str(checkpoint), fusion_config={"qkv": True})
    assert _upstream_state() == before  # a dry run: nothing of Transformers discovered or registered


def _classes(model) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules()}


def test_apply_patches_takes_a_mapping_as_transformers_does():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama as ml

    class Attention(ml.LlamaAttention):
        pass

    class Mlp(ml.LlamaMLP):
        pass

    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config.num_key_value_heads, config.vocab_size = 2, 64
    # exact names before patterns, patterns by re.search, a mapping used instead of the registry, {} a no-op, the
    # mapping positional (or by name) with None for "the registry"
    mapping = {"LlamaAttention": Attention, ".*Attention": Mlp, "MLP$": Mlp}
    ours = inspect.signature(apply_patches).parameters
    assert list(ours)[0] == "mapping" and ours["mapping"].default is None
    with apply_patches(mapping):
        built = _classes(LlamaForCausalLM(config))
    assert built["model.layers.1.self_attn"] == "Attention" and built["model.layers.1.mlp"] == "Mlp"
    with apply_patches(mapping={}):
        assert _classes(LlamaForCausalLM(config))["model.layers.1.mlp"] == "LlamaMLP"
    upstream = inspect.signature(tmp.apply_patches).parameters
    if "mapping" not in upstream:  # 5.23 / 5.24: Transformers' apply_patches() takes no mapping
        assert list(upstream) == []
        return
    assert list(upstream) == ["mapping"] and upstream["mapping"].default is None
    with tmp.apply_patches(mapping):
        assert _classes(LlamaForCausalLM(config)) == built
    with tmp.apply_patches({}):
        assert _classes(LlamaForCausalLM(config))["model.layers.1.mlp"] == "LlamaMLP"
    # the one difference, on purpose (modelpatch.patching.registry): an identifier key is an exact class name, where
    # Transformers also tries it as a pattern ("LlamaML" would hit LlamaMLP, "LlamaAttention" DiffLlamaAttention)
    with tmp.apply_patches({"LlamaML": Mlp}):
        assert _classes(LlamaForCausalLM(config))["model.layers.1.mlp"] == "Mlp"
    with apply_patches({"LlamaML": Mlp}):
        assert _classes(LlamaForCausalLM(config))["model.layers.1.mlp"] == "LlamaMLP"
