"""The planned runtime on CPU: a real GPT-2-style training loop on the arena vs PyTorch's default allocator.

Parameters (fixed before the first run, issue 26's targets):

* model: transformers GPT2LMHeadModel, 4 layers, 256 wide, 4 heads, vocabulary 4,096, fp32, AdamW
  (lr 1e-4), dropout 0; every run starts from the same initial weights and data.
* fixed shapes: 16 steps of 8 x 128 tokens; default allocator vs ``runtime.planned(device="cpu")``
  interleaved in 12 rounds of one pair each, the order alternating (A B, B A, A B, ...) so that load
  drifts hit both. Steps 0..3 are warm-up (0 creates AdamW's states, 1 is recorded, 2 replays the
  provisional plan, 3 the final one and first touches its region); per run the median wall step time
  (time.perf_counter) and CPU step time (time.process_time, every thread: the fairer clock on a shared
  machine) of steps 4..15, and the whole run's sum (warm-up, recording and planning included).
  Reported per clock: ratio of the medians over rounds (the issue's figure: wall, idle machine),
  median of the per-round ratios, their range and a 95 % bootstrap interval (2,000 draws, seed 0).
  Targets: losses bit-identical, 0 fallback requests after warm-up, arena bytes <= 1.01 x the recorded
  peak of live bytes, step time within 3 % (wall ratio of medians <= 1.03).
* variable lengths: 24 steps of 4 sequences, stratified lognormal lengths (median 80, sigma 1.25,
  clipped to [16, 512], as benchmarks/ckpt_bench.py draws them) padded to a multiple of 64 (the
  signature); targets: fallback bytes <= 5 % of the bytes requested in the steps that are not a
  signature's first; arena + fallback peak below the caching allocator's simulated reserved for the
  same requests (the arena's own trace of the run, simulated with memplan.alloc.simulate, CUDA rules).
* the fixed-shape run's trace is also replayed through the C core (memplan alloc replay, profile).

Torch threads: the machine's default (2 here) for the timed comparison; intra-op worker threads may
allocate in another order than recorded, so the fixed-shape fallbacks are also counted in a run with 1
thread (whose arena trace is the one replayed). Writes benchmarks/results/runtime_cpu.json; ``--quick``
(2 layers, 128 wide, 12 steps, 10 rounds, 12 variable-length steps; under 3 minutes on an idle 2-core machine) writes
runtime_cpu_quick.json. Usage: python benchmarks/runtime_cpu.py [--quick | --variable-only]
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from statistics import NormalDist

import torch

from memplan.alloc import simulate
from memplan.alloc.runtime import planned, replay_trace

OUT = Path(__file__).resolve().parent / "results" / "runtime_cpu.json"
CFG = dict(n_layer=4, n_embd=256, n_head=4, vocab=4096, batch=8, seq=128, steps=16, rounds=12, warmup=4,
           var_steps=24, var_batch=4, median=80, sigma=1.25, min_len=16, max_len=512, bucket=64, seed=0)


def _model(cfg: dict) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(cfg["seed"])
    return GPT2LMHeadModel(GPT2Config(n_layer=cfg["n_layer"], n_embd=cfg["n_embd"], n_head=cfg["n_head"],
                                      vocab_size=cfg["vocab"], n_positions=cfg["max_len"], use_cache=False,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _lengths(cfg: dict) -> list[int]:
    normal, n = NormalDist(), cfg["var_steps"]
    raw = [cfg["median"] * math.exp(cfg["sigma"] * normal.inv_cdf((i + 0.5) / n)) for i in range(n)]
    lengths = [int(min(cfg["max_len"], max(cfg["min_len"], round(x)))) for x in raw]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg["seed"])).tolist()
    return [-(-lengths[i] // cfg["bucket"]) * cfg["bucket"] for i in order]


def _train(cfg: dict, init: dict, shapes: list[tuple[int, int]], arena=None) -> tuple[list[float], list[float], list[float]]:
    """Losses, wall seconds and process CPU seconds (every thread) of each step."""
    model = _model(cfg)
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    losses, wall, cpu = [], [], []
    for batch, length in shapes:
        began, began_cpu = time.perf_counter(), time.process_time()
        losses.append(train_step(model, opt, cfg["vocab"], (batch, length), gen, arena))
        wall.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    return losses, wall, cpu


def train_step(model, opt, vocab: int, shape: tuple[int, int], gen, arena=None, *, device: str = "cpu",
               autocast: torch.dtype | None = None) -> float:
    """One step of the loop the runtime serves (shared with runtime_gpu.py): signature, forward,
    backward, AdamW, zero_grad(set_to_none), ``arena.step()``; returns the loss."""
    if arena is not None:
        arena.signature(shape[1])
    tokens = torch.randint(0, vocab, shape, generator=gen, device=device)
    with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = loss.item()
    del loss, tokens
    if arena is not None:
        arena.step()
    return value


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _bootstrap(ratios: list[float], seed: int, draws: int = 2000) -> list[float]:
    """95 % percentile bootstrap interval of the median of the per-round ratios."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return [meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]]


