"""Diagnosis of issue-29 follow-up 3: where memplan's plain loop loses time against static SAC on the 24-step run.

The benchmark's variants (e.g. ``none,full,plain,sac``) take turns step by step in ONE process, as
``interleave="step"`` ran them, on the benchmark's 24 batches; per step it records wall and process
CPU seconds, minor page faults (``getrusage``), the judge's peak and memplan's plan (k keep, s sac0,
F full), whether memplan metered the step and its planning seconds. The budget is the 24-step run's
(1,748,551,616 bytes; BUDGET=... for other step counts). Results of 2026-12-06 (docs/ckpt.md):
``benchmarks/results/ckpt_where_default.json`` (glibc defaults) and ``ckpt_where_retained.json`` (run with
``MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_MMAP_MAX_=0``)::

    PYTHONPATH=src python benchmarks/ckpt_where.py none,full,plain,sac OUT.json [STEPS]
"""
import copy
import json
import os
import resource
import sys
import time

import torch
from memplan.ckpt.bench import BenchConfig, sample_lengths, _batches
from memplan.ckpt.bench_setup import build_model, seed_memplan, MEMPLAN
from memplan.ckpt.bench_interleave import _train_step, make_lane

def faults():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt
variants = sys.argv[1].split(",")
out = sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 24
cfg = BenchConfig(steps=steps)
torch.set_num_threads(1)
lengths = sample_lengths(cfg)
m = build_model(cfg)
init = copy.deepcopy(m.state_dict())
del m
batches = _batches(cfg, lengths, cfg.seed + 1, cfg.batch_size)
budget = 1748551616 if steps == 24 else int(os.environ.get("BUDGET", "0"))
lanes = [make_lane(v, cfg, init, budget) for v in variants]
rec = {v: [] for v in variants}
for lane in lanes:
    if lane.variant in MEMPLAN:
        t0 = time.perf_counter()
        with lane.judge:
            lane.judge.start(lane.model, None)
            seed_memplan(lane.model, cfg, lane.judge, lane.live)
        print("seed", time.perf_counter() - t0, flush=True)
for i, b in enumerate(batches):
    order = lanes[i % len(lanes):] + lanes[:i % len(lanes)]
    for lane in order:
        ctl = getattr(lane.model, "memplan_ckpt", None)
        ps = ctl.stats().plan_seconds if ctl else 0
        f0, t0, c0 = faults(), time.perf_counter(), time.process_time()
        with lane.judge:
            _train_step(lane, b)
        r = dict(wall=time.perf_counter() - t0, cpu=time.process_time() - c0, minflt=faults() - f0,
                 peak=lane.live.peaks[-1])
        if ctl:
            st = ctl.stats()
            size, plan, mpeak = ctl.last
            r.update(modes="".join({"keep": "k", "sac0": "s", "full": "F"}.get(plan.mode(j), "?") for j in range(8)),
                     metered=mpeak > 0, plan_s=st.plan_seconds - ps, pred=plan.predicted_peak_bytes)
        rec[lane.variant].append(r)
    print(i, lengths[i], " ".join(f"{v} {rec[v][-1]['wall']:.2f}/{rec[v][-1]['minflt']//1000}k" for v in variants),
          rec.get("plain", [{}])[-1].get("modes", ""), flush=True)
for lane in lanes:
    c = getattr(lane.model, "memplan_ckpt", None)
    if c:
        c.release_meter()
json.dump(dict(lengths=lengths, rec=rec, load=os.getloadavg()), open(out, "w"), indent=1)
