"""Speed of the estimator: CLI start-up as a whole process, and Python API estimates per second.

Run from the repository root (memplan installed, e.g. ``pip install -e .``)::

    python benchmarks/speed.py            # the table
    python benchmarks/speed.py --profile  # also cProfile the API loop (top functions)
    python benchmarks/speed.py --issue24 [--write] [--callgrind]  # the paired issue-24 measures (below)
    python benchmarks/speed.py --finetune [--base DIR] [--write]  # new-job rates of fine-tuning jobs (below)

Targets (docs/benchmarks.md): ``memplan estimate llama-3.1-8b`` < 0.5 s as a process;
>= 5,000 API estimates per second on one core. Results are recorded in docs/benchmarks.md.

Issue 24 (fixed before the results were seen): ``memplan estimate llama-3.1-8b --gpus 8`` at most
2.5x ``python -c "import typer, rich, yaml"`` in one paired run (the two commands alternate, 11
pairs, medians; wall time and the children's CPU time, which a shared machine's load distorts
less), and ``estimate()`` of llama-3.1-8b, 8 GPUs data-parallel, seq 4096 at least 12,000 calls/s
(wall and CPU time; also CPU time with every cache keyed on a Job value cleared before every call
-- the per-job memo and the resolved activation policy -- the rate of new jobs; nothing else is
cleared: caches keyed on the model, a layer kind at an activation shape or a pipeline layout stay warm, as
they do for any new job sharing them). Each rate loop makes one estimate before it starts timing (that one
also compiles the ``__init__`` of each :func:`memplan.frozen.frozen_dataclass` class on its first
construction). ``--base DIR`` runs the same measures on another tree's ``src`` in the same
pairs (the commit before the work). The start-up depends on Python's bytecode cache: with
``PYTHONDONTWRITEBYTECODE`` set every memplan module is compiled from source on each start while
the reference's site-packages modules have their cache; both conditions are measured.
``--write`` stores the result in ``benchmarks/results/speed_issue24.json``.

``--finetune``: the same new-job rate (CPU time, every Job-keyed cache cleared before each call) and Python
opcodes per new-job estimate for the fine-tuning jobs in :data:`FINETUNE_CELLS` (llama-3.1-8b, the hf profile,
8 GPUs, seq 4096: LoRA and DoRA without and with full recompute, QLoRA nf4 with full recompute), which a fit
search or the server prices by the hundred; ``--write`` stores ``benchmarks/results/speed_finetune.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
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


RESULT = Path(__file__).resolve().parent / "results" / "speed_issue24.json"
FINETUNE_RESULT = Path(__file__).resolve().parent / "results" / "speed_finetune.json"
PAIRS = 11
REFERENCE = ["-c", "import typer, rich, yaml"]
ISSUE_ARGS = ["-m", "memplan", "estimate", "llama-3.1-8b", "--gpus", "8"]
#: Clears every cache keyed on a Job value before a "new job" (the snippet the rate and fine-tuning cases share).
_CLEAR_JOB_MEMOS = """memos = [getattr(getattr(m, n, None), "cache_clear", None)
         for m, n in ((engine, "_stages"), (engine, "_stage_parts"), (policies, "resolve_policy"))]
def clear():
    for memo in memos:
        if memo is not None:
            memo()
"""
RATE_CASE = """
import time
from memplan import Batch, Job, Parallelism, estimate, load_model
model = load_model("llama-3.1-8b")
job = Job(parallel=Parallelism(world_size=8), batch=Batch(micro_batch_size=1, seq_length=4096))
estimate(model, job)
count, wall, cpu = 0, time.perf_counter(), time.process_time()
while time.perf_counter() - wall < 2.0:
    for _ in range(20):
        estimate(model, job)
    count += 20
rates = [count / (time.perf_counter() - wall), count / (time.process_time() - cpu)]
from memplan import policies
from memplan.estimate import engine
# a new job: every cache keyed on a Job value is cleared (the estimator's per-job memo and the
# resolved activation policy); caches keyed on the model, a layer kind at a shape or a pipeline
# layout stay warm, as they do for any new job that shares them
""" + _CLEAR_JOB_MEMOS + """count, cpu = 0, time.process_time()
while time.process_time() - cpu < 2.0:
    for _ in range(20):
        clear()
        estimate(model, job)
    count += 20
