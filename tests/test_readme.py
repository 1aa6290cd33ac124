"""Every ```python block of README.md runs, in order, in one namespace."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 5
    namespace = {"__name__": "__main__"}
    for index, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md block {index}", "exec"), namespace)
        except Exception as error:  # pragma: no cover - the message says which block failed
            raise AssertionError(f"README block {index} failed: {error!r}\n{block}") from error


def test_readme_states_every_tolerance_verify_applies():
    """The bf16 default (0.02) was in no README line: the paragraph beside the checks table names each one."""
    from modelpatch.cli.quantize import QUANTIZATIONS
    from modelpatch.cli.train_check import ADAM_BOUND, SGD_BOUND
    from modelpatch.cli.verify import DEFAULT_ATOL

    text = README.read_text(encoding="utf-8")
    paragraph = text[text.index("Tolerances: `outputs`") :].split("\n\n")[0]
    assert DEFAULT_ATOL["float32"] == 1e-5 and "by default 1e-5 in float32" in paragraph
    assert f"and {DEFAULT_ATOL['bfloat16']} (2e-2) with `--dtype bfloat16` or `float16`" in paragraph
    assert DEFAULT_ATOL["bfloat16"] == DEFAULT_ATOL["float16"]
    assert {f"{q.atol:g}" for q in QUANTIZATIONS.values()} == {"0.05", "0.5"} and "0.05 for the int8" in paragraph
    assert SGD_BOUND == 1e-6 and f"(SGD 1e-6; Adam/AdamW {ADAM_BOUND:g} x lr" in text
