"""Check a Transformers release in one command: ``python -m modelpatch.dev.release VERSION`` (from a source checkout).

1. **venv**: ``.venv-tfXYZ`` (``--venv DIR`` to use one built by hand): a fresh venv, CPU ``torch==2.13.0`` first,
   then ``pip install -c constraints/transformers-X.Y.txt -e ".[test]"`` when that constraints file exists, else a
   resolving ``pip install -e ".[test]" transformers==VERSION`` whose ``pip freeze`` is written as the new
   constraints file (``--lock`` rewrites it from any venv). A release pip cannot resolve here (a requirement the
   registry lacks) stops with pip's message: build the venv by hand and pass ``--venv``.
2. **tables**: the per-release support tables (routing coverage and linear-experts families in README.md, the
   recipes' support module) regenerated with that release (``MODELPATCH_REGENERATE_TABLES=1``, one process, so two
   writers never race on README.md); ``--no-tables`` skips it.
3. **suite**: ``python -m pytest -q -n 2`` with ``MODELPATCH_EXPECT_TRANSFORMERS=VERSION``; ``--no-suite`` skips it.
4. **upstream**: what changed between each older release CI tests (``--against``) and VERSION in the Transformers
   files modelpatch depends on (:data:`DEPENDED_FILES`): functions, methods and classes added, removed, with a new
   signature or a new body, and module-level constants with a new value, read from the two wheels with :mod:`ast`.

Everything is written to ``docs/releases/X.Y.md`` (``--output``); logs go to ``build/releases/VERSION/``. A partial run
never overwrites a fuller report: ``--diff-only`` writes ``docs/releases/X.Y-upstream.md``, and ``--no-suite`` /
``--no-tables`` refuse (exit 2, before anything runs) to replace a ``docs/releases/X.Y.md`` holding those sections.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelpatchValueError

__all__ = ["DEPENDED_FILES", "Definition", "ChangeSummary", "definitions", "summarize_changes", "main"]

DEPENDED_FILES = (
    "monkey_patching.py",
    "core_model_loading.py",
    "conversion_mapping.py",
    "utils/output_capturing.py",
    "fusion_mapping.py",
    "integrations/moe.py",
    "integrations/hub_kernels.py",
    "integrations/peft.py",
    "modeling_utils.py",
)
"""The Transformers files (under ``transformers/``) whose behaviour modelpatch wraps, patches or mirrors: class
patching, weight conversion, its built-in rules, output capture, fusions, the experts decorator, hub kernels, the
PEFT integration, and ``PreTrainedModel``."""

_CONSTANT_WIDTH = 160  # a constant's value (or its changed entries) is shown up to this many characters


# -- the upstream diff ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Definition:
    """One definition of a module: ``kind`` (``function``, ``method``, ``class``, ``constant``), its ``signature``
    (parameters and return annotation; a class's bases; a constant's value) and a hash of its ``body`` (the code
    without docstrings, so a reworded docstring is no change)."""

    kind: str
    signature: str
    body: str


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[1:]
    return body


def _hash(nodes: list[ast.stmt]) -> str:
    return hashlib.sha256("\n".join(ast.dump(n) for n in nodes).encode()).hexdigest()[:16]


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef, kind: str) -> Definition:
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    decorators = "".join(f"@{ast.unparse(d)} " for d in node.decorator_list)
    return Definition(kind, f"{decorators}({ast.unparse(node.args)}){returns}", _hash(_without_docstring(node.body)))


def definitions(source: str) -> dict[str, Definition]:
    """``{qualified name: Definition}`` for the module-level functions, classes, their methods (``Class.method``)
    and module-level constants (simple assignments) of ``source``.

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    found: dict[str, Definition] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = _function(node, "function")
        elif isinstance(node, ast.ClassDef):
            bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
            own = [
                n for n in _without_docstring(node.body) if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
            found[node.name] = Definition("class", f"({bases})", _hash(own))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{item.name}"] = _function(item, "method")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    value = ast.unparse(node.value)
                    found[target.id] = Definition("constant", value, _hash([node]))
    return found


@dataclass
class ChangeSummary:
    """What changed in one file between two releases (names sorted)."""

    status: str = "unchanged"  # "unchanged", "changed", "added" (new file), "removed" (file gone)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    signatures: list[tuple[str, str, str]] = field(default_factory=list)  # (name, old, new)
    bodies: list[str] = field(default_factory=list)  # same signature, other code
    constants: list[tuple[str, str, str]] = field(default_factory=list)  # (name, old, new): values, or entries
    # of a container literal that differ (``-key: value`` / ``+key: value``)

    def render(self, path: str) -> list[str]:
        """Markdown lines for ``path``."""
        if self.status in ("added", "removed"):
            return [f"- `{path}`: file {self.status}"]
        if self.status == "unchanged":
            return [f"- `{path}`: unchanged"]
        lines = [f"- `{path}`:"]
        if self.added:
            lines.append(f"  - added: {', '.join(f'`{n}`' for n in self.added)}")
        if self.removed:
            lines.append(f"  - removed: {', '.join(f'`{n}`' for n in self.removed)}")
        for name, old, new in self.signatures:
            lines.append(f"  - signature of `{name}`: `{old}` -> `{new}`")
        if self.bodies:
            lines.append(f"  - code changed: {', '.join(f'`{n}`' for n in self.bodies)}")
        for name, old, new in self.constants:
            lines.append(f"  - `{name}`: `{old}` -> `{new}`")
        return lines


def _short(value: str, width: int = _CONSTANT_WIDTH) -> str:
    value = " ".join(value.split()).replace("`", "'")
    return value if len(value) <= width else value[: width - 3] + "..."


def _items(value: str) -> dict[str, str] | None:
    """``{entry: source}`` of a dict, list, tuple or set literal (a dict entry keyed by its key), else ``None``."""
    try:
        node = ast.parse(value, mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.Dict):
        return {ast.unparse(k) if k is not None else "**": ast.unparse(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return {ast.unparse(e): ast.unparse(e) for e in node.elts}
    return None


def _value_change(old: str, new: str) -> tuple[str, str]:
    """``(old, new)`` as shown: for two container literals the entries that differ only (``+``/``-``)."""
    before, after = _items(old), _items(new)
    if before is None or after is None:
        return _short(old), _short(new)
    removed = [f"-{k}" + (f": {v}" if k != v else "") for k, v in before.items() if after.get(k) != v]
    added = [f"+{k}" + (f": {v}" if k != v else "") for k, v in after.items() if before.get(k) != v]
    return _short(", ".join(removed) or "(no entry removed)"), _short(", ".join(added) or "(no entry added)")


def summarize_changes(old: str | None, new: str | None) -> ChangeSummary:
    """The :class:`ChangeSummary` from source ``old`` to source ``new`` (``None``: the file does not exist)."""
    if old is None or new is None:
        if old is None and new is None:
            return ChangeSummary()
        return ChangeSummary(status="added" if old is None else "removed")
    before, after = definitions(old), definitions(new)
    summary = ChangeSummary()
    summary.added = sorted(after.keys() - before.keys())
    summary.removed = sorted(before.keys() - after.keys())
    for name in sorted(before.keys() & after.keys()):
        was, now = before[name], after[name]
        if was == now:
            continue
        if was.kind != now.kind:
            summary.signatures.append(
                (name, f"{was.kind} {_short(was.signature)}", f"{now.kind} {_short(now.signature)}")
            )
        elif was.kind == "constant":
            summary.constants.append((name, *_value_change(was.signature, now.signature)))
        elif was.signature != now.signature:
            summary.signatures.append((name, was.signature, now.signature))
        else:
            summary.bodies.append(name)
    if summary.added or summary.removed or summary.signatures or summary.bodies or summary.constants:
        summary.status = "changed"
    return summary


# -- a checkout, its venvs, its constraints ---------------------------------------------------------------------------
def _root() -> Path:
    for folder in [Path.cwd(), *Path.cwd().parents]:
        if (folder / "constraints").is_dir() and (folder / ".ci" / "run").is_file():
            return folder
    raise ModelpatchValueError("run python -m modelpatch.dev.release from a modelpatch source checkout")


def _minor(version: str) -> str:
    match = re.fullmatch(r"(\d+)\.(\d+)\.\d+(?:\S*)", version)
    if match is None:
        raise ModelpatchValueError(f"not a Transformers release: {version!r} (e.g. 5.26.0)")
    return f"{match.group(1)}.{match.group(2)}"


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", release)[:3])


def tested_releases(root: Path) -> list[str]:
    """The release each ``constraints/transformers-X.Y.txt`` pins, in version order."""
    found = []
    for path in sorted((root / "constraints").glob("transformers-*.txt")):
        pins = re.findall(r"^transformers==(\S+)$", path.read_text(encoding="utf-8"), re.MULTILINE)
        found.extend(pins[:1])
    return sorted(found, key=_release_key)


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def write_lock(python: Path, path: Path, version: str) -> None:
    """Write ``pip freeze`` of the venv of ``python`` (without torch, installed first, and modelpatch) to ``path``."""
    frozen = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    pins = [line for line in frozen.splitlines() if line and not line.startswith(("-e", "#", "torch==", "modelpatch"))]
    header = [
        f"# Transformers {version} and every package the test extra resolves to beside it: the releases CI tests with.",
        "# Install: see README.md (Install / Test). torch (2.13.0, CPU) is installed first and is not listed.",
        f"# Regenerate: python -m modelpatch.dev.release {version} --lock (pip freeze of that release's venv).",
    ]
    path.write_text("\n".join(header + pins) + "\n", encoding="utf-8")


def build_venv(root: Path, version: str, venv: Path, log: Path) -> tuple[Path, bool]:
    """Create ``venv`` for ``version``; returns ``(constraints file, whether it was generated now)``.

    Raises:
        ModelpatchValueError: pip could not install (its last lines in the message).
    """
    constraints = root / "constraints" / f"transformers-{_minor(version)}.txt"
    python = venv / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [str(python), "-m", "pip", "install", "-q", "torch==2.13.0"],
    ]
    generated = not constraints.exists()
    if generated:
        steps.append([str(python), "-m", "pip", "install", "-q", "-e", ".[test]", f"transformers=={version}"])
    else:
        steps.append([str(python), "-m", "pip", "install", "-q", "-c", str(constraints), "-e", ".[test]"])
    for step in steps:
        if _run(step, log, cwd=root) != 0:
            raise ModelpatchValueError(
                f"could not build {venv} for transformers {version} ({' '.join(step[2:])}):\n{_tail(log)}\n"
                "Build the venv by hand (e.g. pip install --no-deps transformers==VERSION, then its other "
                "requirements and the test extra) and rerun with --venv DIR --lock."
            )
    if generated:
        write_lock(python, constraints, version)
    return constraints, generated


def _env(root: Path, version: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root / "src")  # the checkout, whatever the venv has installed
    env["MODELPATCH_EXPECT_TRANSFORMERS"] = version
    env.update(extra)
    return env


def run_suite(root: Path, python: Path, version: str, log: Path) -> tuple[int, str, list[str]]:
    """The whole suite on ``version``: ``(exit status, summary line, FAILED/ERROR lines)``."""
    code = _run(
        [str(python), "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"], log, _env(root, version), root
    )
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    summary = next((s for s in reversed(lines) if re.search(r"\d+ (passed|failed|error)", s)), "(no summary)")
    failed = [s for s in lines if s.startswith(("FAILED ", "ERROR "))]
    return code, summary.strip("= "), failed


def regenerate_tables(root: Path, python: Path, version: str, log: Path) -> tuple[int, str]:
    """Rewrite ``version``'s columns of the support tables; ``(exit status, git diff --stat of what changed)``."""
    tests = ["tests/test_routing_coverage.py", "tests/test_conversion_linear_experts_support.py"]
    env = _env(root, version, MODELPATCH_REGENERATE_TABLES="1")
    code = _run([str(python), "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *tests], log, env, root)
    stat = subprocess.run(["git", "diff", "--stat"], capture_output=True, text=True, cwd=root).stdout.strip()
    return code, stat or "(no change)"


def _wheel(release: str, cache: Path, log: Path) -> Path:
    found = sorted(cache.glob(f"transformers-{release}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"transformers=={release}", "-d", str(cache)]
        if _run(cmd, log) != 0:
            raise ModelpatchValueError(f"could not download transformers {release}:\n{_tail(log)}")
        found = sorted(cache.glob(f"transformers-{release}-*.whl"))
    return found[0]


def _read(wheel: zipfile.ZipFile, path: str) -> str | None:
    try:
        return wheel.read(f"transformers/{path}").decode("utf-8")
    except KeyError:
        return None


def upstream_changes(old: str, new: str, cache: Path, log: Path) -> list[str]:
    """Markdown lines: :data:`DEPENDED_FILES` from transformers ``old`` to ``new``."""
    with zipfile.ZipFile(_wheel(old, cache, log)) as before, zipfile.ZipFile(_wheel(new, cache, log)) as after:
        lines = [f"### {old} -> {new}", ""]
        for path in DEPENDED_FILES:
            lines.extend(summarize_changes(_read(before, path), _read(after, path)).render(path))
    return lines + [""]


# -- the command ------------------------------------------------------------------------------------------------------
def _default_output(root: Path, minor: str, args: argparse.Namespace) -> Path:
    """Where a run without ``--output`` writes: ``docs/releases/X.Y.md``, or ``docs/releases/X.Y-upstream.md`` for
    ``--diff-only`` (the full report stays as it is).

    Raises:
        ModelpatchValueError: another partial run (``--no-suite`` / ``--no-tables``) would overwrite a report holding
            sections it does not write (the suite's, the tables'); nothing has run then.
    """
    releases = root / "docs" / "releases"
    if args.diff_only:
        return releases / f"{minor}-upstream.md"
    path = releases / f"{minor}.md"
    if path.is_file():
        kept = {"## Support tables": args.no_tables, "## Suite": args.no_suite}
        dropped = [
            title
            for title, skipped in kept.items()
            if skipped and title in path.read_text(encoding="utf-8").splitlines()
        ]
        if dropped:
            raise ModelpatchValueError(
                f"{path} holds the sections {', '.join(repr(d[3:]) for d in dropped)}, which this run does not write: "
                "pass --output FILE to write this partial report elsewhere"
            )
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m modelpatch.dev.release VERSION [--venv DIR] [--against R ...] [--lock] [--no-tables]
    [--no-suite] [--diff-only] [--output FILE]``; exit status 0 when every step passed, 1 when the tables or
    the suite failed, 2 on a bad argument or an install that failed."""
    parser = argparse.ArgumentParser(prog="python -m modelpatch.dev.release", description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the Transformers release, e.g. 5.26.0")
    parser.add_argument("--venv", type=Path, help="an existing venv with that release (default: build .venv-tfXYZ)")
    parser.add_argument("--against", nargs="*", help="releases to diff against (default: the older tested ones)")
    parser.add_argument("--lock", action="store_true", help="(re)write constraints/transformers-X.Y.txt from the venv")
    parser.add_argument("--no-tables", action="store_true", help="do not regenerate the support tables")
    parser.add_argument("--no-suite", action="store_true", help="do not run the suite")
    parser.add_argument("--diff-only", action="store_true", help="only the upstream diff (no venv, tables, suite)")
    parser.add_argument("--output", type=Path, help="default: docs/releases/X.Y.md (X.Y-upstream.md with --diff-only)")
    args = parser.parse_args(argv)
    try:
        root = _root()
        version = args.version
        minor = _minor(version)
        work = root / "build" / "releases" / version
        log = work / "release.log"
        out = [f"# Transformers {version}", "", f"Written by `python -m modelpatch.dev.release {version}`.", ""]
        path = args.output or _default_output(root, minor, args)
        status = 0
        if not args.diff_only:
            venv = args.venv or root / f".venv-tf{minor.replace('.', '')}"
            python = venv / "bin" / "python"
            constraints = root / "constraints" / f"transformers-{minor}.txt"
            if args.venv is None:
                constraints, generated = build_venv(root, version, venv, work / "install.log")
                out += [
                    "## Install",
                    "",
                    f"`{constraints.relative_to(root)}` ({'generated' if generated else 'used'})",
                    "",
                ]
            if args.lock:
                write_lock(python, constraints, version)
                out += [f"`{constraints.relative_to(root)}` written from `{venv}`", ""]
            if not args.no_tables:
                code, stat = regenerate_tables(root, python, version, work / "tables.log")
                status = status or int(code != 0)
                out += ["## Support tables", "", f"regenerated (exit {code}):", "", "```", stat, "```", ""]
            if not args.no_suite:
                code, summary, failed = run_suite(root, python, version, work / "suite.log")
                status = status or int(code != 0)
                out += ["## Suite", "", f"`python -m pytest -q -n 2` on {version}: {summary}", ""]
                out += [f"- `{line}`" for line in failed] + ([""] if failed else [])
        against = (
            args.against
            if args.against is not None
            else [r for r in tested_releases(root) if _release_key(r) < _release_key(version)]
        )
        out += ["## Upstream changes in the files modelpatch depends on", ""]
        out += [f"Functions, methods, classes and constants of `transformers/{{{', '.join(DEPENDED_FILES)}}}`.", ""]
        for old in against:
            out += upstream_changes(old, version, work / "wheels", log)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(out).rstrip() + "\n", encoding="utf-8")
        print(f"wrote {path}")
        return status
    except ModelpatchValueError as exc:
        print(f"modelpatch.dev.release: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
