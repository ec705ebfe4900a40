"""The benchmark step by step with every variant in its own process: paired in time, apart in memory.

:mod:`memplan.ckpt.bench_interleave` runs every variant in one process. Their steps then share one
C heap: on CPU, whichever variant first reaches a new peak of the process faults the fresh pages in
(10–20 µs per 4 KiB page on the benchmark's VM), and with a fixed batch order and a rotated variant
order that is the same variant every time — memplan's lane was first on the 386- and 544-token
batches of the 24-step run (docs/ckpt.md, issue-29 follow-up 3). A user trains one model per process.

Here each variant runs in a worker process of its own (``spawn``: a fresh interpreter, its own heap)
with its own model, AdamW and judge, built from the same seed (the losses show they are the same
weights). The parent process only schedules: seeding one worker after another, then step ``i`` of
every worker in turn (the order rotated every step) before step ``i + 1`` of any, so that each
variant's step ``i`` runs within seconds of the others', under the same load, one at a time. Each
worker records its steps' wall seconds, process CPU seconds and minor page faults
(``getrusage``), and sends back its :class:`~memplan.ckpt.bench_setup.Run`. With
``static_retain`` (supplementary runs) the static variants' workers keep freed memory as memplan's does.
"""

from __future__ import annotations

import multiprocessing
import resource
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memplan.ckpt.bench_interleave import lane_run, make_lane, seed_lane, timed_step
from memplan.ckpt.bench_setup import MEMPLAN, BenchConfig, Run
from memplan.ckpt.hostmem import retain_freed_memory

__all__ = ["run_in_processes"]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _worker(conn: Any, cfg: BenchConfig, variant: str, budget: int, batches: Sequence[torch.Tensor]) -> None:
    """One variant: build, then obey "seed", a step index, or None (send the run and stop)."""
    try:
        torch.set_num_threads(cfg.threads)
        host = retain_freed_memory() if cfg.static_retain and variant not in MEMPLAN else ""
        lane = make_lane(variant, cfg, None, budget)  # type: ignore[arg-type]  (None: the seed's own weights)
        faults: list[int] = []
        conn.send(("up", None))
        while (msg := conn.recv()) is not None:
            if msg == "seed":
                seed_lane(lane, cfg)
                conn.send(("seeded", lane.seconds))
                continue
            f0 = _faults()
            wall = timed_step(lane, batches[msg])
            faults.append(_faults() - f0)
            conn.send(("step", wall))
        conn.send(("run", lane_run(lane, batches, faults, host)))
    except BaseException:  # reported to the parent, which raises it there
        conn.send(("error", traceback.format_exc()))


def _ask(conn: Any, variant: str, message: Any, expect: str) -> Any:
    if message is not ...:
        conn.send(message)
    kind, value = conn.recv()
    if kind == "error":
        raise RuntimeError(f"benchmark worker for {variant!r} failed:\n{value}")
    if kind != expect:
        raise RuntimeError(f"benchmark worker for {variant!r} answered {kind!r}, expected {expect!r}")
    return value


def run_in_processes(cfg: BenchConfig, variants: Sequence[str], batches: Sequence[torch.Tensor], budget: int,
                     say: Callable[[str], None] = lambda _m: None) -> tuple[Run, ...]:
    """Every variant in ``variants`` in its own process, step by step (see the module docstring)."""
    ctx = multiprocessing.get_context("spawn")
    workers = []
    for variant in variants:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, cfg, variant, budget, list(batches)), daemon=True)
        proc.start()
        workers.append((variant, proc, parent))
    try:
        for variant, _, conn in workers:
            _ask(conn, variant, ..., "up")
        for variant, _, conn in workers:  # one at a time: seeding is timed
            _ask(conn, variant, "seed", "seeded")
        seconds = dict.fromkeys(variants, 0.0)
        for i in range(len(batches)):
            for variant, _, conn in workers[i % len(workers):] + workers[:i % len(workers)]:
                seconds[variant] += _ask(conn, variant, i, "step")
            if (i + 1) % 6 == 0:
                say(f"step {i + 1}/{len(batches)}: " + ", ".join(f"{v} {s:.0f} s" for v, s in seconds.items()))
        return tuple(_ask(conn, variant, None, "run") for variant, _, conn in workers)
    finally:
        for _, proc, _ in workers:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
