"""Speed of ``memplan alloc``: a 1,000,000-event synthetic training trace simulated and planned.

Targets (issue 5): simulated in <= 10 s, planned in <= 60 s on this machine. The trace: weights,
gradients and Adam states allocated at setup, then iterations of a 24-layer transformer-shaped
step: per layer a few saved activations (kept to the backward pass) and temporaries freed at once,
backward frees in reverse with temporaries, an optimizer temporary per layer. Sizes vary per layer
so the allocator sees real best-fit work; one request per layer has an iteration-dependent
size (MoE-like), so the planner sees dynamic requests too. Writes benchmarks/results/alloc_speed.json.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from memplan.alloc.planner import plan_trace
from memplan.alloc.simulator import simulate
from memplan.events import AllocEvent, Trace

MiB = 2**20


def synthetic_trace(target_events: int = 1_000_000, layers: int = 24, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    events: list[AllocEvent] = []
    block = 0

    def alloc(size, cat, phase, it):
        nonlocal block
        block += 1
        events.append(AllocEvent(len(events), "alloc", block, size, cat, phase, it))
        return block, size, cat, phase, it

    def free(b):
        events.append(AllocEvent(len(events), "free", b[0], b[1], b[2], b[3], b[4]))

    hidden = [rng.choice((24, 32, 48)) * MiB for _ in range(layers)]
    temps = [[[rng.choice((h // 4, h // 2, 3 * MiB + 4096 * t, 700 * 1024)) for t in range(8)] for _ in range(6)]
             for h in hidden]
    for h in hidden:
        for cat in ("parameter", "gradient", "optimizer_state", "optimizer_state"):
            alloc(h, cat, "setup", -1)
    it = 0
    while len(events) < target_events:  # whole iterations: the trace ends cleanly, just past the target
        saved = []
        for layer in range(layers):
            h = hidden[layer]
            for k in range(6):
                saved.append(alloc(h // (k + 1) + 512 * k, "activation", "forward", it))
                for t in range(8):
                    free(alloc(temps[layer][k][t], "temporary", "forward", it))
            # one MoE-like request per layer whose size depends on the batch's token routing
            free(alloc(rng.randrange(1, 64) * 256 * 1000 + 8, "temporary", "forward", it))
        for layer in reversed(range(layers)):
            for t in range(10):
                free(alloc(hidden[layer] // (t % 3 + 1), "temporary", "backward", it))
            for _ in range(6):
                free(saved.pop())
        for layer in range(layers):
            free(alloc(hidden[layer], "temporary", "optimizer", it))
        it += 1
    return Trace(events=tuple(events))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    t0 = time.perf_counter()
    trace = synthetic_trace(n)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    sim = simulate(trace)
    sim_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = plan_trace(trace, time_limit=20)
    plan_s = time.perf_counter() - t0
    out = {
        "events": len(trace), "build_seconds": round(build, 2),
        "simulate_seconds": round(sim_s, 2), "simulate_target_seconds": 10, "simulate_ok": sim_s <= 10,
        "plan_seconds": round(plan_s, 2), "plan_target_seconds": 60, "plan_ok": plan_s <= 60,
        "peak_reserved_bytes": sim.peak_reserved_bytes, "lower_bound_bytes": plan.lower_bound_bytes,
        "plan_bytes": plan.pool_bytes, "plan_method": plan.method, "plan_counts": plan.counts,
        "caching_fragmentation": round(sim.fragmentation, 4), "plan_fragmentation": round(plan.fragmentation, 4),
    }
    print(json.dumps(out, indent=2))
    Path(__file__).with_name("results").joinpath("alloc_speed.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
