"""``memplan alloc``: simulate the CUDA caching allocator, plan a static layout, compare both.

Imports nothing heavy at module level: numpy and the allocator modules load inside the commands.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Any

import typer

from memplan.commands.common import Command as _Command
from memplan.commands.common import check_output_path, command_group, handle_errors
from memplan.errors import ConfigError

alloc_app = command_group("alloc", "Caching-allocator simulation and STAlloc-style static memory plans.")

_TRACE_HELP = "A memplan trace (.mptrace / .jsonl.gz) or a torch.cuda.memory._dump_snapshot() pickle."
_SIM_EPILOG = """\
Examples:

  memplan alloc simulate step.mptrace

  memplan alloc simulate snapshot.pickle --capacity 80GiB --json

  memplan alloc simulate step.mptrace --expandable-segments --max-split-size-mb 128

Exit codes: 0 ok (also when an OOM is predicted: see the table), 1 unsupported, 2 invalid input.
"""
_PLAN_EPILOG = """\
Examples:

  memplan alloc plan step.mptrace -o plan.json

  memplan alloc plan buffers.csv -o solved.csv --capacity 1048576

A CSV input (MiniMalloc: id,lower,upper,size) is written back with an offset column.
"""
_CMP_EPILOG = """\
Examples:

  memplan alloc compare step.mptrace

  memplan alloc compare snapshot.pickle --json
"""


def _print(*renderables: Any) -> None:
    from rich.console import Console

    Console(highlight=False).print(*renderables)


def _load(path: str) -> tuple[Any, Any]:
    if not os.path.isfile(path):
        raise ConfigError("TRACE", "must be an existing file", path)
    from memplan.alloc import load_trace_or_snapshot

    return load_trace_or_snapshot(path)


def _settings(base: Any, capacity: str | None, expandable: bool | None, max_split_mb: int | None,
              conf: str | None) -> Any:
    from memplan.alloc.settings import AllocatorSettings
    from memplan.units import MiB, parse_bytes

    settings = AllocatorSettings.parse(conf) if conf else (base or AllocatorSettings())
    changes: dict[str, Any] = {}
    if capacity is not None:
        changes["capacity"] = parse_bytes(capacity, field="--capacity")
    if expandable is not None:
        changes["expandable_segments"] = expandable
    if max_split_mb is not None:
        if max_split_mb <= 20:
            raise ConfigError("--max-split-size-mb", "must be greater than 20", max_split_mb)
        changes["max_split_size"] = max_split_mb * MiB
    return settings.with_changes(**changes)


@alloc_app.command("simulate", cls=_Command, epilog=_SIM_EPILOG)
def simulate_command(
    trace: Annotated[str, typer.Argument(help=_TRACE_HELP, show_default=False)],
    capacity: Annotated[str | None, typer.Option("--capacity", help="Device memory, e.g. 80GiB (default: unlimited).")] = None,
    expandable_segments: Annotated[bool | None, typer.Option("--expandable-segments/--no-expandable-segments", help="Simulate expandable_segments:True.")] = None,
    max_split_size_mb: Annotated[int | None, typer.Option("--max-split-size-mb", help="max_split_size_mb (> 20).", metavar="N")] = None,
    alloc_conf: Annotated[str | None, typer.Option("--alloc-conf", help="A PYTORCH_CUDA_ALLOC_CONF string.", metavar="CONF")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print SimResult.to_dict() as JSON.")] = False,
) -> None:
    """Replay TRACE through PyTorch's CUDA caching allocator rules: reserved, allocated, fragmentation, OOM."""
    with handle_errors():
        events, recorded = _load(trace)
        settings = _settings(recorded, capacity, expandable_segments, max_split_size_mb, alloc_conf)
        from memplan.alloc.simulator import simulate

        result = _with_progress(len(events), lambda cb: simulate(events, settings, progress=cb))
    if json_output:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
        return
    from memplan.report.alloc_text import simulation_table

    _print(simulation_table(result, settings, os.path.basename(trace)))
    if result.oom is not None:
        typer.secho(f"predicted OOM at event {result.oom.event_index}: {result.oom.message}", fg="red")


@alloc_app.command("plan", cls=_Command, epilog=_PLAN_EPILOG)
def plan_command(
    trace: Annotated[str, typer.Argument(help=_TRACE_HELP + " Or a MiniMalloc CSV.", show_default=False)],
    output: Annotated[str, typer.Option("-o", "--output", help="plan.json (trace input) or out.csv (CSV input).")],
    capacity: Annotated[str | None, typer.Option("--capacity", help="Bytes the plan must fit in, e.g. 1048576 or 80GiB.")] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", help="Seconds of search.")] = 10.0,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan summary as JSON.")] = False,
) -> None:
    """Compute a static memory plan (STAlloc-style) for TRACE, or solve a MiniMalloc CSV."""
    with handle_errors():
        from memplan.units import parse_bytes

        check_output_path("--output", output)
        cap = parse_bytes(capacity, field="--capacity") if capacity is not None else None
        if trace.lower().endswith(".csv"):
            summary = _plan_csv(trace, output, cap, time_limit)
        else:
            events, _ = _load(trace)
            from memplan.alloc.planner import plan_trace

            plan = _with_progress(len(events), lambda cb: plan_trace(events, capacity=cap, time_limit=time_limit))
            with open(output, "w", encoding="utf-8") as handle:
                json.dump(plan.to_dict(), handle)
            summary = plan.to_dict(requests=False)
    if json_output:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        return
    from memplan.report.alloc_text import static_plan_table

    _print(static_plan_table(summary, os.path.basename(trace), output))


