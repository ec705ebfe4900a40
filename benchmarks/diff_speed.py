"""Speed of ``memplan diff`` on two 1,000,000-event traces (issue 14 target: under 3 s).

The traces: parameters, gradients and two Adam states of a 24-layer transformer allocated at
setup, then training iterations until a million events: per layer, saved activations and
temporaries in the forward pass (each with its operator and module), temporaries and gradient
buffers in the backward pass, an optimizer temporary per layer. B is A with a batch twice as
large (activations and temporaries double). Both are written with ``memplan.events.write_trace``'s
default encoding for ``.mptrace`` (binary columnar), as ``memplan trace`` writes them.

Measured, three rounds (the best of each is kept): the library call
``memplan.diff.diff_files(A, B)`` (both files read in two worker processes, and serially), one
file read alone, and the command ``memplan diff A B --json`` end to end (a fresh process:
start-up, reading, attribution, JSON; wall and CPU seconds, the CPU of its workers included).
Writes benchmarks/results/diff_speed.json.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memplan.diff import diff_files
from memplan.diff.trace_reader import profile_trace_file
from memplan.events import AllocEvent, Trace, TraceMeta, write_trace

MiB = 2**20
TARGET_SECONDS = 3.0
_OPS = ("aten.mm.default", "aten.add.Tensor", "aten.gelu.default", "aten._softmax.default", "aten.mul.Tensor")


def synthetic_trace(batch: int, target_events: int = 1_000_000, layers: int = 24) -> Trace:
    events: list[AllocEvent] = []
    block = 0

    def alloc(size: int, cat: str, phase: str, it: int, op: str = "", module: str = "") -> tuple:
        nonlocal block
        block += 1
        events.append(AllocEvent(len(events), "alloc", block, size, cat, phase, it, op, module))
        return block, size, cat, phase, it, op, module

    def free(b: tuple) -> None:
        events.append(AllocEvent(len(events), "free", *b))

    hidden = 16 * MiB
    for layer in range(layers):
        for cat in ("parameter", "gradient", "optimizer_state", "optimizer_state"):
            alloc(hidden, cat, "setup", -1, "", f"model.layers.{layer}")
    it = 0
    while len(events) < target_events:
        saved = []
        for layer in range(layers):
            module = f"model.layers.{layer}"
            for k, op in enumerate(_OPS):
                sub = f"{module}.{('attn', 'mlp')[k % 2]}"
                saved.append(alloc(batch * (2 + k) * MiB, "activation", "forward", it, op, sub))
                for t in range(6):
                    free(alloc(batch * (t + 1) * MiB // 2, "temporary", "forward", it, _OPS[t % 5], sub))
        logits = alloc(batch * 64 * MiB, "logits", "forward", it, "aten.mm.default", "lm_head")
        for layer in reversed(range(layers)):
            module = f"model.layers.{layer}"
            for t in range(8):
                free(alloc(batch * (t % 3 + 1) * MiB, "temporary", "backward", it, "aten.mm.default", module))
            for _ in _OPS:
                free(saved.pop())
        free(logits)
        for layer in range(layers):
            free(alloc(hidden, "temporary", "optimizer", it, "aten._foreach_mul.Scalar", f"model.layers.{layer}"))
        it += 1
    return Trace(events=tuple(events), meta=TraceMeta(iterations=it))


def _timed(func) -> tuple[float, float, object]:  # type: ignore[no-untyped-def]
    wall, cpu = time.perf_counter(), time.process_time()
    out = func()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="memplan-diff-speed-"))
    a, b = folder / "a.mptrace", folder / "b.mptrace"
    events = []
    for path, batch in ((a, 1), (b, 2)):
        trace = synthetic_trace(batch)
        write_trace(trace, path)  # the binary encoding, write_trace's default for .mptrace
        events.append(len(trace))
        print(f"{path.name}: {len(trace):,} events, {path.stat().st_size / MiB:.1f} MiB on disk", flush=True)
    load_before = os.getloadavg()[0]
    runs = []
    for _ in range(3):
        par_wall, _, result = _timed(lambda: diff_files(a, b))
        ser_wall, ser_cpu, _ = _timed(lambda: diff_files(a, b, parallel=False))
        one_wall, one_cpu, _ = _timed(lambda: profile_trace_file(a))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "memplan", "diff", str(a), str(b), "--json"],
                              capture_output=True, text=True, check=True, env={**os.environ})
        cli_wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cli_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        runs.append({"library_parallel_s": round(par_wall, 3), "library_serial_s": round(ser_wall, 3),
                     "library_serial_cpu_s": round(ser_cpu, 3), "one_trace_s": round(one_wall, 3),
                     "one_trace_cpu_s": round(one_cpu, 3), "cli_s": round(cli_wall, 3),
                     "cli_cpu_s": round(cli_cpu, 3)})
        print(runs[-1], flush=True)
    data = json.loads(done.stdout)
    for name in ("categories", "modules", "sites"):
        assert sum(row["delta_bytes"] for row in data[name]) == data["peak_delta_bytes"]
    best = {key: min(run[key] for run in runs) for key in runs[0]}
    out = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                   f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "events": events,
        "peak_delta_bytes": result.peak_delta_bytes,  # type: ignore[attr-defined]
        "runs": runs,
        "best": best,
        "target_seconds": TARGET_SECONDS,
        "cli_ok": best["cli_s"] < TARGET_SECONDS,
    }
    target = Path(__file__).parent / "results" / "diff_speed.json"
    target.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=2))
    for path in (a, b):
        path.unlink()
    folder.rmdir()


if __name__ == "__main__":
    main()
