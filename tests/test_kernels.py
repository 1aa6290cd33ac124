"""Hub kernels (the ``kernels`` library) and patched modules: which forward runs is decided and reported.

Transformers 5.25 turns ``use_kernels`` on by default (``kernels`` is one of its requirements); 5.23 and 5.24 do it
on request. ``kernels.kernelize`` replaces the forward of every module whose class carries a ``kernel_layer_name``
(``LlamaRMSNorm``: ``"RMSNorm"``), a patched subclass included. The kernel here is a real ``kernels`` layer served
by a local repository (``kernels``' ``RepositoryProtocol``: an object with ``load()``) for the CPU, so kernelize
really replaces forwards on this machine: its output (2 x input) tells which forward ran.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from kernels import Mode, kernelize, use_kernel_mapping
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.utils.import_utils import is_kernels_available

from modelpatch import apply_patches, patch_report

X = torch.linspace(-1, 1, 64).view(1, 64)


class DoubledRMSNorm(nn.Module):
    """The hub kernel: stateless, LlamaRMSNorm's forward signature; visibly not an RMS norm."""

    def forward(self, hidden_states):
        return 2 * hidden_states


class LocalRepository:
    """A kernels repository (``load()`` gives the layer) on this machine instead of the Hub."""

    layer_name = "DoubledRMSNorm"

    def load(self):
        return DoubledRMSNorm

    def __hash__(self):
        return hash(type(self))

    def __eq__(self, other):
        return type(other) is type(self)

    def __str__(self):
        return "local/doubled-rmsnorm"


MAPPING = {"RMSNorm": {"cpu": {Mode.INFERENCE: LocalRepository(), Mode.TRAINING: LocalRepository()}}}


class TripledRMSNorm(LlamaRMSNorm):
    """A patch with its own forward (inherits ``kernel_layer_name = "RMSNorm"`` from LlamaRMSNorm)."""

    def forward(self, hidden_states):
        return 3 * super().forward(hidden_states)

    @classmethod
    def from_module(cls, original):  # for patch_model
        return cls(original.weight.shape[0], eps=original.variance_epsilon)


