"""Speed of ``memplan fit``: whole searches, timed on one core.

Targets (issue 7): all layouts of deepseek-v3 on 2,048 GPUs in <= 10 s; llama-3.1-70b on 64 GPUs
in <= 2 s. Each case runs ``RUNS`` times in this process (the model load is excluded); the median
wall time and the median CPU time of the process are reported — on a machine shared with other
jobs the CPU time is the fairer figure.

Usage: python benchmarks/fit_speed.py [--json benchmarks/results/fit_speed.json] [--reserved simulated]
[--cases llama-3.1-70b,deepseek-v3]

``--reserved`` prices every candidate with that reserved-memory mode (``Job.reserved``; default: the
profile's); ``--cases`` keeps the cases of those models only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from memplan import Job, load_model
from memplan.fit import fit

RUNS = 3
CASES = [
    ("deepseek-v3", 2048, 4096, 10.0),
    ("deepseek-v3", 1024, 4096, None),
    ("llama-3.1-70b", 64, 4096, 2.0),
    ("llama-3.1-405b", 1024, 8192, None),
    ("mixtral-8x7b", 128, 4096, None),
    ("llama-3.1-8b", 8, 4096, None),
]
#: ``memplan fit`` shows the top 10 (a branch-and-bound search); ``--all`` lists every fitting one.
MODES = (("top 10", 10), ("all", None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_out")
    parser.add_argument("--reserved", choices=("auto", "fixed", "simulated"), default="auto")
    parser.add_argument("--cases", help="comma-separated model names (default: every case)")
    ns = parser.parse_args(argv)
    base = Job(reserved=ns.reserved)
    cases = [c for c in CASES if ns.cases is None or c[0] in ns.cases.split(",")]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rows = []
    print("| model | GPUs | seq | search | layouts | estimates | listed | wall s | CPU s | target s |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (name, gpus, seq, target), (mode, top) in ((c, m) for c in cases for m in MODES):
        model = load_model(name)
        times, cpu, result = [], [], None
        for _ in range(RUNS):
            start, start_cpu = time.perf_counter(), time.process_time()
            result = fit(model, gpus=gpus, gpu="h100-80gb", seq=seq, top=top, base=base)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        assert result is not None
        row = {"model": name, "gpus": gpus, "seq": seq, "search": mode, "layouts": result.layouts_searched,
               "estimates": result.estimates, "fitting": len(result.candidates),
               "median_s": statistics.median(times), "median_cpu_s": statistics.median(cpu), "target_s": target,
               "reserved": ns.reserved}
        rows.append(row)
        print(f"| {name} | {gpus} | {seq} | {mode} | {row['layouts']} | {row['estimates']} | {row['fitting']} | "
              f"{row['median_s']:.2f} | {row['median_cpu_s']:.2f} | {target if target else '-'} |")
    print(f"\n{platform.machine()}, Python {platform.python_version()}, one core, reserved={ns.reserved}, "
          f"load average {os.getloadavg()[0]:.1f}")
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
