"""Speed of ``memplan doctor`` on a 1,000,000-event trace (issue 14 target: < 2 s).

The trace: a 24-layer transformer-shaped training step repeated until the trace passes one million
events (weights, gradients and Adam states at setup; per layer saved activations and temporaries in
the forward, temporaries in the backward, optimizer temporaries), the same requests every
iteration, as a dense model's steps are. Three diagnoses are timed (``diagnose(trace=...)``, the
trace already in memory; reading a file is the trace format's cost, not the doctor's):

* ``no capacity``: growth and spike analysis only;
* ``fits``: replayed at a capacity above its peak;
* ``fragmentation``: replayed at a capacity between its peak allocated and peak reserved memory,
  which runs out of memory, then every allocator setting replayed to verify it.

A fourth and a fifth row time what ``memplan doctor step.mptrace`` pays from the file: reading it
(the binary columnar encoding ``write_trace`` writes by default, then the gzip JSON-lines one),
then the same diagnosis. A sixth times the ``fragmentation`` case on ``benchmarks/alloc_speed.py``'s trace, whose
iterations differ (one MoE-like request per layer varies): no iteration repeats another, so every
replay runs to the end (in the optional C replay core when it is built: ``memplan.alloc._replay_core``).
Every case (and each file) runs three times: the best and the median are recorded, with the load
average (the machine is shared) and the least CPU seconds of the runs. Writes benchmarks/results/doctor_speed.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from memplan.doctor import diagnose
from memplan.events import AllocEvent, Trace, read_trace, write_trace

MiB = 2**20


def dense_trace(target_events: int = 1_000_000, layers: int = 24) -> Trace:
    """Identical iterations of a transformer-shaped step (sizes vary by layer, not by iteration)."""
    events: list[AllocEvent] = []
    block = 0

    def alloc(size: int, cat: str, phase: str, it: int) -> tuple[int, int, str, str, int]:
        nonlocal block
        block += 1
        events.append(AllocEvent(len(events), "alloc", block, size, cat, phase, it))
        return block, size, cat, phase, it

    def free(b: tuple[int, int, str, str, int]) -> None:
        events.append(AllocEvent(len(events), "free", b[0], b[1], b[2], b[3], b[4]))

    hidden = [(24, 32, 48)[i % 3] * MiB for i in range(layers)]
    temps = [[[(h // 4, h // 2, 3 * MiB + 4096 * t, 700 * 1024)[(k + t) % 4] for t in range(8)] for k in range(6)]
             for h in hidden]
    for h in hidden:
        for cat in ("parameter", "gradient", "optimizer_state", "optimizer_state"):
            alloc(h, cat, "setup", -1)
    it = 0
    while len(events) < target_events:
        saved = []
        for layer in range(layers):
            h = hidden[layer]
            for k in range(6):
                saved.append(alloc(h // (k + 1) + 512 * k, "activation", "forward", it))
                for t in range(8):
                    free(alloc(temps[layer][k][t], "temporary", "forward", it))
        for layer in reversed(range(layers)):
            for t in range(10):
                free(alloc(hidden[layer] // (t % 3 + 1), "temporary", "backward", it))
            for _ in range(6):
                free(saved.pop())
        for layer in range(layers):
            free(alloc(hidden[layer], "temporary", "optimizer", it))
        it += 1
    return Trace(events=tuple(events))


def _time(label: str, trace: Trace, capacity: int | None, repeats: int = 3) -> dict:
    times, cpu = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        report = diagnose(trace=trace, capacity_bytes=capacity)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    seconds = min(times)
    verified = [f for f in report.fixes if f.verified]
    row = {"case": label, "events": len(trace), "capacity_bytes": capacity, "seconds": round(seconds, 3),
           "seconds_median": round(statistics.median(times), 3), "cpu_seconds": round(min(cpu), 3),
           "runs": repeats, "load_average": os.getloadavg()[0],
           "verdict": report.verdict, "fixes": len(report.fixes), "verified_fixes": len(verified),
           "first_verified": verified[0].setting if verified else None}
    print(f"{label:40s} {seconds:6.2f} s (median {statistics.median(times):.2f})  verdict {report.verdict}  fixes {len(report.fixes)} "
          f"(verified {len(verified)})", flush=True)
    return row


def _from_file(trace: Trace, capacity: int, encoding: str, repeats: int = 3) -> dict:
    """What ``memplan doctor step.mptrace`` pays: reading the file (``encoding``: ``binary`` or ``jsonl``,
    see :mod:`memplan.events`), then the diagnosis; best and median of ``repeats`` runs."""
    totals, reads, cpu = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / ("step.mptrace" if encoding == "binary" else "step.jsonl.gz")
        start = time.perf_counter()
        write_trace(trace, path, encoding=encoding)
        write_s = time.perf_counter() - start
        size = path.stat().st_size
        for _ in range(repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            loaded = read_trace(path)
            reads.append(time.perf_counter() - start)
            report = diagnose(trace=loaded, capacity_bytes=capacity)
            totals.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
            del loaded
    assert report.verdict == "fragmentation"
    label = f"dense, fragmentation, from the {encoding} file"
    print(f"{label:40s} {min(totals):6.2f} s (median {statistics.median(totals):.2f}; reading {min(reads):.2f}, "
          f"median {statistics.median(reads):.2f})  {size / 2**20:.1f} MiB, written in {write_s:.1f} s", flush=True)
    return {"case": label, "encoding": encoding, "events": len(trace), "capacity_bytes": capacity,
            "file_bytes": size, "write_seconds": round(write_s, 3),
            "seconds": round(min(totals), 3), "seconds_median": round(statistics.median(totals), 3),
            "cpu_seconds": round(min(cpu), 3), "read_seconds": round(min(reads), 3), "read_seconds_median": round(statistics.median(reads), 3),
            "runs": repeats, "load_average": os.getloadavg()[0], "verdict": report.verdict}


def _machine() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.machine()}, {os.cpu_count()} logical CPUs (shared)"


def main() -> int:
    from memplan.alloc.simulator import simulate

    trace = dense_trace()
    full = simulate(trace)
    peak_r, peak_a = full.peak_reserved_bytes, full.peak_allocated_bytes
    rows = [
        _time("dense, no capacity", trace, None),
        _time("dense, fits", trace, peak_r + 1024 * MiB),
        _time("dense, fragmentation (capacity between peaks)", trace, (peak_r + peak_a) // 2),
    ]
    rows += [_from_file(trace, (peak_r + peak_a) // 2, encoding) for encoding in ("binary", "jsonl")]
    sys.path.insert(0, str(Path(__file__).parent))
    from alloc_speed import synthetic_trace

    moe = synthetic_trace()
    moe_full = simulate(moe)
    rows.append(_time("MoE-like (no repeating iteration), fragmentation", moe,
                      (moe_full.peak_reserved_bytes + moe_full.peak_allocated_bytes) // 2))
    from memplan.doctor.replay import HAS_NATIVE, PURE_PYTHON_ENV

    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": _machine(),
              "python": platform.python_version(), "target_seconds": 2.0,
              "replay_core": "C" if HAS_NATIVE and os.environ.get(PURE_PYTHON_ENV) != "1" else "Python",
              "dense_peak_reserved_bytes": peak_r, "dense_peak_allocated_bytes": peak_a, "rows": rows}
    out = Path(__file__).parent / "results" / "doctor_speed.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
