"""Every Transformers model type whose config has experts and a top-k router: build a tiny model, record,
perturb the routers, replay, and check the experts actually used (seen by a hook on the experts modules) equal
the trace. The result is the support table in README.md, which this test regenerates and compares
(set MODELPATCH_WRITE_DOCS=1, or run ``python tests/routing_coverage.py --write``, to refresh it)."""

from __future__ import annotations

import os

import pytest
import torch

from routing_coverage import readme_table, support_table, write_readme_table
from routing_models import REQUIRED_FAMILIES


@pytest.mark.slow
def test_support_table_is_current_and_required_families_supported():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    try:
        text, status = support_table()
    finally:
        torch.set_num_threads(threads)
    missing = [f for f in REQUIRED_FAMILIES if not status.get(f)]
    assert not missing, f"required families not supported: {missing}"
    assert sum(status.values()) >= 40
    if os.environ.get("MODELPATCH_WRITE_DOCS") == "1":
        write_readme_table(text)
    if readme_table().splitlines()[0] != text.splitlines()[0]:
        return  # the README table was generated from another Transformers release: its rows differ by design
    assert readme_table() == text, (
        "The routing support table in README.md is stale: run `python tests/routing_coverage.py --write` "
        "(or MODELPATCH_WRITE_DOCS=1 pytest ...)"
    )
