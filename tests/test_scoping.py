"""Scopes: patches apply where asked and nowhere else, and nothing is left behind on any exit path."""

import asyncio
import contextlib
import copy
import pickle
import sys
import threading

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM, LlamaModel
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention

from helpers import (
    INPUT_IDS,
    Inert,
    save_tiny,
    tiny_clip_vision_config,
    tiny_gpt_neo_config,
    tiny_gpt_neox_config,
    tiny_llama_config,
)
from modelpatch import (
    UnmatchedPatchKeyError,
    allow_init_values,
    apply_patches,
    get_patch_mapping,
    register_patch_mapping,
    replacement_of,
)
from modelpatch.errors import ModelpatchRuntimeError
from modelpatch.patching.interception import hooked_classes
from modelpatch.patching.scopes import active_scopes
from modelpatch.recipes import get_recipe

ORIGINAL_ATTENTION = modeling_llama.LlamaAttention
ORIGINAL_MLP = modeling_llama.LlamaMLP
ORIGINAL_ATTENTION_DICT = dict(vars(modeling_llama.LlamaAttention))


class DelegatingAttention(modeling_llama.LlamaAttention):
    """Subclass replacement that only delegates: outputs must be identical."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class WrappingAttention(nn.Module):
    """Non-subclass replacement that builds (and wraps) the original it replaces."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.inner = modeling_llama.LlamaAttention(config, layer_idx)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class OtherMLP(modeling_llama.LlamaMLP):
    pass


class FailingAttention(modeling_llama.LlamaAttention):
    def __init__(self, config, layer_idx):
        raise RuntimeError("replacement __init__ failed")


def attention_types(model):
    return (
        [type(layer.self_attn) for layer in model.model.layers]
        if hasattr(model, "model")
        else [type(layer.self_attn) for layer in model.layers]
    )


def assert_pristine():
    assert modeling_llama.LlamaAttention is ORIGINAL_ATTENTION
    assert modeling_llama.LlamaMLP is ORIGINAL_MLP
    assert active_scopes() == ()
    assert hooked_classes() == {}
    assert dict(vars(modeling_llama.LlamaAttention)) == ORIGINAL_ATTENTION_DICT
    model = LlamaModel(tiny_llama_config())
    assert set(attention_types(model)) == {ORIGINAL_ATTENTION}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny(LlamaForCausalLM, tiny_llama_config(), path)
    return path


def test_quick_start_from_pretrained(llama_dir):
    vanilla = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    register_patch_mapping({"LlamaAttention": DelegatingAttention})
    patched = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    assert attention_types(patched) == [DelegatingAttention, DelegatingAttention]
    with torch.no_grad():
        diff = (patched(INPUT_IDS).logits - vanilla(INPUT_IDS).logits).abs().max().item()
    assert diff == 0.0
    assert modeling_llama.LlamaAttention is ORIGINAL_ATTENTION


def test_concrete_class_from_pretrained_and_from_config(llama_dir):
    register_patch_mapping({"LlamaAttention": DelegatingAttention})
    assert attention_types(LlamaForCausalLM.from_pretrained(llama_dir)) == [DelegatingAttention] * 2
    assert attention_types(AutoModelForCausalLM.from_config(tiny_llama_config())) == [DelegatingAttention] * 2
    assert attention_types(LlamaModel._from_config(tiny_llama_config())) == [DelegatingAttention] * 2


def test_manual_construction_needs_a_block():
    register_patch_mapping({"LlamaAttention": DelegatingAttention})
    assert attention_types(LlamaModel(tiny_llama_config())) == [ORIGINAL_ATTENTION] * 2
    with apply_patches():
        inside = LlamaModel(tiny_llama_config())
    assert attention_types(inside) == [DelegatingAttention] * 2
    assert attention_types(LlamaModel(tiny_llama_config())) == [ORIGINAL_ATTENTION] * 2


def test_block_mapping_does_not_touch_registry():
    with apply_patches({"LlamaAttention": WrappingAttention}):
        model = LlamaModel(tiny_llama_config())
        assert get_patch_mapping() == {}
    assert attention_types(model) == [WrappingAttention] * 2
    # the replacement built the original it wraps, not itself again
    assert type(model.layers[0].self_attn.inner) is ORIGINAL_ATTENTION
    assert_pristine()


def test_block_mapping_beats_registry_inside_from_pretrained(llama_dir):
    register_patch_mapping({"LlamaAttention": DelegatingAttention})
    # WrappingAttention moves q/k/v/o under .inner without rules: a load of this checkpoint is refused unless the
    # init values are allowed (tests/test_initial_values.py); which class won is what this test is about
    with allow_init_values(), apply_patches({"LlamaAttention": WrappingAttention}):
        model = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert attention_types(model) == [WrappingAttention] * 2


