"""Every script of ``examples/`` runs and reaches its own checks (each returns a non-zero status when one fails).

They run in this process (``runpy``, as ``__main__``): the libraries are imported once for the whole suite.
``compile_fused_qkv.py`` is run by tests/test_compile.py with the ``aot_eager`` backend (its default, inductor,
compiles C++ and takes minutes on 2 cores); the others run with no arguments, as the README says.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))
RUN_HERE = [p for p in EXAMPLES if p.name != "compile_fused_qkv.py"]


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {
        "lora_finetune_moe.py",
        "compile_fused_qkv.py",
        "grpo_routing_replay.py",
        "quantize_moe.py",
        "zero3_trainer_moe.py",
    }


@pytest.mark.slow
@pytest.mark.parametrize("script", RUN_HERE, ids=lambda p: p.name)
def test_example_runs(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(script)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 0