def _summary(default: list[float], planned: list[float], seed: int) -> dict:
    """Rounds pair one default run with one planned run; a ratio > 1 is the planned arena slower."""
    ratios = [p / d for p, d in zip(planned, default)]
    return {"default_s": default, "planned_s": planned, "round_ratios": ratios,
            "ratio_of_medians": statistics.median(planned) / statistics.median(default),
            "median_round_ratio": statistics.median(ratios), "min_round_ratio": min(ratios),
            "max_round_ratio": max(ratios), "bootstrap_95": _bootstrap(ratios, seed)}


def _timed_run(cfg: dict, init: dict, shapes: list, reference: list[float], variant: str) -> dict:
    if variant == "default":
        losses, wall, cpu = _train(cfg, init, shapes)
        return {"variant": variant, "identical": losses == reference, "wall": wall, "cpu": cpu}
    with planned(device="cpu") as arena:
        losses, wall, cpu = _train(cfg, init, shapes, arena)
    stats = arena.stats()
    after = [h for h in arena.history if h.index >= cfg["warmup"] and h.allocs]
    return {"variant": variant, "identical": losses == reference, "wall": wall, "cpu": cpu,
            "fallback_allocs_after_warmup": sum(h.fallback_allocs for h in after),
            "allocs_after_warmup": sum(h.allocs for h in after),
            "modes": [h.mode for h in arena.history if h.allocs], "arena_bytes": stats["arena_bytes"],
            "recorded_peak_live_bytes": stats["recorded_peak_live_bytes"],
            "fallback_peak_bytes": stats["fallback_peak_bytes"],
            "swapped_slots": stats["swapped_slots"], "overlap_refusals": stats["overlap_refusals"]}


