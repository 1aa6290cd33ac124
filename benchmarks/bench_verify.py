"""Benchmark: what ``modelpatch verify``'s default run costs, against one unpatched load + forward.

On the built-in tiny Qwen2-MoE example (what ``modelpatch verify`` with no argument runs), in one warm process,
interleaved rounds of:

* ``unit``         one unpatched ``from_pretrained`` of the example + one forward on verify's input;
* ``weights only`` ``modelpatch verify --checks none``: the checks of the run before the path checks (patches,
                   loading, provenance, outputs, round trip);
* ``default``      ``modelpatch verify``: those and the path checks (padding, dynamic and static cache, generate,
                   routing; ``--new-tokens 4``);
* each path check alone (``--checks NAME``), for its share.

Figures: median wall time of each, and medians of the per-round ratios to ``unit`` and to ``weights only`` (the
goal: the default run <= 1.5x the run without the path checks).

    python benchmarks/bench_verify.py [--repeats 7] [--new-tokens N]

``run()`` returns ``[(figure, seconds, ratio to unit, ratio to weights only)]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time


def _unit(folder: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from modelpatch.cli.checkpoint import read_config
    from modelpatch.cli.inputs import model_inputs

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    inputs, _ = model_inputs(folder, read_config(folder))
    with torch.no_grad():
        model(**inputs)
    return time.perf_counter() - start


def _verify(*argv: str) -> float:
    from modelpatch.cli import main

    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["verify", "--no-progress", "--json", *argv])
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"modelpatch verify {' '.join(argv)} exited {code}")
    return seconds


VARIANTS = {
    "weights only (--checks none)": ("--checks", "none"),
    "default": (),
    "  padding alone": ("--checks", "padding"),
    "  cache (dynamic + static) alone": ("--checks", "cache"),
    "  generate alone": ("--checks", "generate"),
    "  routing alone": ("--checks", "routing"),
}


def run(repeats: int = 7, verbose: bool = True, new_tokens: int | None = None) -> list[tuple]:
    import torch
    from transformers.utils import logging

    from modelpatch.cli.checkpoint import example_checkpoint

    torch.set_num_threads(1)
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    folder = example_checkpoint()
    _unit(folder), _verify()  # warm-up: imports, the example's first build
    times: dict[str, list[float]] = {"unit": [], **{name: [] for name in VARIANTS}}
    for _ in range(repeats):  # interleaved so machine drift hits every variant alike
        times["unit"].append(_unit(folder))
        for name, argv in VARIANTS.items():
            extra = () if new_tokens is None or name.startswith("weights only") else ("--new-tokens", str(new_tokens))
            times[name].append(_verify(*argv, *extra))
    base = times["weights only (--checks none)"]
    rows = []
    for name, values in times.items():
        to_unit = statistics.median(v / u for v, u in zip(values, times["unit"]))
        to_base = statistics.median(v / b for v, b in zip(values, base))
        rows.append((name, statistics.median(values), to_unit, to_base))
    if verbose:
        print(f"modelpatch verify on the built-in tiny Qwen2-MoE example ({folder}), {repeats} rounds, 1 thread")
        print(f"{'run':<34} {'median s':>9} {'x unit':>8} {'x weights only':>15}")
        for name, seconds, to_unit, to_base in rows:
            print(f"{name:<34} {seconds:>9.3f} {to_unit:>8.2f} {to_base:>15.2f}")
        print("unit = one unpatched from_pretrained + one forward on verify's input, measured in the same rounds")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, help="pass --new-tokens N to every run with path checks")
    args = parser.parse_args(argv)
    run(args.repeats, new_tokens=args.new_tokens)


if __name__ == "__main__":
    main()
