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
