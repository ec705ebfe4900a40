"""The planned runtime on CUDA vs PyTorch's caching allocator: reserved, fragmentation, step time, losses.

NOT RUN YET (no GPU was lent to the session that wrote it): no result of this script is recorded;
run it in one command on a machine with one CUDA GPU and a C compiler (never in CI):

    PYTHONPATH=src python benchmarks/runtime_gpu.py            # writes benchmarks/results/runtime_gpu.json

Parameters (fixed before any run): transformers GPT2LMHeadModel, 12 layers, 768 wide, 12 heads,
vocabulary 50,257, bf16 autocast, AdamW (lr 1e-4, foreach), dropout 0; fixed shapes 8 x 1024 tokens,
24 steps; then variable lengths (stratified lognormal, median 256, sigma 1.0, clipped to [64, 1024],
padded to a multiple of 128, 24 steps, 8 sequences). Variants, alternating order over 3 rounds:
``caching`` (PyTorch's default allocator; reserved = torch.cuda.max_memory_reserved(), fragmentation
= 1 - max allocated / max reserved) and ``planned`` (``runtime.planned(device="cuda")``: the core in a
CUDAPluggableAllocator MemPool around the steps; reserved = the core's peak of arena + fallback plus
what the caching allocator reserved outside the pool (weights, optimizer states made before entering);
fragmentation = 1 - the core's peak live bytes / its peak reserved). Step time: median of steps 3..23
after torch.cuda.synchronize(). Losses: equal, and the largest absolute difference.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from statistics import NormalDist

OUT = Path(__file__).resolve().parent / "results" / "runtime_gpu.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))
CFG = dict(n_layer=12, n_embd=768, n_head=12, vocab=50257, batch=8, seq=1024, steps=24, rounds=3, warmup=3,
           median=256, sigma=1.0, min_len=64, max_len=1024, bucket=128, seed=0)


def _model(torch, cfg):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(cfg["seed"])
    config = GPT2Config(n_layer=cfg["n_layer"], n_embd=cfg["n_embd"], n_head=cfg["n_head"], vocab_size=cfg["vocab"],
                        n_positions=cfg["max_len"], use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).cuda()


def _lengths(cfg):
    normal, n = NormalDist(), cfg["steps"]
    raw = [cfg["median"] * math.exp(cfg["sigma"] * normal.inv_cdf((i + 0.5) / n)) for i in range(n)]
    lengths = [int(min(cfg["max_len"], max(cfg["min_len"], round(x)))) for x in raw]
    return [-(-x // cfg["bucket"]) * cfg["bucket"] for x in lengths[::2] + lengths[1::2]]


def _run(torch, cfg, shapes, planned: bool):
    from runtime_cpu import train_step

    from memplan.alloc import runtime

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = _model(torch, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator(device="cuda").manual_seed(cfg["seed"] + 1)
    losses, times, arena = [], [], None
    scope = runtime.planned(device="cuda") if planned else None
    if scope is not None:
        arena = scope.__enter__()
    try:
        for batch, length in shapes:
            torch.cuda.synchronize()
            began = time.perf_counter()
            losses.append(train_step(model, opt, cfg["vocab"], (batch, length), gen, arena, device="cuda",
                                     autocast=torch.bfloat16))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)
    out = {"losses": losses, "step_s": statistics.median(times[cfg["warmup"]:]),
           "max_reserved_bytes": torch.cuda.max_memory_reserved(), "max_allocated_bytes": torch.cuda.max_memory_allocated()}
    if arena is not None:
        s = arena.stats()
        out.update(core=s, fallback_allocs_after_warmup=sum(h.fallback_allocs for h in arena.history if h.index >= cfg["warmup"]),
                   reserved_bytes=s["peak_reserved_bytes"] + out["max_reserved_bytes"],
                   fragmentation=1 - s["peak_live_bytes"] / max(s["peak_reserved_bytes"], 1))
    else:
        out.update(reserved_bytes=out["max_reserved_bytes"],
                   fragmentation=1 - out["max_allocated_bytes"] / max(out["max_reserved_bytes"], 1))
    del model, opt
    return out


def main() -> None:
    try:
        import torch
    except ImportError:
        sys.exit("runtime_gpu.py needs torch with CUDA")
    if not torch.cuda.is_available():
        sys.exit("runtime_gpu.py needs a CUDA GPU; none is available (nothing was measured)")
    cfg = dict(CFG)
    result = {"config": cfg, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "measured": True, "runs": {}}
    for name, shapes in (("fixed", [(cfg["batch"], cfg["seq"])] * cfg["steps"]),
                         ("variable", [(cfg["batch"], n) for n in _lengths(cfg)])):
        runs = []
        for r in range(cfg["rounds"]):
            for planned in ((False, True) if r % 2 == 0 else (True, False)):
                runs.append({"variant": "planned" if planned else "caching", **_run(torch, cfg, shapes, planned)})
                print(name, runs[-1]["variant"], runs[-1]["reserved_bytes"], round(runs[-1]["step_s"], 4), flush=True)
        caching = [x for x in runs if x["variant"] == "caching"]
        plan = [x for x in runs if x["variant"] == "planned"]
        result["runs"][name] = {
            "runs": runs,
            "step_time_ratio": statistics.median(x["step_s"] for x in plan) / statistics.median(x["step_s"] for x in caching),
            "reserved_ratio": max(x["reserved_bytes"] for x in plan) / max(x["reserved_bytes"] for x in caching),
            "losses_equal": all(x["losses"] == caching[0]["losses"] for x in plan),
            "max_loss_diff": max(abs(a - b) for x in plan for a, b in zip(x["losses"], caching[0]["losses"])),
        }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in result["runs"].items()}, indent=2))


if __name__ == "__main__":
    main()