def _plan_csv(path: str, output: str, capacity: int | None, time_limit: float) -> dict[str, Any]:
    from memplan.alloc import dsa
    from memplan.alloc.minimalloc import read_minimalloc_csv, write_minimalloc_csv

    buffers = read_minimalloc_csv(path)
    starts, ends, sizes = ([b.start for b in buffers], [b.end for b in buffers], [b.size for b in buffers])
    lower = dsa.live_peak(starts, ends, sizes)
    if capacity is not None and capacity < lower:
        raise ConfigError("--capacity", f"cannot hold the buffers: their live bytes peak at {lower}", capacity,
                          hint=f"give at least {lower}")
    result = dsa.solve(starts, ends, sizes, capacity=capacity, time_limit=time_limit)
    write_minimalloc_csv(output, buffers, result.offsets)
    fits = capacity is None or result.peak <= capacity
    summary = {"pool_bytes": result.peak, "lower_bound_bytes": lower, "capacity": capacity, "fits": fits,
               "overhead": round(result.peak / lower, 6) if lower else 1.0, "method": result.method}
    if not fits:
        from memplan.errors import MemplanError

        raise MemplanError(f"no placement within {capacity} bytes found in {time_limit:g} s; the best "
                           f"needs {result.peak} (lower bound {lower}); written to {output} anyway")
    return summary


@alloc_app.command("compare", cls=_Command, epilog=_CMP_EPILOG)
def compare_command(
    trace: Annotated[str, typer.Argument(help=_TRACE_HELP, show_default=False)],
    time_limit: Annotated[float, typer.Option("--time-limit", help="Seconds of plan search.")] = 10.0,
    json_output: Annotated[bool, typer.Option("--json", help="Print the four numbers as JSON.")] = False,
) -> None:
    """One table: lower bound, caching allocator, expandable segments and static plan for TRACE."""
    with handle_errors():
        events, recorded = _load(trace)
        from memplan.alloc.compare import compare

        result = _with_progress(len(events), lambda cb: compare(events, recorded, time_limit=time_limit))
    if json_output:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
        return
    from memplan.report.alloc_text import comparison_table

    _print(comparison_table(result, os.path.basename(trace)))


_REPLAY_EPILOG = """\
Examples:

  memplan alloc replay step.mptrace

  memplan alloc replay snapshot.pickle --json

  memplan alloc replay step.mptrace --save-plan plan.json; memplan alloc replay step.mptrace --plan plan.json

  memplan alloc replay long_run.mptrace --mode online

Exit codes: 0 ok, 1 the runtime core is not built and no C compiler is found, 2 invalid input (a plan
file for another trace or shape, a corrupted plan file).
"""


@alloc_app.command("replay", cls=_Command, epilog=_REPLAY_EPILOG)
def replay_command(
    trace: Annotated[str, typer.Argument(help=_TRACE_HELP, show_default=False)],
    mode: Annotated[str, typer.Option("--mode", help="profile: record the whole trace, plan, replay it; online: steps per iteration, first ones recorded.")] = "profile",
    plan: Annotated[str | None, typer.Option("--plan", help="Replay with this plan file (from --save-plan) instead of recording.", metavar="PLAN")] = None,
    save_plan: Annotated[str | None, typer.Option("--save-plan", help="Write the plan made from TRACE (profile mode).", metavar="PLAN")] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", help="Seconds of plan search.")] = 5.0,
    json_output: Annotated[bool, typer.Option("--json", help="Print caching/planned reserved bytes and fragmentation as JSON.")] = False,
) -> None:
    """Drive the planned runtime's C core with TRACE (no torch); report it next to the caching allocator."""
    with handle_errors():
        if plan is not None and not os.path.isfile(plan):
            raise ConfigError("--plan", "must be an existing plan file", plan)
        if save_plan is not None:
            check_output_path("--save-plan", save_plan)
        events, recorded = _load(trace)
        from memplan.alloc.runtime import replay_trace

        result = replay_trace(events, mode=mode, settings=recorded, plan=plan, save_plan=save_plan,  # type: ignore[arg-type]
                              time_limit=time_limit)
    if json_output:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
        return
    _print(result)


def _with_progress(n_events: int, work: Any) -> Any:
    """Run ``work(callback)``; show a spinner for traces big enough to take more than ~2 s."""
    if n_events < 300_000 or not sys.stderr.isatty():
        return work(None)
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task("replaying", total=n_events)
        return work(lambda position: progress.update(task, completed=position))


