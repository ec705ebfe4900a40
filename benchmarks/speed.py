"""Speed of the estimator: CLI start-up as a whole process, and Python API estimates per second.

Run from the repository root (memplan installed, e.g. ``pip install -e .``)::

    python benchmarks/speed.py            # the table
    python benchmarks/speed.py --profile  # also cProfile the API loop (top functions)

Targets (docs/benchmarks.md): ``memplan estimate llama-3.1-8b`` < 0.5 s as a process;
>= 5,000 API estimates per second on one core. Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from memplan import Batch, Job, MemplanError, Parallelism, estimate, load_model

PROCESS_RUNS = 10
API_SECONDS = 2.0


#: The MoE issue's process target: DeepSeek-V3 on 1,024 GPUs (TP 2, PP 16, EP 8) with FP8 and MTP.
DEEPSEEK_ARGS = ["estimate", "deepseek-v3", "--gpus", "1024", "--tp", "2", "--pp", "16", "--ep", "8",
                 "--sequence-parallel", "--distributed-optimizer", "--fp8", "hybrid", "--mtp-layers", "1",
                 "--gbs", "1024"]


def _command() -> list[str]:
    """The installed console script (next to this Python), else ``python -m memplan``."""
    script = Path(sys.executable).with_name("memplan")
    return [str(script)] if script.exists() else [sys.executable, "-m", "memplan"]


def process_seconds(args: list[str], runs: int = PROCESS_RUNS) -> float:
    """Median wall time of running ``memplan <args>`` as a fresh process."""
    times = []
    subprocess.run([*_command(), *args], capture_output=True, check=True)  # warm the file cache
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([*_command(), *args], capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rate(call: Callable[[], object], seconds: float = API_SECONDS) -> float:
    """Calls per second of ``call`` over about ``seconds``."""
    call()
    count, start = 0, time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(50):
            call()
        count += 50
    return count / (time.perf_counter() - start)


def llama_case() -> Callable[[], object]:
    model = load_model("llama-3.1-8b")
    job = Job(parallel=Parallelism(world_size=8, tp=2), batch=Batch(micro_batch_size=1, seq_length=8192,
                                                                      global_batch_size=64))
    return lambda: estimate(model, job)


def deepseek_case() -> Callable[[], object]:
    model = load_model("deepseek-v3")
    # 61 layers over 16 stages: 3 + 14 x 4 + 2.
    par = Parallelism(world_size=1024, tp=2, pp=16, ep=8, sequence_parallel=True,
                      first_stage_layers=3, last_stage_layers=2)
    job = Job(parallel=par, batch=Batch(micro_batch_size=1, seq_length=4096, global_batch_size=1024))
    return lambda: estimate(model, job)


def _pin_to_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        return "pinned to 1 core"
    return "not pinned"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="cProfile the API loops")
    args = parser.parse_args()

    rows: list[tuple[str, str, str]] = []
    seconds = process_seconds(["estimate", "llama-3.1-8b"])
    rows.append(("memplan estimate llama-3.1-8b (process, median of 10)", f"{seconds:.3f} s", "< 0.5 s"))
    seconds = process_seconds(["estimate", "llama-3.1-8b", "--json"])
    rows.append(("memplan estimate llama-3.1-8b --json (process)", f"{seconds:.3f} s", "< 0.5 s"))
    seconds = process_seconds(DEEPSEEK_ARGS)
    rows.append(("memplan estimate deepseek-v3, 1024 GPUs, 16 stages (process)", f"{seconds:.3f} s", "< 0.5 s"))
    pinned = _pin_to_one_core()
    cases = {"llama-3.1-8b, 8 GPUs tp 2, seq 8192": llama_case}
    try:
        cases["deepseek-v3, 1024 GPUs tp 2 pp 16 ep 8"] = deepseek_case
        deepseek_case()()
    except MemplanError as exc:  # report, do not hide: the case is optional
        print(f"deepseek-v3 case skipped: {exc}", file=sys.stderr)
        del cases["deepseek-v3, 1024 GPUs tp 2 pp 16 ep 8"]
    for name, make in cases.items():
        call = make()
        rows.append((f"API estimate(): {name}", f"{rate(call):,.0f} /s", ">= 5,000 /s"))
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(lambda fn=call: [fn() for _ in range(500)])
            print(f"\n--- profile: {name} (500 estimates) ---")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(12)

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores ({pinned}), "
          f"Python {platform.python_version()}, {platform.system()}")
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'result':>12}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>12}  {target}")


if __name__ == "__main__":
    main()