print(*rates, count / (time.process_time() - cpu))
"""


#: The same new-job estimate counted in Python opcodes (``sys.settrace`` opcode events): a measure of the
#: interpreter's work that a shared machine's load does not move (times there vary by 2x between runs).
#: Opcodes weigh a C call (``attrgetter``, ``object.__setattr__``) as one; callgrind's instruction count
#: (``--callgrind``) weighs everything.
OPCODE_CASE = """
import sys
from memplan import Batch, Job, Parallelism, estimate, load_model
from memplan import policies
from memplan.estimate import engine
model = load_model("llama-3.1-8b")
job = Job(parallel=Parallelism(world_size=8), batch=Batch(micro_batch_size=1, seq_length=4096))
for _ in range(2):  # two warm-up estimates, the second a new job: what is made once per process is made
    for memo in (getattr(engine, "_stages", None), getattr(engine, "_stage_parts", None), getattr(policies, "resolve_policy", None)):
        getattr(memo, "cache_clear", lambda: None)()
    estimate(model, job)
for memo in (getattr(engine, "_stages", None), getattr(engine, "_stage_parts", None), getattr(policies, "resolve_policy", None)):
    getattr(memo, "cache_clear", lambda: None)()
count = [0]
def tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    if event == "opcode":
        count[0] += 1
    return tracer
sys.settrace(tracer)
estimate(model, job)
sys.settrace(None)
print(count[0])
"""


#: The new-job loop run under callgrind (``--callgrind``): instructions executed do not move with the load.
CALLGRIND_CASE = OPCODE_CASE.split("count = [0]")[0] + """
for _ in range(int(sys.argv[1])):
    for memo in (getattr(engine, "_stages", None), getattr(engine, "_stage_parts", None), getattr(policies, "resolve_policy", None)):
        getattr(memo, "cache_clear", lambda: None)()
    estimate(model, job)