class CountingRMSNorm(LlamaRMSNorm):
    """A patch that keeps the original forward (adds a buffer-free attribute only)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.built_by_patch = True


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config.vocab_size = 128
    path = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _norms(model) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LlamaRMSNorm)}


def _rms(module: nn.Module) -> torch.Tensor:
    return LlamaRMSNorm.forward(module, X)


def test_kernels_is_available_to_transformers():
    # the constraints pin a kernels release each Transformers release accepts: the tests below are not vacuous
    assert is_kernels_available()


def test_a_kernel_replaces_the_unpatched_norms(checkpoint):
    with use_kernel_mapping(MAPPING):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=True)
    assert model.use_kernels
    norms = _norms(model)
    assert len(norms) == 5  # 2 layers x 2 + the final norm
    assert all(torch.equal(m(X), 2 * X) for m in norms.values())


def test_the_patch_wins_over_a_kernel_and_the_report_says_so(checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        with apply_patches({"LlamaRMSNorm": TripledRMSNorm}), use_kernel_mapping(MAPPING):
            model = AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=True)
    norms = _norms(model)
    assert {type(m) for m in norms.values()} == {TripledRMSNorm}
    assert all(torch.equal(m(X), 3 * _rms(m)) for m in norms.values())  # the patched forward, not 2 * X
    assert caplog.text.count("hub kernel 'RMSNorm' (local/doubled-rmsnorm) not applied to 5 replaced module(s)") == 1
    rows = patch_report(model).rows
    assert [r.kernel for r in rows] == [
        "hub kernel 'RMSNorm' (local/doubled-rmsnorm) not applied: the replacement's forward runs"
    ] * 5
    assert "not applied: the replacement's forward runs" in str(patch_report(model))
    # train() kernelizes again (Transformers: a new mode): the patch still wins
    with use_kernel_mapping(MAPPING):
        model.train()
        model.eval()
    assert all(torch.equal(m(X), 3 * _rms(m)) for m in _norms(model).values())


def test_a_patch_that_keeps_the_forward_lets_the_kernel_run(checkpoint):
    with apply_patches({"LlamaRMSNorm": CountingRMSNorm}), use_kernel_mapping(MAPPING):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=True)
    norms = _norms(model)
    assert all(type(m) is CountingRMSNorm and m.built_by_patch for m in norms.values())
    assert all(torch.equal(m(X), 2 * X) for m in norms.values())
    assert {r.kernel for r in patch_report(model).rows} == {
        "hub kernel 'RMSNorm' (local/doubled-rmsnorm) runs in place of the forward"
    }


def test_kernelize_called_directly_is_reported(checkpoint):
    # past Transformers modelpatch cannot intervene; the report reads the module itself
    with apply_patches({"LlamaRMSNorm": TripledRMSNorm}):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=False)
    assert {r.kernel for r in patch_report(model).rows} == {None}
    with use_kernel_mapping(MAPPING):
        kernelize(model, device="cpu", mode=Mode.INFERENCE)
    assert all(torch.equal(m(X), 2 * X) for m in _norms(model).values())
    assert {r.kernel for r in patch_report(model).rows} == {
        "hub kernel 'RMSNorm' (local/doubled-rmsnorm) runs in place of the forward"
    }


def test_hub_kernels_off(checkpoint, monkeypatch):
    # USE_HUB_KERNELS=NO: Transformers applies no kernel (5.25 ignores use_kernels=True), the patch runs, no note
    monkeypatch.setenv("USE_HUB_KERNELS", "NO")
    with apply_patches({"LlamaRMSNorm": TripledRMSNorm}), use_kernel_mapping(MAPPING):
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert not model.use_kernels
    assert all(torch.equal(m(X), 3 * _rms(m)) for m in _norms(model).values())
    assert {r.kernel for r in patch_report(model).rows} == {None}


def test_constructor_arguments_are_read_through_the_kernels_decorator():
    # with kernels installed, Transformers' @use_kernelized_func replaces LlamaAttention.__init__ by a
    # (self, *args, **kwargs) wrapper without functools.wraps: patch_model could not recover config / layer_idx
    import inspect

    from transformers.models.llama.modeling_llama import LlamaAttention

    from modelpatch.patching.interception import defining_init

    wrapper = LlamaAttention.__init__
    assert list(inspect.signature(wrapper).parameters) == ["self", "args", "kwargs"]
    assert list(inspect.signature(defining_init(wrapper)).parameters) == ["self", "config", "layer_idx"]
    assert defining_init(LlamaRMSNorm.__init__) is LlamaRMSNorm.__init__  # nothing wrapped


def test_patch_model_over_a_kernel_says_the_patch_won(checkpoint):
    from modelpatch import patch_model

    with use_kernel_mapping(MAPPING):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=True)
    assert torch.equal(model.model.norm(X), 2 * X)  # the kernel
    with patch_model(model, {"LlamaRMSNorm": TripledRMSNorm}):
        norm = model.model.norm
        assert type(norm) is TripledRMSNorm and torch.equal(norm(X), 3 * _rms(norm))
        assert {r.kernel for r in patch_report(model).rows} == {
            "hub kernel 'RMSNorm' (local/doubled-rmsnorm) not applied: the replacement's forward runs"
        }
    assert torch.equal(model.model.norm(X), 2 * X)  # reverted: the original module, its kernel with it


def test_an_instance_forward_that_is_no_kernel_is_left_alone(checkpoint):
    # accelerate's hooks (device_map offload) also assign module.forward: only a kernels forward (recorded with its
    # _kernel_repo) is a hub kernel; settle_kernels must not strip anything else
    import functools

    from modelpatch.integrations.kernels import settle_kernels

    with apply_patches({"LlamaRMSNorm": TripledRMSNorm}):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=False)
    norm = model.model.norm
    calls = []

    def hooked(module, hidden_states):
        calls.append(hidden_states.shape)
        return TripledRMSNorm.forward(module, hidden_states)

    norm.forward = functools.partial(hooked, norm)
    assert settle_kernels(model) == []
    assert torch.equal(norm(X), 3 * _rms(norm)) and calls == [X.shape]
    assert {r.kernel for r in patch_report(model).rows} == {None}