def fixed_shapes(cfg: dict, init: dict) -> dict:
    """Default and planned runs interleaved A B, B A, A B, ... (one pair a round); per run the median
    wall and CPU step time after warm-up, and the whole run (warm-up, recording and planning included)."""
    shapes = [(cfg["batch"], cfg["seq"])] * cfg["steps"]
    reference, _, _ = _train(cfg, init, shapes)
    times: dict[str, dict[str, list[float]]] = {v: {"wall": [], "cpu": [], "whole_wall": [], "whole_cpu": []}
                                                for v in ("default", "planned")}
    runs = []
    for r in range(cfg["rounds"]):
        for variant in (("default", "planned") if r % 2 == 0 else ("planned", "default")):
            run = _timed_run(cfg, init, shapes, reference, variant)
            for clock in ("wall", "cpu"):
                times[variant][clock].append(statistics.median(run[clock][cfg["warmup"]:]))
                times[variant]["whole_" + clock].append(sum(run.pop(clock)))
            runs.append(run)
        d, p = times["default"], times["planned"]
        print(f"round {r + 1}/{cfg['rounds']}: wall {p['wall'][-1] / d['wall'][-1]:.3f}, cpu {p['cpu'][-1] / d['cpu'][-1]:.3f}",
              file=sys.stderr, flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # intra-op threads may allocate in another order than recorded: count with 1 too
    with planned(device="cpu", trace_events=2_000_000) as arena1:
        _train(cfg, init, shapes, arena1)
    torch.set_num_threads(threads)
    one = [h for h in arena1.history if h.index >= cfg["warmup"] and h.allocs]
    trace = arena1.trace()
    last = [r for r in runs if r["variant"] == "planned"]
    d, p = times["default"], times["planned"]
    return {"runs": runs, "step_time_ratio": statistics.median(p["wall"]) / statistics.median(d["wall"]),
            "wall": _summary(d["wall"], p["wall"], cfg["seed"]), "cpu": _summary(d["cpu"], p["cpu"], cfg["seed"]),
            "whole_run_wall": _summary(d["whole_wall"], p["whole_wall"], cfg["seed"]),
            "whole_run_cpu": _summary(d["whole_cpu"], p["whole_cpu"], cfg["seed"]),
            "losses_identical": all(r["identical"] for r in runs),
            "fallback_allocs_after_warmup_1_thread": sum(h.fallback_allocs for h in one),
            "arena_over_recorded_peak": max(r["arena_bytes"] / r["recorded_peak_live_bytes"] for r in last),
            "trace_replay": replay_trace(trace).to_dict(), "trace_events": len(trace.events), "torch_threads": threads}


def variable_lengths(cfg: dict, init: dict) -> dict:
    lengths = _lengths(cfg)
    shapes = [(cfg["var_batch"], n) for n in lengths]
    reference, _, _ = _train(cfg, init, shapes)
    with planned(device="cpu", trace_events=4_000_000) as arena:
        losses, _, _ = _train(cfg, init, shapes, arena)
    seen: set[str] = set()
    later_bytes = later_fallback = 0
    for h in arena.history:
        if not h.allocs:
            continue
        if h.key in seen:
            later_bytes += h.allocated_bytes
            later_fallback += h.allocated_bytes if h.mode == "record" else h.fallback_bytes
        seen.add(h.key)
    stats = arena.stats()
    sim = simulate(arena.trace())
    return {"lengths": lengths, "signatures": len(set(lengths)), "losses_identical": losses == reference,
            "fallback_share_after_first": later_fallback / max(later_bytes, 1),
            "planned_peak_reserved_bytes": stats["peak_reserved_bytes"],
            "arena_bytes": stats["arena_bytes"], "fallback_peak_bytes": stats["fallback_peak_bytes"],
            "caching_simulated_reserved_bytes": sim.peak_reserved_bytes,
            "modes": [(h.key, h.mode, h.fallback_allocs) for h in arena.history if h.allocs]}


def main() -> None:
    cfg = dict(CFG)
    if "--quick" in sys.argv:  # the same protocol on a model ~6x cheaper per step (under 3 minutes idle)
        cfg.update(n_layer=2, n_embd=128, steps=12, rounds=10, var_steps=12)
    init = _model(cfg).state_dict()
    init = {k: v.clone() for k, v in init.items()}
    if "--variable-only" in sys.argv:  # re-measure the variable-length part, keep the fixed-shape one
        result = json.loads(OUT.read_text())
        load = _load()
        result["variable"] = variable_lengths(cfg, init)
        result["variable"].update(load_before=load, load_after=_load(),
                                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        result["targets"]["variable_fallback_le_5pct"] = result["variable"]["fallback_share_after_first"] <= 0.05
        result["targets"]["variable_below_caching"] = (result["variable"]["planned_peak_reserved_bytes"]
                                                       < result["variable"]["caching_simulated_reserved_bytes"])
        OUT.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["targets"], indent=2))
        return
    load_before, began = _load(), time.time()
    result = {"config": cfg, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}", "load_before": load_before}
    result["fixed"] = fixed_shapes(cfg, init)
    result["variable"] = variable_lengths(cfg, init)
    result["load_after"], result["seconds"] = _load(), round(time.time() - began, 1)
    fixed, var = result["fixed"], result["variable"]
    result["targets"] = {
        "losses_bit_identical": fixed["losses_identical"] and var["losses_identical"],
        "fallback_after_warmup_0": all(r.get("fallback_allocs_after_warmup", 0) == 0 for r in fixed["runs"]),
        "fallback_after_warmup_0_one_thread": fixed["fallback_allocs_after_warmup_1_thread"] == 0,
        "arena_le_1.01x_recorded_peak": fixed["arena_over_recorded_peak"] <= 1.01,
        "step_time_within_3pct": fixed["step_time_ratio"] <= 1.03,
        "step_time_within_3pct_cpu": fixed["cpu"]["ratio_of_medians"] <= 1.03,
        "step_time_bootstrap_upper_within_3pct": fixed["wall"]["bootstrap_95"][1] <= 1.03,
        "variable_fallback_le_5pct": var["fallback_share_after_first"] <= 0.05,
        "variable_below_caching": var["planned_peak_reserved_bytes"] < var["caching_simulated_reserved_bytes"],
    }
    (OUT.with_name("runtime_cpu_quick.json") if "--quick" in sys.argv else OUT).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("targets", "load_before", "load_after", "seconds")}, indent=2))
    for clock in ("wall", "cpu"):
        t = fixed[clock]
        print(f"{clock}: ratio of medians {t['ratio_of_medians']:.4f}, median round ratio {t['median_round_ratio']:.4f}, "
              f"rounds {t['min_round_ratio']:.3f}-{t['max_round_ratio']:.3f}, bootstrap 95% "
              f"{t['bootstrap_95'][0]:.4f}-{t['bootstrap_95'][1]:.4f}")
    print("fallback share", round(var["fallback_share_after_first"], 4))


if __name__ == "__main__":
    main()