def test_exception_inside_block_restores():
    with pytest.raises(KeyError):
        with apply_patches({"LlamaAttention": DelegatingAttention}):
            raise KeyError("boom")
    assert_pristine()


def test_out_of_order_exit_with_exitstack():
    outer = apply_patches({"LlamaAttention": DelegatingAttention})
    inner = apply_patches({"LlamaMLP": OtherMLP})
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # exit the outer first
    model = LlamaModel(tiny_llama_config())
    assert attention_types(model) == [ORIGINAL_ATTENTION] * 2
    assert type(model.layers[0].mlp) is OtherMLP
    inner.__exit__(None, None, None)
    assert_pristine()


def test_generators_interleaved():
    def gen(mapping):
        with apply_patches(mapping):
            yield LlamaModel(tiny_llama_config())
            yield LlamaModel(tiny_llama_config())

    a = gen({"LlamaAttention": DelegatingAttention})
    b = gen({"LlamaMLP": OtherMLP})
    first_a = next(a)
    first_b = next(b)
    assert attention_types(first_a) == [DelegatingAttention] * 2
    assert type(first_b.layers[0].mlp) is OtherMLP
    a.close()  # closes a's block while b's is still open
    second_b = next(b)
    assert attention_types(second_b) == [ORIGINAL_ATTENTION] * 2
    b.close()
    assert_pristine()


def test_nested_blocks_innermost_wins():
    with apply_patches({"LlamaAttention": DelegatingAttention}):
        with apply_patches({"LlamaAttention": WrappingAttention, "LlamaMLP": OtherMLP}):
            inner = LlamaModel(tiny_llama_config())
        outer = LlamaModel(tiny_llama_config())
    assert attention_types(inner) == [WrappingAttention] * 2
    assert type(inner.layers[0].mlp) is OtherMLP
    assert attention_types(outer) == [DelegatingAttention] * 2
    assert type(outer.layers[0].mlp) is ORIGINAL_MLP
    assert_pristine()


def test_scope_cannot_be_entered_twice():
    scope = apply_patches({"LlamaAttention": DelegatingAttention})
    with scope:
        with pytest.raises(RuntimeError, match="only once"):
            scope.__enter__()
    assert_pristine()


def test_failing_replacement_inside_from_pretrained_poisons_nothing(llama_dir):
    register_patch_mapping({"LlamaAttention": FailingAttention})
    with pytest.raises(RuntimeError, match="replacement __init__ failed"):
        AutoModelForCausalLM.from_pretrained(llama_dir)
    register_patch_mapping({"LlamaAttention": DelegatingAttention}, overwrite=True)
    from modelpatch import clear_patch_mapping

    clear_patch_mapping()
    assert attention_types(AutoModelForCausalLM.from_pretrained(llama_dir)) == [ORIGINAL_ATTENTION] * 2
    assert_pristine()


def test_isinstance_and_identity_unchanged_inside_block():
    with apply_patches({"LlamaAttention": WrappingAttention}):
        assert modeling_llama.LlamaAttention is ORIGINAL_ATTENTION
        model = LlamaModel(tiny_llama_config())
        assert not isinstance(model.layers[0].self_attn, modeling_llama.LlamaAttention)


def test_copy_and_pickle_inside_block_keep_originals():
    vanilla = LlamaModel(tiny_llama_config())
    with apply_patches({"LlamaAttention": WrappingAttention}):
        clone = copy.deepcopy(vanilla)
        restored = pickle.loads(pickle.dumps(vanilla))
    assert attention_types(clone) == [ORIGINAL_ATTENTION] * 2
    assert attention_types(restored) == [ORIGINAL_ATTENTION] * 2


def test_module_first_imported_inside_block():
    name = "transformers.models.gpt_neox.modeling_gpt_neox"
    sys.modules.pop(name, None)

    class CustomNeoXMLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.proj = nn.Linear(config.hidden_size, config.hidden_size)

        def forward(self, x):
            return self.proj(x)

    config = tiny_gpt_neox_config()
    with apply_patches({"GPTNeoXMLP": CustomNeoXMLP}):
        import importlib

        module = importlib.import_module(name)  # first import happens inside the block
        model = module.GPTNeoXModel(config)
    assert [type(layer.mlp) for layer in model.layers] == [CustomNeoXMLP] * 2


