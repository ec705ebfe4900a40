"""Issue 25, item 8: instructions per new-job ``reserved="simulated"`` estimate, counted by callgrind.

The wall and CPU times of ``reserved_sim_speed.py`` move with the load of a shared machine; callgrind's
instruction counts do not. For each job (``reserved_sim_speed.CASES`` and two agreement-grid cells the
op-by-op backward lays out) and each tree (this one, and ``--base``, another tree's ``src``), two processes
run under ``valgrind --tool=callgrind``: one loads the model and estimates once, the other then estimates
:data:`ESTIMATES` more new jobs (every cache keyed on a Job cleared before each); the difference divided by
:data:`ESTIMATES` is the cost of one estimate. Slow (a minute or two per process).

    PYTHONPATH=src python benchmarks/reserved_sim_callgrind.py --base /tmp/base/src [--out benchmarks/results/reserved_sim_callgrind.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import reserved_sim_speed  # noqa: I001 - benchmarks/ is on the path when run as a script

HERE = Path(__file__).resolve().parent
CASES = {
    **reserved_sim_speed.CASES,
    "qwen3-8b, bf16, eager, seq 1024 (grid cell)": (
        "qwen3-8b", {"seq": 1024, "precision": "bf16", "attention": "eager", "framework": "hf", "optimizer": "adamw"}),
    "gemma-2-2b, bf16, eager, full recompute, seq 1024 (grid cell)": (
        str(HERE / "configs" / "gemma-2-2b.json"),
        {"seq": 1024, "precision": "bf16", "attention": "eager", "recompute": "full", "framework": "hf",
         "optimizer": "adamw"}),
}
ESTIMATES = 20
CHILD = """
import json, sys
from memplan import estimate, load_model, policies
from memplan.estimate import engine
from memplan.jobflags import build_job
name, flags = json.loads(sys.argv[1])
model, job = load_model(name), build_job(flags)
estimate(model, job, reserved="simulated")
for _ in range(int(sys.argv[2])):
    engine._stages.cache_clear()
    policies.resolve_policy.cache_clear()
    estimate(model, job, reserved="simulated")
"""


def instructions(src: str, case: tuple[str, dict[str, object]], estimates: int) -> int:
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c",
                           CHILD, json.dumps(case), str(estimates)],
                          env=dict(os.environ, PYTHONPATH=src), capture_output=True, text=True, check=True)
    return int(done.stderr.split("Collected :")[1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="another tree's src folder")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this tree": str(HERE.parent / "src"), **({"base": args.base} if args.base else {})}
    out: dict[str, dict[str, int]] = {}
    for case, spec in CASES.items():
        for tree, src in trees.items():
            start, more = instructions(src, spec, 0), instructions(src, spec, ESTIMATES)
            out.setdefault(case, {})[tree] = round((more - start) / ESTIMATES)
            print(f"{tree:<10} {case:<62} {out[case][tree]:>12,} instructions per estimate", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"instructions_per_new_job_simulated_estimate": out, "estimates": ESTIMATES,
                                        "trees": trees}, indent=1) + "\n")


if __name__ == "__main__":
    main()
