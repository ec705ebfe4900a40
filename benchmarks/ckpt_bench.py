"""The ckpt benchmark: memplan (seeded, per-op plans) in a plain loop, with step() and under an unchanged
Trainer, against checkpointing every block and the static policies a user could pick instead.

Run from the repository root (memplan installed with torch, transformers and accelerate)::

    python benchmarks/ckpt_bench.py             # the 24-step run: 30M GPT-2 (results/ckpt_bench.json)
    python benchmarks/ckpt_bench.py --long      # the 48-step run (results/ckpt_bench_long.json)
    python benchmarks/ckpt_bench.py --quick     # a tiny model, seconds: a SMOKE TEST of the machinery

Parameters (issue 29), fixed in this docstring and in ``BenchConfig`` before the runs were made:

* model: GPT-2-style, 8 layers, width 512, 8 heads, vocabulary 8192, fp32, random weights (29.9M);
  AdamW lr 3e-4; 1 torch thread; batches of 4 sequences, lengths a stratified lognormal (median 80,
  sigma 1.25, clipped to [16, 1024], shuffled with seed 0); the budget halfway between ``full``'s
  and ``none``'s peak on the longest batch (AdamW moments allocated), by the independent judge.
* memplan: ``ctl.seed`` on fake sample steps of 4 x 64, 256 and 1024 tokens (cold: torch's fake-tensor
  cache cleared first), no warm-up, no other preparation; seeding is inside every timed run.
* Timing: the timed variants of a run take turns **step by step** (the order rotated every step),
  each in its own worker process since issue-29 follow-up 3 (``memplan.ckpt.bench_procs``: its own C
  heap, so no variant pays another's page faults), each with its own model, AdamW and judge; a
  variant's time is the sum of its own steps plus, for memplan, its seeding. Static policies are
  first checked for memory by one step on the longest batch; one that exceeds the budget is not
  timed (reported with its peak).
* 24-step run: ``full``, ``plain``, ``half`` (every second block checkpointed) and ``sac`` (every
  block under per-op selective checkpointing: matmul and attention outputs saved); speed target
  1.05 x ``full``; losses compared with ``full``'s (checkpointing changes no loss). ``step()`` and the
  Trainer are not timed here (the machine is shared by seven agents; their loops are covered by
  tests/ckpt).
* 48-step run (``--long``): ``full``, ``plain``, ``half`` and ``sac`` (the static policies added for
  the issue-29 follow-up, before its runs); speed target 1.15 x ``full``.
* Targets: 0 steps over budget by the judge (2 % slack), losses equal to ``none``, recomputed block
  forwards (forward pre-hooks inside a backward) at most 25 % of ``full``'s, the speed target, at
  least the speed of the fastest static policy (``full``, ``half``, ``sac``) none of whose steps
  exceeds the budget, seeding at most 2 s. Speed is judged by wall time; the ratios by process CPU time
  are reported beside it (on a shared machine they are the steadier measure). The machine is shared (2 cores, other agents' processes):
  ratios are taken within a repetition, and the load average is recorded.

Writes the results JSON (date, machine, configuration, every run) unless ``--output`` says otherwise,
and prints the tables and the targets. The same benchmark is ``memplan ckpt bench``. Memory is judged
by an independent live-storage meter over the whole step, inside the timed runs (see
:mod:`memplan.ckpt.bench`).
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
RESULTS_LONG = Path(__file__).parent / "results" / "ckpt_bench_long.json"
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
    parser.add_argument("--long", action="store_true", help="the 48-step run (static policies, no Trainer)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 24)")
    parser.add_argument("--repeats", type=int, help="interleaved repetitions of the timed variants (default 1)")
    parser.add_argument("--static-retain", action="store_true",
                        help="supplementary: the static variants also keep freed memory (not the verdict's setting)")
    parser.add_argument("--output", type=Path, default=None, help=f"JSON file (default {RESULTS}; none with --quick)")
    args = parser.parse_args(argv)
    base = BenchConfig.quick() if args.quick else BenchConfig.long() if args.long else BenchConfig()
    cfg = with_overrides(base, steps=args.steps, repeats=args.repeats, static_retain=args.static_retain or None)
    git = git_state()
    t0 = time.perf_counter()
    result = run_bench(cfg, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    elapsed = time.perf_counter() - t0
    from rich.console import Console

    Console().print(bench_tables(result))
    print(bench_markdown(result))
    print(f"\nbenchmark wall time: {elapsed:.0f} s; parameters of commit {git['commit'][:12] or '?'}"
          + (f" with changed files {git['changed']}" if git["changed"] else ""))
    output = args.output or (None if args.quick else RESULTS_LONG if args.long else RESULTS)
    if args.static_retain and args.output is None and output is not None:
        output = output.with_name(output.stem + "_static_retain.json")
    if output is not None:
        data = {**result.to_dict(), "benchmark_wall_s": elapsed, "git": git}
        output.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
