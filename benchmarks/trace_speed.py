"""Speed and memory of `memplan trace` on big models (fake tensors: no weights, no GPU).

Each case runs in a fresh subprocess (so start-up imports and peak RSS are its own):

* ``traced``: ``memplan.trace.trace(...)`` end to end (build the model on fake tensors, run the
  iterations with the tracker, summarise);
* ``untracked``: the same build and iterations under a plain ``FakeTensorMode`` without the
  tracker, the module tracker or the recorder: the floor that fake tensors themselves cost.

Targets (issue 4): llama-3.1-8b, seq 2048, mbs 1, bf16, AdamW, 2 iterations: traced <= 2x untracked
and <= 20 s; deepseek-v3 (61 layers) <= 120 s; peak RSS < 2 GiB; ``--fsdp 8`` llama-3.1-8b <= 30 s.
The machine is shared, so each case is repeated and the fastest run is reported.

``--ab`` also times the iterations alone (no start-up, no build), untracked and traced alternately
in one process: the cleanest ratio on a busy machine.

Usage: python benchmarks/trace_speed.py [--repeats N] [--json OUT.json] [--cases NAME,...] [--ab]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "trace_speed.json"

#: name → (model, seq, precision, fsdp, target seconds)
CASES: dict[str, tuple[str, int, str, int, float]] = {
    "llama-3.1-8b": ("llama-3.1-8b", 2048, "bf16", 1, 20.0),
    "llama-3.1-8b-fsdp8": ("llama-3.1-8b", 2048, "bf16", 8, 30.0),
    "deepseek-v3": ("deepseek-v3", 2048, "bf16", 1, 120.0),
}

_CHILD = r'''
import json, resource, sys, time
started = time.perf_counter()
model, seq, precision, fsdp, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
result = {}
if kind == "traced":
    from memplan.trace import trace
    r = trace(model, seq=seq, mbs=1, precision=precision, optimizer="adamw", device="cuda", fsdp=fsdp)
    result.update(events=r.summary.events, peak_allocated_bytes=r.summary.peak_allocated_bytes, timings=r.timings)
else:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from memplan.trace.build import build_hf_model, quiet_transformers, unpacked_sequences
    from memplan.trace.core.distributed import parallelize, simulated_ranks
    from memplan.trace.runners.moe import static_grouped_mm, static_routing
    from memplan.trace.setup import trace_setup
    from memplan.trace.run import hf_step_job, run_iterations
    options = trace_setup(seq=seq, mbs=1, precision=precision, optimizer="adamw", device="cuda", fsdp=fsdp)
    with quiet_transformers(), unpacked_sequences(), static_grouped_mm(), simulated_ranks(options) as mesh, \
            FakeTensorMode(allow_non_fake_inputs=True):
        built = build_hf_model(model, options)
        static_routing(built.model)
        parallelize(built.model, options, mesh)
        job = hf_step_job(built.model, options, autocast=fsdp == 1)
        run_iterations(job, options.iterations)
result["seconds"] = time.perf_counter() - started
result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(result))
'''


_AB_CHILD = r'''
import json, sys, time
from torch._subclasses.fake_tensor import FakeTensorMode
from memplan.trace.build import build_hf_model, quiet_transformers, unpacked_sequences
from memplan.trace.setup import trace_setup
from memplan.trace.core.recorder import AllocationRecorder
from memplan.trace.run import hf_step_job, register_state, run_iterations
from memplan.trace.core.tracker import ModulePath, TracingFakeMode, track_resize
model, seq, precision, repeats = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
options = trace_setup(seq=seq, mbs=1, precision=precision, optimizer="adamw", device="cuda")
times = {"untracked": [], "traced": []}
with quiet_transformers(), unpacked_sequences():
    for _ in range(repeats):
        for kind in ("untracked", "traced"):
            mode = TracingFakeMode(allow_non_fake_inputs=True) if kind == "traced" else FakeTensorMode(allow_non_fake_inputs=True)
            with mode:
                job = hf_step_job(build_hf_model(model, options).model, options)
                started = time.perf_counter()
                if kind == "untracked":
                    run_iterations(job, options.iterations)
                else:
                    with ModulePath() as where:
                        recorder = AllocationRecorder(module_of=where)
                        register_state(recorder, job)
                        mode.recorder = recorder
                        with track_resize(recorder):
                            run_iterations(job, options.iterations, recorder)
                        mode.recorder = None
                times[kind].append(time.perf_counter() - started)
            del job
print(json.dumps(times))
'''


def steps_ab(model: str, seq: int, precision: str, repeats: int) -> dict[str, Any]:
    """The iterations alone, untracked and traced alternately in one process (same build, same imports)."""
    out = subprocess.run([sys.executable, "-c", _AB_CHILD, model, str(seq), precision, str(repeats)],
                         capture_output=True, text=True, check=True)
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return {"steps_untracked_s": [round(t, 2) for t in times["untracked"]],
            "steps_traced_s": [round(t, 2) for t in times["traced"]],
            "steps_ratio": round(min(times["traced"]) / min(times["untracked"]), 2)}


def run_case(model: str, seq: int, precision: str, fsdp: int, kind: str) -> dict[str, Any]:
    """One fresh-process run; seconds include Python start-up and imports."""
    out = subprocess.run([sys.executable, "-c", _CHILD, model, str(seq), precision, str(fsdp), kind],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default=str(DEFAULT_OUT))
    parser.add_argument("--ab", action="store_true", help="also time the iterations alone, untracked vs traced, "
                        "alternately in one process (less sensitive to a busy machine)")
    args = parser.parse_args()
    rows = []
    for name in args.cases.split(","):
        model, seq, precision, fsdp, target = CASES[name]
        runs: dict[str, list[dict[str, Any]]] = {"traced": [], "untracked": []}
        for _ in range(args.repeats):
            for kind in ("untracked", "traced"):
                runs[kind].append(run_case(model, seq, precision, fsdp, kind))
        best = {kind: min(r["seconds"] for r in rs) for kind, rs in runs.items()}
        traced = min(runs["traced"], key=lambda r: r["seconds"])
        row = {"case": name, "model": model, "seq": seq, "precision": precision, "fsdp": fsdp,
               "traced_s": round(best["traced"], 2), "untracked_s": round(best["untracked"], 2),
               "ratio": round(best["traced"] / best["untracked"], 2), "target_s": target,
               "peak_rss_gib": round(max(r["peak_rss_bytes"] for r in runs["traced"]) / 2**30, 3),
               "events": traced["events"], "timings": traced["timings"],
               "all_traced_s": [round(r["seconds"], 2) for r in runs["traced"]],
               "all_untracked_s": [round(r["seconds"], 2) for r in runs["untracked"]]}
        if args.ab and fsdp == 1:
            row.update(steps_ab(model, seq, precision, args.repeats))
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
