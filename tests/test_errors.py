"""Every error of the package derives from ``ModelpatchError`` and keeps its built-in base."""

from __future__ import annotations

import pytest
from transformers.models.llama.modeling_llama import LlamaAttention

import modelpatch
from modelpatch import ModelpatchError, register_patch_mapping, unregister_checkpoint_conversion_mapping


def test_every_error_has_the_modelpatch_base_and_keeps_its_builtin_base():
    with pytest.raises(ModelpatchError) as caught:
        register_patch_mapping({"[": LlamaAttention})
    assert isinstance(caught.value, ValueError)
    with pytest.raises(ModelpatchError) as caught:
        register_patch_mapping({"LlamaAttention": object})
    assert isinstance(caught.value, TypeError)
    with pytest.raises(ModelpatchError) as caught:
        unregister_checkpoint_conversion_mapping("never_registered")
    assert isinstance(caught.value, KeyError) and "never_registered" in str(caught.value)
    for name in ("UnmatchedPatchKeyError", "ConversionError", "ConversionShapeError", "StateDictLayoutError"):
        assert issubclass(getattr(modelpatch, name), ModelpatchError)
    from modelpatch.routing import RoutingReplayError, RoutingTraceError

    assert issubclass(RoutingTraceError, ModelpatchError) and issubclass(RoutingTraceError, ValueError)
    assert issubclass(RoutingReplayError, ModelpatchError) and issubclass(RoutingReplayError, RuntimeError)


def _package_exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in a modelpatch module (all submodules imported)."""
    import importlib
    import inspect
    import pkgutil

    for info in pkgutil.walk_packages(modelpatch.__path__, prefix="modelpatch."):
        importlib.import_module(info.name)
    found: dict[str, type[BaseException]] = {}
    pending = [BaseException]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            pending.append(sub)
            module = inspect.getmodule(sub)
            if module is not None and module.__name__.split(".")[0] == "modelpatch":
                found[f"{sub.__module__}.{sub.__qualname__}"] = sub
    return [found[name] for name in sorted(found)]


def test_every_exception_class_of_the_package_derives_from_modelpatch_error():
    classes = _package_exception_classes()
    names = {cls.__name__ for cls in classes}
    # the walk reaches the CLI's, the routing's, the recipes' and the conversion's own errors
    assert {
        "CliError",
        "RoutingTraceError",
        "UnsupportedExpertsError",
        "ConversionError",
        "QuantizedSaveError",
    } <= names
    outside = [f"{cls.__module__}.{cls.__qualname__}" for cls in classes if not issubclass(cls, ModelpatchError)]
    assert outside == []


def test_cli_error_is_a_modelpatch_error():
    from modelpatch.cli import CliError

    assert CliError.__mro__[1] is ModelpatchError and issubclass(CliError, Exception)


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
