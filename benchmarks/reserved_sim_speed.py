"""Issue 25, item 8: the cost of a new-job estimate with ``reserved="simulated"`` against ``"fixed"``.

Three jobs fixed before the measurement (the brief's: a data-parallel 8B, a 70B pipeline, a LoRA fine-tune).
For each tree (this one, and with ``--base SRC`` another tree's ``src`` folder, e.g. the commit before
the work exported with ``git archive``) and each mode, a child process estimates the job over and over
for 0.3 s of CPU time with every cache keyed on a Job value cleared before each call (a new job, as
``benchmarks/speed.py``'s new-job rate; the layer stretches shared across jobs cleared too, as for a job of new
shapes), five windows; the best window's CPU time per call is kept.
The trees run in turn, ``--rounds`` times, so a shared machine's load falls on both alike; the median
over rounds is reported, with the load average.

    PYTHONPATH=src python benchmarks/reserved_sim_speed.py [--base /tmp/base/src] [--out benchmarks/results/reserved_sim_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

CASES = {
    "llama-3.1-8b, 8 GPUs DP, seq 4096": ("llama-3.1-8b", {"gpus": 8, "seq": 4096}),
    "llama-3.1-70b, 64 GPUs, TP 8 PP 4, seq 4096": ("llama-3.1-70b", {"gpus": 64, "tp": 8, "pp": 4, "seq": 4096}),
    "qwen2.5-7b, LoRA r64 all-linear, hf, bf16, seq 2048": (
        "qwen2.5-7b", {"seq": 2048, "framework": "hf", "peft": "lora", "lora_rank": 64,
                       "lora_targets": "all-linear", "precision": "bf16"}),
}

CHILD = """
import json, sys, time
from memplan import estimate, load_model, policies
from memplan.estimate import engine, reserved_replay
from memplan.jobflags import build_job
cases, mode = json.loads(sys.argv[1]), sys.argv[2]
memos = [getattr(engine, "_stage_parts", None), getattr(reserved_replay, "shared_templates", None)]
def clear():
    engine._stages.cache_clear()
    policies.resolve_policy.cache_clear()
    for memo in memos:  # the stages' figures (keyed on the job) and the layer stretches (cold, as a new shape)
        if memo is not None:
            memo.cache_clear()
out = {}
for name, (model_name, flags) in cases.items():
    model, job = load_model(model_name), build_job(flags)
    estimate(model, job, reserved=mode)
    windows = []
    for _ in range(5):
        calls, start = 0, time.process_time()
        while time.process_time() - start < 0.3:
            clear()
            estimate(model, job, reserved=mode)
            calls += 1
        windows.append((time.process_time() - start) / calls)
    out[name] = min(windows)
print(json.dumps(out))
"""


def _run(src: str, mode: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=src)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES), mode], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="another tree's src folder, measured in turn with this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this tree": str(Path(__file__).resolve().parent.parent / "src")}
    if args.base:
        trees["base"] = args.base
    runs: dict[str, dict[str, list[dict[str, float]]]] = {t: {"fixed": [], "simulated": []} for t in trees}
    loads = []
    for _ in range(args.rounds):
        for tree, src in trees.items():
            for mode in ("fixed", "simulated"):
                runs[tree][mode].append(_run(src, mode))
        loads.append(os.getloadavg()[0])
    table = {tree: {mode: {case: round(1000 * statistics.median(r[case] for r in rows), 3) for case in CASES}
                    for mode, rows in modes.items()} for tree, modes in runs.items()}
    for tree, modes in table.items():
        for case in CASES:
            print(f"{tree:<10} {case:<55} fixed {modes['fixed'][case]:7.3f} ms  simulated {modes['simulated'][case]:7.3f} ms")
    result = {"ms_per_new_job_estimate_cpu": table, "trees": trees, "rounds": args.rounds, "cases": CASES,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "load_average_per_round": loads}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