def test_module_level_table_gpt_neo():
    from transformers import GPTNeoModel
    from transformers.models.gpt_neo import modeling_gpt_neo

    class CustomNeoSelfAttention(modeling_gpt_neo.GPTNeoSelfAttention):
        pass

    with apply_patches({"GPTNeoSelfAttention": CustomNeoSelfAttention}):
        model = GPTNeoModel(tiny_gpt_neo_config())
    # GPT-Neo reaches its attention class through GPT_NEO_ATTENTION_CLASSES, a module-level dict
    assert [type(block.attn.attention) for block in model.h] == [CustomNeoSelfAttention] * 2
    assert modeling_gpt_neo.GPT_NEO_ATTENTION_CLASSES["eager"] is modeling_gpt_neo.GPTNeoSelfAttention


def test_broad_pattern_never_touches_non_module_names_or_torch():
    import transformers.models.llama.modeling_llama as ml

    before = dict(vars(ml))
    torch_linear = nn.Linear

    class Anything(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    with apply_patches({".*": Anything}) as scope:
        assert vars(ml) == before
        assert nn.Linear is torch_linear
        replaced = set(scope.resolved)
    allowed = (
        "transformers.models.",
        "transformers_modules.",
        "transformers.pytorch_utils",
        "transformers.activations",
    )
    assert all(cls.__module__.startswith(allowed) for cls in replaced)
    assert all(issubclass(cls, nn.Module) for cls in replaced)
    assert modeling_llama.LlamaModel in replaced
    assert nn.Linear not in replaced
    assert vars(ml) == before


def _build(mapping):
    if mapping is None:
        return LlamaModel(tiny_llama_config(num_hidden_layers=1))
    with apply_patches(mapping):
        return LlamaModel(tiny_llama_config(num_hidden_layers=1))


@pytest.mark.slow
def test_threads_each_get_their_own_classes():
    plans = [
        ({"LlamaAttention": DelegatingAttention}, DelegatingAttention, ORIGINAL_MLP),
        ({"LlamaAttention": WrappingAttention, "LlamaMLP": OtherMLP}, WrappingAttention, OtherMLP),
        (None, ORIGINAL_ATTENTION, ORIGINAL_MLP),
        (None, ORIGINAL_ATTENTION, ORIGINAL_MLP),
    ] * 2
    errors = []
    barrier = threading.Barrier(len(plans))

    def worker(mapping, attention, mlp):
        barrier.wait()
        for _ in range(50):
            model = _build(mapping)
            got = (type(model.layers[0].self_attn), type(model.layers[0].mlp))
            if got != (attention, mlp):
                errors.append((mapping, got))

    threads = [threading.Thread(target=worker, args=plan) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert_pristine()


def test_asyncio_tasks_are_isolated():
    async def inside():
        with apply_patches({"LlamaAttention": DelegatingAttention}):
            await asyncio.sleep(0.01)
            model = LlamaModel(tiny_llama_config(num_hidden_layers=1))
            await asyncio.sleep(0.01)
        return type(model.layers[0].self_attn)

    async def outside():
        await asyncio.sleep(0.005)
        model = LlamaModel(tiny_llama_config(num_hidden_layers=1))
        return type(model.layers[0].self_attn)

    async def main():
        return await asyncio.gather(inside(), outside())

    assert asyncio.run(main()) == [DelegatingAttention, ORIGINAL_ATTENTION]
    assert_pristine()


def test_exitstack_exception_path():
    with pytest.raises(ValueError):
        with contextlib.ExitStack() as stack:
            stack.enter_context(apply_patches({"LlamaAttention": DelegatingAttention}))
            stack.enter_context(apply_patches({"LlamaMLP": OtherMLP}))
            raise ValueError
    assert_pristine()


def test_composite_model_sub_models_built_from_sub_configs(tmp_path):
    from transformers import AutoModelForImageTextToText, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip import modeling_clip

    class CustomClipMLP(modeling_clip.CLIPMLP):
        pass

    config = LlavaConfig(
        vision_config=tiny_clip_vision_config(),
        text_config=tiny_llama_config(),
        image_token_index=100,
    )
    save_tiny(LlavaForConditionalGeneration, config, tmp_path)
    register_patch_mapping({"LlamaAttention": DelegatingAttention, "CLIPMLP": CustomClipMLP})
    for model in (
        AutoModelForImageTextToText.from_pretrained(tmp_path),
        LlavaForConditionalGeneration._from_config(config),
    ):
        language = model.model.language_model
        vision = model.model.vision_tower
        assert [type(layer.self_attn) for layer in language.layers] == [DelegatingAttention] * 2
        mlps = [type(m) for name, m in vision.named_modules() if name.endswith(".mlp")]
        assert mlps == [CustomClipMLP] * 2


def test_a_modeling_module_imported_while_another_module_leaves_is_catalogued():
    """The CLI's sandbox drops a patches file's modules when a command ends: an import offset by such a removal left
    ``len(sys.modules)`` where the catalogue's last scan saw it, the new modeling module was never scanned, and
    ``bert-fused-qkv`` replaced nothing ("not applicable", then a ConversionError) after two in-process commands."""
    import importlib
    import types

    from modelpatch.patching.catalog import CATALOG

    name = "transformers.models.ernie.modeling_ernie"
    importlib.import_module(name)  # its dependencies, so that importing it again adds one module
    sys.modules.pop(name)
    sys.modules["modelpatch_test_leaving_module"] = types.ModuleType("modelpatch_test_leaving_module")
    CATALOG.refresh()
    assert not CATALOG.may_have_changed()
    before = len(sys.modules)
    module = importlib.import_module(name)  # executed again: new class objects
    sys.modules.pop("modelpatch_test_leaving_module")
    assert len(sys.modules) == before
    assert CATALOG.may_have_changed()
    CATALOG.refresh()
    assert module.ErnieSelfAttention in CATALOG.classes_named("ErnieSelfAttention")


# -- PatchScope.start / stop, replacement_of, decorators --------------------------------------------------------------


FusedQKVAttention = get_recipe("llama-fused-qkv").patch_mapping["LlamaAttention"]


def test_scope_start_stop_and_replacement_of():
    config = tiny_llama_config()
    scope = apply_patches({"LlamaAttention": FusedQKVAttention})
    scope.start()
    try:
        model = LlamaForCausalLM(config)
    finally:
        scope.stop()
    assert type(LlamaForCausalLM(config).model.layers[0].self_attn) is LlamaAttention
    found = replacement_of(model.model.layers[0].self_attn)
    assert (found.original, found.replacement, found.key) == (LlamaAttention, FusedQKVAttention, "LlamaAttention")
    assert replacement_of(model.model.layers[0].mlp) is None
    assert scope.fired == {"LlamaAttention": 2}
    with pytest.raises(RuntimeError):
        scope.stop()


class Attention(modeling_llama.LlamaAttention):
    pass


def test_apply_patches_as_decorator():
    @apply_patches({"LlamaAttention": Attention})
    def build():
        return LlamaModel(tiny_llama_config())

    assert type(build().layers[0].self_attn) is Attention
    assert type(build().layers[1].self_attn) is Attention  # a fresh scope per call
    assert type(LlamaModel(tiny_llama_config()).layers[0].self_attn) is modeling_llama.LlamaAttention


def test_apply_patches_decorates_async_functions_and_refuses_generators():
    import asyncio

    @apply_patches({"LlamaAttention": Attention})
    async def build():
        await asyncio.sleep(0)
        return LlamaModel(tiny_llama_config())

    assert type(asyncio.run(build()).layers[0].self_attn) is Attention  # the block spans the coroutine's body
    assert type(LlamaModel(tiny_llama_config()).layers[0].self_attn) is modeling_llama.LlamaAttention
    with pytest.raises(TypeError, match="generator function"):

        @apply_patches({"LlamaAttention": Attention})
        def layers():
            yield LlamaModel(tiny_llama_config())


class LlamaAttn(modeling_llama.LlamaAttention):
    pass


def test_start_and_stop_behave_like_a_with_block():
    scope = apply_patches({"LlamaAttention": LlamaAttn})
    assert scope.start() is scope
    assert active_scopes() == (scope,)
    inside = LlamaModel(tiny_llama_config())
    scope.stop()
    assert active_scopes() == () and scope.closed
    assert [type(layer.self_attn) for layer in inside.layers] == [LlamaAttn, LlamaAttn]
    assert scope.fired == {"LlamaAttention": 2}
    assert type(LlamaModel(tiny_llama_config()).layers[0].self_attn) is modeling_llama.LlamaAttention
    with pytest.raises(ModelpatchRuntimeError, match="not started .or already stopped"):
        scope.stop()
    with pytest.raises(RuntimeError, match="entered only once"):
        scope.start()


def test_stop_runs_the_strict_check_and_stop_before_start_raises():
    never_started = apply_patches({"LlamaAttention": LlamaAttn})
    with pytest.raises(ModelpatchRuntimeError):
        never_started.stop()
    scope = apply_patches({"LlamaAttention": LlamaAttn, "NoSuchClass": Inert}, strict=True).start()
    LlamaModel(tiny_llama_config())
    with pytest.raises(UnmatchedPatchKeyError, match=r"\['NoSuchClass'\]"):
        scope.stop()
    assert active_scopes() == ()
    with pytest.raises(ModelpatchRuntimeError):
        scope.stop()
