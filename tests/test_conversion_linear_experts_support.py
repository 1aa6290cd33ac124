"""The "Linear experts support" table of README.md: every model type with a ``@use_experts_implementation`` experts
class, measured with the installed Transformers (see tests/linear_experts_support.py).

With one of the releases CI tests installed (.ci/run runs the whole suite on each, in its own venv),
that release's column must equal the measured one. ``MODELPATCH_REGENERATE_TABLES=1`` (or ``python
tests/linear_experts_support.py --write``) replaces the installed release's column and leaves the others.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from linear_experts_support import (
    SUPPORT_MODULE,
    measure,
    parse,
    readme_table,
    render,
    render_support_module,
    write_readme_table,
    write_support_module,
)
from routing_coverage import ci_releases, stale_column

REGENERATE = os.environ.get("MODELPATCH_REGENERATE_TABLES") == "1" or os.environ.get("MODELPATCH_WRITE_DOCS") == "1"
# model types of the issue that must stay supported on every release
REQUIRED = ["qwen2_moe", "qwen3_moe", "qwen3_next", "mixtral", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss"]
REQUIRED += ["granitemoe", "jamba", "minimax", "phimoe", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "nemotron_h"]


def test_table_is_canonical_and_has_a_column_per_ci_release():
    table = readme_table()
    columns = parse(table)
    assert render(columns) == table
    assert sorted(columns, key=lambda r: tuple(map(int, r.split(".")))) == ci_releases()
    for release, rows in columns.items():
        supported = {mt for mt, (ok, _, _) in rows.items() if ok}
        assert set(REQUIRED) <= supported, release


def test_the_package_ships_the_table():
    # what list_recipes / get_recipe refuse per release (modelpatch/recipes/support.py) is the README's table
    from modelpatch.recipes.support import MEASURED_SUPPORTED, MEASURED_UNSUPPORTED

    columns = parse(readme_table())
    if REGENERATE:
        write_support_module(columns)
    assert SUPPORT_MODULE.read_text(encoding="utf-8") == render_support_module(columns)
    assert sorted(MEASURED_UNSUPPORTED, key=lambda r: tuple(map(int, r.split(".")))) == ci_releases()
    for release, rows in columns.items():
        assert MEASURED_UNSUPPORTED[release] == {mt: why for mt, (ok, _, why) in rows.items() if not ok}
        assert set(MEASURED_SUPPORTED[release]) == {mt for mt, (ok, _, _) in rows.items() if ok}
    assert MEASURED_UNSUPPORTED["5.23.0"]["laguna"] == "fused: logits differ by 1.45e-03"
    assert (len(MEASURED_UNSUPPORTED["5.23.0"]), len(MEASURED_SUPPORTED["5.23.0"])) == (18, 64)
    assert (len(MEASURED_UNSUPPORTED["5.24.0"]), len(MEASURED_SUPPORTED["5.24.0"])) == (21, 66)
    assert (len(MEASURED_UNSUPPORTED["5.25.0"]), len(MEASURED_SUPPORTED["5.25.0"])) == (23, 70)
    # 5.25 decorates Step-3.5's experts, whose SwiGLU clipping limit is None on unclipped layers (ExpertMLP.limit)
    assert "step3p5" in MEASURED_SUPPORTED["5.25.0"] and "step3p5" not in MEASURED_SUPPORTED["5.24.0"]
    assert MEASURED_UNSUPPORTED["5.25.0"]["ergo"].startswith("ErgoExperts, the experts module the model builds")


@pytest.mark.slow
def test_linear_experts_support_table_is_current():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    try:
        measured = measure()
    finally:
        torch.set_num_threads(threads)
    installed = transformers.__version__
    missing = [mt for mt in REQUIRED if mt in measured and not measured[mt][0]]
    assert not missing, {mt: measured[mt][2] for mt in missing}
    if REGENERATE:
        write_readme_table(render({**parse(readme_table()), installed: measured}))
        write_support_module(parse(readme_table()))
    documented = parse(readme_table())
    assert installed in documented, f"README.md's linear experts table has no column for transformers {installed}"
    stale = stale_column(
        "linear experts support", "linear_experts_support.py", render, documented[installed], measured, installed
    )
    assert stale is None, stale
