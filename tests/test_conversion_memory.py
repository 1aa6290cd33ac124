"""Memory of a converted load: the pages of converted sources are given back, and only those.

``release_pages`` must never touch memory someone still uses: it would zero anonymous memory (a user's state dict)
and drop a converted tensor that is a view of its source. These tests pin both sides.
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM, modeling_utils

from conversion_models import (
    QKV_RULE,
    FusedQKVAttention,
    assert_params_equal,
    checkpoint,
    clean_conversions,  # noqa: F401 - autouse fixture
    expected_fused,
    patched,
    randomize_,
)
from helpers import tiny_llama_config
from modelpatch.apply import transformers as hooks
from modelpatch.conversion import apply_conversion_rules, load_converted_state_dict
from modelpatch.conversion.pages import release_pages

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are released on Linux only")


def wide_llama_config():
    """The tiny Llama at hidden size 128: q_proj 128x128 floats = 64 KB (k/v: 32 KB with 2 key/value heads)."""
    return tiny_llama_config(hidden_size=128)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """q of 64 KB, k/v of 32 KB each, so every source holds whole pages."""
    folder = tmp_path_factory.mktemp("llama-wide")
    randomize_(LlamaForCausalLM(wide_llama_config())).save_pretrained(folder)
    return folder, checkpoint(folder)


@linux_only
def test_released_file_pages_read_back_unchanged(tmp_path):
    expected = torch.arange(3 * 4096, dtype=torch.float32)
    save_file({"a": torch.ones(7), "b": expected, "c": torch.ones(5)}, tmp_path / "t.safetensors")
    with safe_open(tmp_path / "t.safetensors", framework="pt") as handle:
        tensor = handle.get_slice("b")[...]
        assert torch.equal(tensor, expected)
        assert release_pages([tensor], []) >= 2 * 4096 * 4 - 2 * 4096  # whole pages inside the tensor only
        assert torch.equal(tensor, expected)  # faulted back in from the file
        assert torch.equal(handle.get_slice("a")[...], torch.ones(7))  # neighbours keep their shared pages
        assert torch.equal(handle.get_slice("c")[...], torch.ones(5))


def test_source_viewed_by_an_output_is_kept():
    source = torch.arange(4 * 4096, dtype=torch.float32)
    before = source.clone()
    assert release_pages([source], [source[4096:]]) == 0
    assert torch.equal(source, before)


@linux_only
def test_patched_from_pretrained_releases_sources_and_loads_exact_values(wide_llama):
    folder, ck = wide_llama
    released = []
    original = release_pages

    def spy(sources, outputs):
        released.append(original(sources, outputs))
        return released[-1]

    from modelpatch.conversion import plan as engine

    engine.release_pages = spy
    try:
        with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [QKV_RULE]}):
            model = AutoModelForCausalLM.from_pretrained(folder)
    finally:
        engine.release_pages = original
    assert len(released) == 2 and all(r > 0 for r in released)  # one group per layer, read from the file map
    assert_params_equal(model, expected_fused(model.state_dict(), ck))  # fused and passthrough values exact


def test_user_state_dict_tensors_are_never_released(wide_llama):
    _, ck = wide_llama
    state = {k: v.clone() for k, v in ck.items()}
    with patched({"LlamaAttention": FusedQKVAttention}):
        model = AutoModelForCausalLM.from_config(wide_llama_config())
    load_converted_state_dict(model, state, rules=[QKV_RULE])
    for key, tensor in ck.items():
        assert torch.equal(state[key], tensor), key  # anonymous memory: releasing it would have zeroed it
    assert_params_equal(model, expected_fused(model.state_dict(), ck))


def test_another_wrapper_installed_after_ours_is_kept_and_called(wide_llama):
    """A profiler or library that wraps Transformers' loader after modelpatch must not make our wrapper recurse."""
    folder, ck = wide_llama
    ours = modeling_utils.convert_and_load_state_dict_in_model
    calls = []

    def theirs(*args, **kwargs):
        calls.append(1)
        return ours(*args, **kwargs)

    modeling_utils.convert_and_load_state_dict_in_model = theirs
    try:
        hooks.install()  # called again on every converted load; must leave `theirs` in front of ours
        assert modeling_utils.convert_and_load_state_dict_in_model is theirs
        for _ in range(2):
            with patched({"LlamaAttention": FusedQKVAttention}), apply_conversion_rules({"llama": [QKV_RULE]}):
                model = AutoModelForCausalLM.from_pretrained(folder)
        assert len(calls) == 2
        assert_params_equal(model, expected_fused(model.state_dict(), ck))
    finally:
        modeling_utils.convert_and_load_state_dict_in_model = ours
    assert hooks.installed()


@linux_only
def test_only_the_sources_own_bytes_are_released_from_a_shared_buffer():
    """A source that is a view into a larger buffer (one storage for a whole file) releases its own pages only."""
    page = 4096 // 4
    buffer = torch.arange(8 * page, dtype=torch.float32)
    before = buffer.clone()
    source = buffer[2 * page : 6 * page]
    assert 0 < release_pages([source], []) <= 4 * 4096
    assert torch.equal(buffer[: 2 * page], before[: 2 * page])  # the neighbours in the same storage are intact
    assert torch.equal(buffer[6 * page :], before[6 * page :])


@linux_only
def test_slices_a_caller_passes_are_not_released(wide_llama):
    """A caller's in-place edit of a tensor from its own handle must survive passing slices of that handle."""
    folder, ck = wide_llama
    key = "model.layers.0.self_attn.q_proj.weight"
    with patched({"LlamaAttention": FusedQKVAttention}):
        model = AutoModelForCausalLM.from_config(wide_llama_config())
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        mine = handle.get_tensor(key)
        mine.mul_(2)  # copy-on-write pages of the caller's mapping
        load_converted_state_dict(model, {k: handle.get_slice(k) for k in handle.keys()}, rules=[QKV_RULE])
        assert torch.equal(mine, 2 * ck[key])
