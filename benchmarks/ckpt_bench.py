"""The ckpt benchmark: memplan in a plain loop, with step() and under an unchanged Trainer, vs full checkpointing.

Run from the repository root (memplan installed with torch, transformers and accelerate)::

    python benchmarks/ckpt_bench.py             # the full benchmark: 30M GPT-2, about 30 minutes of CPU
    python benchmarks/ckpt_bench.py --quick     # a tiny model, seconds: a SMOKE TEST of the machinery

Writes ``benchmarks/results/ckpt_bench.json`` (date, machine, configuration, every run) unless
``--output`` says otherwise, and prints the tables and the targets of issue 15 (docs/ckpt.md). The
same benchmark is ``memplan ckpt bench``. Memory is judged by an independent live-storage meter
over the whole step, inside the timed runs (see :mod:`memplan.ckpt.bench`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from memplan.ckpt.bench import BenchConfig, run_bench, with_overrides
from memplan.report.ckpt_text import bench_markdown, bench_tables

RESULTS = Path(__file__).parent / "results" / "ckpt_bench.json"
ROOT = Path(__file__).resolve().parent.parent


def git_state() -> dict[str, object]:
    """The commit the benchmark runs from and the files that differ from it (the parameters' record).

    The parameters (``BenchConfig``'s defaults, docs/ckpt.md "Benchmark parameters") are committed
    before a run; ``changed`` lists tracked files modified since that commit (empty: the run is
    exactly that commit). Outside a git checkout both are empty.
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "", "changed": []}
    return {"commit": commit, "changed": changed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--steps", type=int, help="training steps per run (default 24)")
    parser.add_argument("--repeats", type=int, help="interleaved repetitions of the timed variants (default 3)")
    parser.add_argument("--output", type=Path, default=None, help=f"JSON file (default {RESULTS}; none with --quick)")
    args = parser.parse_args(argv)
    cfg = with_overrides(BenchConfig.quick() if args.quick else BenchConfig(), steps=args.steps, repeats=args.repeats)
    git = git_state()
    t0 = time.perf_counter()
    result = run_bench(cfg, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    elapsed = time.perf_counter() - t0
    from rich.console import Console

    Console().print(bench_tables(result))
    print(bench_markdown(result))
    print(f"\nbenchmark wall time: {elapsed:.0f} s; parameters of commit {git['commit'][:12] or '?'}"
          + (f" with changed files {git['changed']}" if git["changed"] else ""))
    output = args.output or (None if args.quick else RESULTS)
    if output is not None:
        data = {**result.to_dict(), "benchmark_wall_s": elapsed, "git": git}
        output.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