"""
CALLGRIND_ESTIMATES = 200


def callgrind(trees: dict[str, str]) -> dict[str, object]:
    """Instructions (valgrind's callgrind) of ``import memplan`` + loading the model + one estimate, and
    per new-job estimate (the difference of a run with :data:`CALLGRIND_ESTIMATES` more, divided)."""
    out: dict[str, object] = {}
    for name, src in trees.items():
        counts = []
        for n in (0, CALLGRIND_ESTIMATES):
            done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                                   sys.executable, "-c", CALLGRIND_CASE, str(n)],
                                  env=dict(os.environ, PYTHONPATH=src), capture_output=True, text=True, check=True)
            counts.append(int(done.stderr.split("Collected :")[1].split()[0]))
        out[name] = {"start_and_first_estimate": counts[0],
                     "per_new_job_estimate": round((counts[1] - counts[0]) / CALLGRIND_ESTIMATES)}
    return out


#: The fine-tuning cells of ``--finetune`` (job flags; llama-3.1-8b, hf, 8 GPUs, seq 4096).
FINETUNE_CELLS = {
    "LoRA, recompute none": {"peft": "lora", "recompute": "none"},
    "LoRA, recompute full": {"peft": "lora", "recompute": "full"},
    "DoRA, recompute none": {"peft": "dora", "recompute": "none"},
    "DoRA, recompute full": {"peft": "dora", "recompute": "full"},
    "QLoRA nf4, recompute full": {"peft": "lora", "quantize_base": "nf4", "recompute": "full"},
}
FINETUNE_CASE = """
import json, sys, time
from memplan import estimate, policies
from memplan.estimate import engine
from memplan.inputs import JobRequest, load_job
flags = {"gpus": 8, "seq": 4096, "framework": "hf", **json.loads(sys.argv[1])}
loaded = load_job(JobRequest(model="llama-3.1-8b", flags=flags))
model, job = loaded.model, loaded.job
""" + _CLEAR_JOB_MEMOS + """def new_job():
    clear()
    return estimate(model, job)
for _ in range(2):
    new_job()
""" + "count = [0]" + OPCODE_CASE.split("count = [0]")[1].split("sys.settrace(tracer)")[0] + """sys.settrace(tracer)
new_job()
sys.settrace(None)
calls, cpu = 0, time.process_time()
while time.process_time() - cpu < 2.0:
    for _ in range(5):
        new_job()
    calls += 5
print(calls / (time.process_time() - cpu), count[0])
"""


def finetune_rates(trees: dict[str, str]) -> dict[str, object]:
    """New-job calls/s (CPU time, 3 alternating runs) and opcodes per new-job estimate of each fine-tuning cell."""
    out: dict[str, object] = {}
    for name, flags in FINETUNE_CELLS.items():
        cell: dict[str, dict[str, object]] = {tree: {"calls/s": []} for tree in trees}
        for _ in range(3):
            for tree, src in trees.items():
                rate_s, opcodes = _timed(["-c", FINETUNE_CASE, json.dumps(flags)],
                                         dict(os.environ, PYTHONPATH=src))[2].split()
                cell[tree]["calls/s"].append(round(float(rate_s)))  # type: ignore[union-attr]
                cell[tree]["opcodes per new-job estimate"] = int(opcodes)
        out[name] = cell
    out["machine"] = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                      f"load average {os.getloadavg()[0]:.1f} at the end")
    return out


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, its stdout) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def issue24(trees: dict[str, str]) -> dict[str, object]:
    """The paired issue-24 measures for each tree (``name -> src folder``)."""
    out: dict[str, object] = {}
    for cache in ("no bytecode cache", "bytecode cached"):
        envs = {name: dict(os.environ, PYTHONPATH=src) for name, src in trees.items()}
        for env in envs.values():
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            if cache == "no bytecode cache":
                env["PYTHONDONTWRITEBYTECODE"] = "1"
        for src in trees.values():
            if cache == "no bytecode cache":  # an existing cache is read even when none is written
                for folder in Path(src).rglob("__pycache__"):
                    shutil.rmtree(folder)
            else:
                subprocess.run([sys.executable, "-m", "compileall", "-q", src], check=True, capture_output=True)
        times: dict[str, list[tuple[float, float]]] = {"reference": [], **{n: [] for n in trees}}
        for _ in range(PAIRS):
            times["reference"].append(_timed(REFERENCE, dict(os.environ))[:2])
            for name, env in envs.items():
                times[name].append(_timed(ISSUE_ARGS, env)[:2])
        med = {n: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for n, v in times.items()}
        ref_wall, ref_cpu = med["reference"]
        out[f"process ({cache})"] = {
            n: {"wall_s": round(w, 4), "cpu_s": round(c, 4), "wall_ratio": round(w / ref_wall, 2),
                "cpu_ratio": round(c / ref_cpu, 2)} for n, (w, c) in med.items()}
    rates: dict[str, list[list[float]]] = {n: [] for n in trees}
    for _ in range(3):
        for name, src in trees.items():
            env = dict(os.environ, PYTHONPATH=src)
            rates[name].append([round(float(x)) for x in _timed(["-c", RATE_CASE], env)[2].split()])
    out["estimate() llama-3.1-8b, 8 GPUs DP, seq 4096 (calls/s: wall, CPU time, CPU time with every cache "
        "keyed on a Job value cleared before every call (a new job); 3 alternating runs)"] = rates
    out["estimate() of a new job, Python opcodes executed (deterministic)"] = {
        name: int(_timed(["-c", OPCODE_CASE], dict(os.environ, PYTHONPATH=src))[2]) for name, src in trees.items()}
    out["machine"] = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                      f"load average {os.getloadavg()[0]:.1f} at the end")
    return out


def _pin_to_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        return "pinned to 1 core"
    return "not pinned"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="cProfile the API loops")
    parser.add_argument("--issue24", action="store_true", help="the paired issue-24 measures")
    parser.add_argument("--base", help="also measure this tree's src folder (the commit before the work)")
    parser.add_argument("--write", action="store_true", help=f"store the issue-24 result in {RESULT}")
    parser.add_argument("--callgrind", action="store_true",
                        help="with --issue24: also count instructions under valgrind's callgrind (a few minutes)")
    parser.add_argument("--finetune", action="store_true", help="new-job rates of fine-tuning jobs")
    args = parser.parse_args()
    if args.finetune:
        trees = {"this tree": str(Path(__file__).resolve().parents[1] / "src")}
        if args.base:
            trees["base"] = args.base
        result = finetune_rates(trees)
        print(json.dumps(result, indent=1))
        if args.write:
            FINETUNE_RESULT.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                   **result}, indent=1) + "\n")
        return
    if args.issue24:
        trees = {"this tree": str(Path(__file__).resolve().parents[1] / "src")}
        if args.base:
            trees["base"] = args.base
        result = issue24(trees)
        if args.callgrind:
            result["callgrind instructions (import + model + first estimate; per new-job estimate)"] = callgrind(trees)
        print(json.dumps(result, indent=1))
        if args.write:
            RESULT.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          **result}, indent=1) + "\n")
        return

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
