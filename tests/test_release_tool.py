"""``python -m modelpatch.dev.release``: the upstream diff summary, on two small sources (no download, no venv)."""

from __future__ import annotations

from modelpatch.dev.release import DEPENDED_FILES, main, summarize_changes

OLD = '''
"""A module."""
MIN_VERSION = "0.20.0"
TABLE = {"a": 1, "b": 2}
_enabled = True


def kept(x):
    """Old words."""
    return x + 1


def reshaped(x, y):
    return x


def rewritten(x):
    return x


def gone():
    pass


class Loader(Base):
    def load(self, path):
        return path

    def old_method(self):
        pass
'''

NEW = '''
"""A module, reworded."""
MIN_VERSION = "0.22.0"
TABLE = {"a": 1, "b": 3, "c": 4}


def _enabled() -> bool:
    return True


def kept(x):
    """New words: a docstring is no change."""
    return x + 1


def reshaped(x, y, z=None):
    return x


def rewritten(x):
    return -x


def new_function():
    pass


class Loader(Base, Mixin):
    def load(self, path, *, device=None):
        return path
'''


def test_summary_names_every_kind_of_change():
    summary = summarize_changes(OLD, NEW)
    assert summary.status == "changed"
    assert summary.added == ["new_function"]
    assert summary.removed == ["Loader.old_method", "gone"]
    assert summary.signatures == [
        ("Loader", "(Base)", "(Base, Mixin)"),
        ("Loader.load", "(self, path)", "(self, path, *, device=None)"),
        ("_enabled", "constant True", "function () -> bool"),
        ("reshaped", "(x, y)", "(x, y, z=None)"),
    ]
    assert summary.bodies == ["rewritten"]  # `kept` differs in its docstring only
    assert summary.constants == [
        ("MIN_VERSION", "'0.20.0'", "'0.22.0'"),
        ("TABLE", "-'b': 2", "+'b': 3, +'c': 4"),  # the entries that differ, not two truncated dicts
    ]
    lines = summary.render("integrations/peft.py")
    assert lines[0] == "- `integrations/peft.py`:"
    assert "  - `MIN_VERSION`: `'0.20.0'` -> `'0.22.0'`" in lines
    assert "  - code changed: `rewritten`" in lines


def test_files_added_removed_and_unchanged():
    assert summarize_changes(OLD, OLD).render("a.py") == ["- `a.py`: unchanged"]
    assert summarize_changes(None, NEW).render("a.py") == ["- `a.py`: file added"]
    assert summarize_changes(OLD, None).render("a.py") == ["- `a.py`: file removed"]
    assert "monkey_patching.py" in DEPENDED_FILES and "integrations/moe.py" in DEPENDED_FILES


def test_a_version_that_is_no_release_is_one_line(capsys, monkeypatch, tmp_path):
    assert main(["5.26", "--diff-only"]) == 2
    assert capsys.readouterr().err == (
        "modelpatch.dev.release: error: not a Transformers release: '5.26' (e.g. 5.26.0)\n"
    )
    monkeypatch.chdir(tmp_path)  # not a checkout
    assert main(["5.26.0", "--diff-only"]) == 2
    assert "from a modelpatch source checkout" in capsys.readouterr().err


def test_a_partial_run_never_overwrites_the_full_report(capsys, monkeypatch, tmp_path):
    """``--diff-only`` with the default ``--output`` overwrote ``docs/releases/X.Y.md`` (suite and tables) with the
    diff alone: it writes ``X.Y-upstream.md`` now; ``--no-suite`` refuses (exit 2, before anything runs) to replace a
    report holding a suite section; an explicit ``--output`` is written as asked."""
    (tmp_path / "constraints").mkdir()
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text("")
    releases = tmp_path / "docs" / "releases"
    releases.mkdir(parents=True)
    full = "# Transformers 5.26.0\n\n## Suite\n\n`python -m pytest -q -n 2` on 5.26.0: 900 passed\n"
    (releases / "5.26.md").write_text(full)
    monkeypatch.chdir(tmp_path)
    assert main(["5.26.0", "--diff-only", "--against"]) == 0  # no release to diff against: no download
    assert (releases / "5.26.md").read_text() == full
    assert "## Upstream changes" in (releases / "5.26-upstream.md").read_text()
    capsys.readouterr()
    assert main(["5.26.0", "--venv", str(tmp_path), "--no-tables", "--no-suite", "--against"]) == 2
    assert capsys.readouterr().err == (
        f"modelpatch.dev.release: error: {releases / '5.26.md'} holds the sections 'Suite', which this run does not "
        "write: pass --output FILE to write this partial report elsewhere\n"
    )
    assert (releases / "5.26.md").read_text() == full
    partial = tmp_path / "partial.md"
    assert (
        main(["5.26.0", "--venv", str(tmp_path), "--no-tables", "--no-suite", "--against", "--output", str(partial)])
        == 0
    )
    assert partial.read_text().startswith("# Transformers 5.26.0") and (releases / "5.26.md").read_text() == full
