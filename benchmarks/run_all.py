"""Run every benchmark of this folder, one fresh process each, and print their tables one after the other.

Every ``bench_*.py`` script here compares modelpatch with Transformers' own implementation (or the vanilla
model) *within its own run* and prints the ratios; this runner only discovers, runs and collects them, so a
benchmark added later is picked up without editing this file:

    python benchmarks/run_all.py                # all of them
    python benchmarks/run_all.py --only full_example conversion
    python benchmarks/run_all.py --list

The machine the figures come from (CPU count, Python, torch and transformers versions) is printed first, as the
README table needs it. Exit status: 0 when every script succeeded, else 1 (the others still run).
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def scripts() -> list[str]:
    """``bench_*.py`` files of this folder, sorted by name."""
    return sorted(glob.glob(os.path.join(HERE, "bench_*.py")))


def machine() -> str:
    import torch
    import transformers

    return (
        f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"torch threads {torch.get_num_threads()}"
    )


def run_script(path: str, timeout: float) -> tuple[int, float, str]:
    """``(exit status, seconds, output)`` of one benchmark in a fresh interpreter (stderr folded in)."""
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, path], capture_output=True, text=True, env=env, timeout=timeout, cwd=os.path.dirname(HERE)
        )
        code, output = done.returncode, done.stdout + (done.stderr if done.returncode else "")
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f"(timed out after {timeout:.0f} s)\n{exc.stdout or ''}"
    return code, time.perf_counter() - start, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only bench_<NAME>.py")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per script (default 1800)")
    args = parser.parse_args(argv)
    found = scripts()
    if args.only:
        wanted = {f"bench_{name.removeprefix('bench_').removesuffix('.py')}.py" for name in args.only}
        found = [p for p in found if os.path.basename(p) in wanted]
    if args.list:
        print("\n".join(os.path.basename(p) for p in found))
        return 0
    print(f"machine: {machine()}")
    failed = []
    for path in found:
        name = os.path.basename(path)
        print(f"\n=== {name}", flush=True)
        code, seconds, output = run_script(path, args.timeout)
        print(output.rstrip())
        print(f"--- {name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {seconds:.0f} s", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
