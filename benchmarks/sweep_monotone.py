"""Monotonicity of the estimate over every preset and framework (8 GPUs): the peak never falls as the sequence or
the micro-batch grows (recompute none and full), full recompute is never above none, activation offload is never
above none (plain, LoRA, full recompute; hf and torchtitan, whose offload is save_on_cpu), and a higher ZeRO stage
is never above a lower one (deepspeed). Refused jobs are skipped. Exit 1 on any violation.

    python benchmarks/sweep_monotone.py   # ~5 minutes on 2 cores
"""
import itertools, sys
from memplan import estimate
from memplan.errors import MemplanError
from memplan.inputs import JobRequest, load_job
from memplan.model.presets import preset_names
def peak(model, flags):
    try:
        lj = load_job(JobRequest(model=model, flags=flags))
        return estimate(lj.model, lj.job).peak_allocated_bytes
    except MemplanError:
        return None
bad = []; checks = 0
names = list(preset_names())
for model in names:
    for fw in ("megatron", "torchtitan", "deepspeed", "hf"):
        base = {"framework": fw, "gpus": 8}
        for rc in ("none", "full"):
            seqs = [peak(model, {**base, "seq": s, "recompute": rc}) for s in (512, 1024, 2048, 4096)]
            for a, b in zip(seqs, seqs[1:]):
                if a and b: checks += 1; (b < a) and bad.append((model, fw, rc, "seq", a, b))
            mbss = [peak(model, {**base, "mbs": m, "recompute": rc, "seq": 1024}) for m in (1, 2, 4)]
            for a, b in zip(mbss, mbss[1:]):
                if a and b: checks += 1; (b < a) and bad.append((model, fw, rc, "mbs", a, b))
        for s in (1024, 4096):
            n, f = peak(model, {**base, "seq": s}), peak(model, {**base, "seq": s, "recompute": "full"})
            if n and f: checks += 1; (f > n) and bad.append((model, fw, s, "full>none", n, f))
            if fw in ("hf", "torchtitan"):
                o = peak(model, {**base, "seq": s, "offload_activations": True})
                if n and o: checks += 1; (o > n) and bad.append((model, fw, s, "offload>none", n, o))
                for extra in ({"peft": "lora"}, {"recompute": "full"}):
                    n2, o2 = peak(model, {**base, "seq": s, **extra}), peak(model, {**base, "seq": s, **extra, "offload_activations": True})
                    if n2 and o2: checks += 1; (o2 > n2) and bad.append((model, fw, s, f"offload>none {extra}", n2, o2))
        if fw == "deepspeed":
            zs = [peak(model, {**base, "zero": z}) for z in (0, 1, 2, 3)]
            for a, b in zip(zs, zs[1:]):
                if a and b: checks += 1; (b > a) and bad.append((model, fw, "zero", a, b))
print("checks", checks, "violations", len(bad))
for b in bad: print(b)
sys.exit(1 if bad else 0)
