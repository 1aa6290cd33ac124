"""The declared Transformers range is the tested range, and bad input about releases and extras is named.

pyproject.toml declares ``transformers>=5.23,<5.26``; ``modelpatch.versions.TESTED_TRANSFORMERS`` holds the same
range; .ci/run runs the whole suite on each release of it, each in its own venv pinned by
``constraints/transformers-5.2N.txt``. A release outside the range warns once at import (an error with
``MODELPATCH_STRICT_VERSION=1``); an integration whose package is missing names the extra that installs it.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
import transformers
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from modelpatch import ModelpatchError
from modelpatch.versions import (
    TESTED_TRANSFORMERS,
    MissingDependencyError,
    UnsupportedTransformersError,
    UntestedTransformersWarning,
    check_transformers_release,
    require,
)
from routing_coverage import CI_SCRIPT, ci_releases

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"{path.name}: not a pin: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def test_declared_range_is_the_tested_range():
    declared = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    (transformers_requirement,) = [r for r in declared if r.name == "transformers"]
    assert transformers_requirement.specifier == TESTED_TRANSFORMERS
    minors = sorted({tuple(map(int, r.split(".")[:2])) for r in ci_releases()})
    assert minors == [(5, 23), (5, 24), (5, 25)]
    # the range starts at the oldest minor CI tests and ends before the one after the newest: no untested minor
    assert str(TESTED_TRANSFORMERS) == f"<{minors[-1][0]}.{minors[-1][1] + 1},>={minors[0][0]}.{minors[0][1]}"
    assert all(release in TESTED_TRANSFORMERS for release in ci_releases())
    assert transformers.__version__ in TESTED_TRANSFORMERS  # the suite itself runs on a tested release


def test_constraints_pin_every_requirement_for_each_release():
    # the test extra pins no transformers release any more: each constraints file does, with every package the
    # install resolves beside it (so CI installs, per release, exactly what was tested)
    extra = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]]
    assert "transformers" not in {r.name for r in extra}
    required = {canonicalize_name(r.name) for r in extra} | {
        canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]
    }
    required -= {"torch"}  # installed first, CPU build (README, .ci/run)
    script = CI_SCRIPT.read_text(encoding="utf-8")
    for release in ci_releases():
        name = f"constraints/transformers-{release.rsplit('.', 1)[0]}.txt"
        assert f'-c {name} -e ".[test]"' in script, name
        pins = _pins(ROOT / name)
        assert pins["transformers"] == release
        assert required <= set(pins), (name, sorted(required - set(pins)))
        for requirement in extra:  # the extra's own bounds hold for the pinned release
            pinned = pins[canonicalize_name(requirement.name)]
            assert requirement.specifier.contains(pinned, prereleases=True), (name, str(requirement), pinned)
    assert "kernels" in _pins(ROOT / "constraints/transformers-5.25.txt")  # 5.25 requires it


def test_the_installed_release_is_tested_and_gets_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_transformers_release(transformers.__version__) is None
        for release in ("5.23.0", "5.24.0", "5.25.0", "5.25.3"):
            assert check_transformers_release(release) is None


@pytest.mark.parametrize("release", ["5.22.0", "5.26.0", "5.26.0.dev0", "6.0.0", "not-a-version"])
def test_an_untested_release_warns_once_naming_the_range(release, monkeypatch):
    monkeypatch.delenv("MODELPATCH_STRICT_VERSION", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        message = check_transformers_release(release)
    assert [str(w.message) for w in caught] == [message]
    assert caught[0].category is UntestedTransformersWarning
    assert f"not {release}" in message and "5.23 to 5.25 (transformers>=5.23,<5.26)" in message


def test_strict_version_makes_it_an_error(monkeypatch):
    monkeypatch.setenv("MODELPATCH_STRICT_VERSION", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UnsupportedTransformersError, match=r"5\.23 to 5\.25.*not 5\.26\.0.*STRICT") as raised:
            check_transformers_release("5.26.0")
        assert check_transformers_release("5.24.0") is None
    assert isinstance(raised.value, ModelpatchError) and isinstance(raised.value, ImportError)


def test_a_missing_optional_dependency_names_its_extra(monkeypatch):
    # None in sys.modules: the import machinery refuses the package as if it were not installed
    monkeypatch.setitem(sys.modules, "peft", None)
    from modelpatch.integrations.peft import add_adapter, transformers_adapter_gate

    with pytest.raises(MissingDependencyError, match=re.escape("pip install 'modelpatch[peft]'")):
        transformers_adapter_gate()
    with pytest.raises(MissingDependencyError, match=r"Adapters \(PEFT\) needs the 'peft' package"):
        add_adapter(object(), None)
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "modelpatch.integrations.trl", raising=False)
    with pytest.raises(MissingDependencyError, match=re.escape("pip install 'modelpatch[trl]'")) as raised:
        import modelpatch.integrations.trl  # noqa: F401
    assert isinstance(raised.value, ImportError)
    assert require("json", "none", "a test").dumps([1]) == "[1]"


def _bash_blocks(section: str) -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    body = readme.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", body, re.DOTALL)


def test_readme_install_and_test_commands_are_what_ci_runs():
    # .ci/run runs the README's commands (quietly: pip -q), per release
    script = [line.strip() for line in CI_SCRIPT.read_text(encoding="utf-8").splitlines()]

    def in_ci(command: str) -> bool:
        command = command.strip().replace("pip install ", "pip install -q ", 1)
        return any(line == command or line.endswith(f" {command}") for line in script)

    (install,) = _bash_blocks("Install")
    assert all(in_ci(part) for part in install.split("&&")), install
    test, other, *_ = _bash_blocks("Test")
    assert in_ci(test) and test.strip() == "python -m pytest -q -n 2"
    commands = [part for line in other.splitlines()[1:] for part in line.split("&&")]
    assert commands and all(in_ci(part) for part in commands), other
    for release in ci_releases():  # each release has its constraints install and its checked run in CI
        minor = release.rsplit(".", 1)[0]
        assert in_ci(f'pip install -c constraints/transformers-{minor}.txt -e ".[test]"'), release
        assert in_ci(f"MODELPATCH_EXPECT_TRANSFORMERS={release} python -m pytest -q -n 2"), release


@pytest.mark.slow
def test_import_warns_once_or_fails_strict_on_an_untested_release():
    # a fresh process whose transformers reports another release (what pip allows with --no-deps, or an upgrade)
    import os
    import subprocess

    script = (
        "import warnings; warnings.simplefilter('always', UserWarning)\n"
        "import transformers; transformers.__version__ = '5.26.0'\n"
        "import modelpatch\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("MODELPATCH_STRICT_VERSION", None)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    warned = [line for line in run.stderr.splitlines() if "UntestedTransformersWarning" in line]
    assert len(warned) == 1 and "tested with Transformers 5.23 to 5.25" in warned[0] and "not 5.26.0" in warned[0]
    env["MODELPATCH_STRICT_VERSION"] = "1"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == (
        "modelpatch.versions.UnsupportedTransformersError: modelpatch is tested with Transformers 5.23 to 5.25 "
        "(transformers>=5.23,<5.26), not 5.26.0 (MODELPATCH_STRICT_VERSION=1); install a tested release: "
        "pip install 'transformers>=5.23,<5.26'"
    )
