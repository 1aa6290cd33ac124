"""Every Transformers model type whose config has experts and a top-k router: build a tiny model, record,
perturb the routers, replay, and check the experts actually used (seen by a hook on the experts modules) equal
the trace. The result is the support table in README.md, with one column per Transformers release CI tests
(each release .ci/run runs the whole suite on, one venv per release).

With one of those releases installed, that release's column must equal the measured one (CI runs this test once
per release, so every column is checked on every submission). With any other release the measurement still runs:
every model type the newest column lists as supported that this release still has must stay supported, and the
measured column is written to build/ and announced in a warning. ``MODELPATCH_REGENERATE_TABLES=1`` (or ``python
tests/routing_coverage.py --write``) replaces the installed release's column of the README table with the measured
one (adding the column for a release the table does not have yet) and leaves the other columns as they are.
``MODELPATCH_EXPECT_TRANSFORMERS=X`` (set by .ci/run) makes the run fail unless release X is the one imported.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from routing_coverage import (
    ABSENT,
    CI_SCRIPT,
    Rows,
    ci_releases,
    measure,
    parse_table,
    readme_table,
    render_table,
    save_measured_table,
    stale_column,
    with_release,
    write_readme_table,
)
from routing_models import REQUIRED_FAMILIES

REGENERATE = os.environ.get("MODELPATCH_REGENERATE_TABLES") == "1" or os.environ.get("MODELPATCH_WRITE_DOCS") == "1"


def lost_support(documented: Rows, measured: Rows, existing) -> list[str]:
    """Model types ``documented`` lists as supported that still exist (in ``existing``) but ``measured`` does not
    list as supported, each with what the measurement says about it."""
    lost = []
    for model_type, (supported, _, _) in sorted(documented.items()):
        if not supported or model_type not in existing:
            continue
        if model_type not in measured:
            lost.append(f"{model_type}: no longer found as a model type with experts and a top-k router")
        elif not measured[model_type][0]:
            lost.append(f"{model_type}: {measured[model_type][2]}")
    return lost


def test_transformers_release_is_the_one_ci_asked_for():
    # a venv that silently resolved another release would check the same column twice (conftest.py refuses such a
    # run before collecting; this test names it in the results too)
    expected = os.environ.get("MODELPATCH_EXPECT_TRANSFORMERS")
    assert expected is None or transformers.__version__ == expected, (
        f"MODELPATCH_EXPECT_TRANSFORMERS={expected} but transformers {transformers.__version__} was imported "
        f"from {transformers.__file__}"
    )


def test_ci_runs_the_whole_suite_on_each_release():
    # each release .ci/run installs gets a run of the whole suite that checks it imported that release
    script = CI_SCRIPT.read_text(encoding="utf-8").splitlines()
    for release in ci_releases():
        runs = [line for line in script if f"MODELPATCH_EXPECT_TRANSFORMERS={release} " in line]
        assert any(line.endswith("python -m pytest -q -n 2") for line in runs), (release, runs)


def test_lost_support_names_types_that_stop_being_supported():
    documented = {"a": (True, "A", "topk"), "b": (True, "B", "topk"), "c": (True, "C", "topk")}
    documented |= {"d": (False, "D", "why"), "gone": (True, "G", "topk")}
    measured = {"a": (True, "A", "topk"), "b": (False, "B", "ValueError: broken"), "d": (True, "D", "topk")}
    assert lost_support(documented, measured, existing={"a", "b", "c", "d"}) == [
        "b: ValueError: broken",
        "c: no longer found as a model type with experts and a top-k router",
    ]


def test_table_keeps_one_column_per_release_and_regenerates_only_one():
    old = {"a": (True, "ARouter", "topk"), "b": (False, "?", "ValueError: x"), "c": (True, "CRouter", "topk")}
    new = {"a": (True, "ARouter", "topk"), "b": (True, "BRouter", "topk"), "d": (False, "-", "two | routers")}
    table = render_table({"9.10.0": new, "9.9.0": old})
    lines = table.splitlines()
    assert lines[1:7] == [
        "| model type | router class | 9.9.0 | 9.10.0 | kind / reason |",  # releases in version order
        "|---|---|---|---|---|",
        "| `a` | ARouter | yes | yes | topk |",
        "| `b` | 9.9.0: ?; 9.10.0: BRouter | no | yes | 9.9.0: ValueError: x; 9.10.0: topk |",
        f"| `c` | CRouter | yes | {ABSENT} | topk |",
        f"| `d` | - | {ABSENT} | no | two / routers |",  # a `|` in a reason would split the row
    ]
    assert lines[-1] == (
        "Model types with experts and a top-k router supported: 2 of 3 on transformers 9.9.0; "
        "2 of 3 on transformers 9.10.0."
    )
    new["d"] = (False, "-", "two / routers")
    assert parse_table(table) == {"9.9.0": old, "9.10.0": new}
    # regenerating one release rewrites its column only, and can add a release
    remeasured = {"a": (False, "ARouter", "RuntimeError: y"), "e": (True, "ERouter", "topk")}
    assert parse_table(with_release(table, "9.10.0", remeasured)) == {"9.9.0": old, "9.10.0": remeasured}
    assert parse_table(with_release(table, "9.11.0", remeasured)) == {"9.9.0": old, "9.10.0": new, "9.11.0": remeasured}


def test_a_table_of_three_and_four_releases_round_trips_and_keeps_mixed_cells():
    # a cell whose releases disagree names each release; three releases where two agree, and a fourth added
    a = {"x": (True, "XRouter", "topk"), "y": (False, "-", "ValueError: a")}
    b = {"x": (True, "XRouter", "topk"), "y": (True, "YRouter", "topk")}
    c = {"x": (False, "XGate", "RuntimeError: c"), "z": (True, "ZRouter", "topk")}
    table = render_table({"9.1.0": a, "9.2.0": b, "9.10.0": c})
    lines = table.splitlines()
    assert lines[1] == "| model type | router class | 9.1.0 | 9.2.0 | 9.10.0 | kind / reason |"
    assert lines[3] == (
        "| `x` | 9.1.0: XRouter; 9.2.0: XRouter; 9.10.0: XGate | yes | yes | no | "
        "9.1.0: topk; 9.2.0: topk; 9.10.0: RuntimeError: c |"
    )
    assert lines[5] == f"| `z` | ZRouter | {ABSENT} | {ABSENT} | yes | topk |"
    assert parse_table(table) == {"9.1.0": a, "9.2.0": b, "9.10.0": c}
    d = {"z": (True, "ZRouter", "topk")}
    assert parse_table(with_release(table, "9.11.0", d)) == {"9.1.0": a, "9.2.0": b, "9.10.0": c, "9.11.0": d}
    assert lines[-1].endswith("1 of 2 on transformers 9.10.0.")
    # a reason holding "; " (a ConversionError naming `pass Chunk(dim=0, sizes=[...])`) in a cell whose releases
    # disagree: regenerating one column used to fold the other columns' reasons into each other
    e = {"x": (False, "XGate", "ConversionError: Chunk(dim=0): cannot split; pass Chunk(dim=0, sizes=[...])")}
    mixed = render_table({"9.1.0": a, "9.2.0": e})
    assert parse_table(mixed) == {"9.1.0": a, "9.2.0": e}
    assert parse_table(with_release(mixed, "9.1.0", b)) == {"9.1.0": b, "9.2.0": e}


def test_readme_table_is_canonical_and_has_a_column_per_ci_release():
    # the check on each release reads its column of the README rows: a row format the parser misses would make it
    # vacuous, so the parsed table must render back to the README text exactly
    table = readme_table()
    columns = parse_table(table)
    assert render_table(columns) == table
    assert len(set().union(*columns.values())) == len(table.splitlines()) - 5  # comment, header, rule, blank, summary
    assert sorted(columns, key=lambda r: tuple(map(int, r.split(".")))) == ci_releases()
    for release, rows in columns.items():
        summary = re.search(rf"(\d+) of (\d+) on transformers {re.escape(release)}\b", table.splitlines()[-1])
        assert summary, table.splitlines()[-1]
        assert (sum(ok for ok, _, _ in rows.values()), len(rows)) == (int(summary.group(1)), int(summary.group(2)))
        assert set(REQUIRED_FAMILIES) <= {mt for mt, (ok, _, _) in rows.items() if ok}, release


@pytest.mark.slow
def test_support_table_is_current_and_required_families_supported():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    try:
        measured = measure()
    finally:
        torch.set_num_threads(threads)
    missing = [f for f in REQUIRED_FAMILIES if not measured.get(f, (False,))[0]]
    assert not missing, f"required families not supported: {missing}"
    assert sum(ok for ok, _, _ in measured.values()) >= 40
    installed = transformers.__version__
    if REGENERATE:
        write_readme_table(with_release(readme_table(), installed, measured))
    documented = parse_table(readme_table())
    if installed in documented:
        stale = stale_column(
            "routing support", "routing_coverage.py", render_table, documented[installed], measured, installed
        )
        assert stale is None, stale
        return
    # a release CI does not test: what the newest documented release supports must stay supported
    newest = max(documented, key=lambda r: tuple(map(int, r.split("."))))
    path = save_measured_table(installed, measured)
    lost = lost_support(documented[newest], measured, existing=CONFIG_MAPPING_NAMES)
    assert not lost, (
        f"model types supported on transformers {newest} (README.md) are not supported on {installed}:\n  "
        + "\n  ".join(lost)
        + f"\nmeasured column: {path}"
    )
    warnings.warn(
        f"routing support measured on transformers {installed}, which README.md's table has no column for "
        f"(columns: {', '.join(documented)}); no support of {newest} lost. Measured column: {path}; "
        "MODELPATCH_REGENERATE_TABLES=1 adds it to README.md (and .ci/run must then test that release)",
        stacklevel=1,
    )
