"""Monotonicity of the estimate over every preset and framework (8 GPUs): the peak never falls as the sequence or
the micro-batch grows (recompute none and full), full recompute is never above none, activation offload is never
above none (plain, LoRA, full recompute; hf and torchtitan, whose offload is save_on_cpu), and a higher ZeRO stage
is never above a lower one (deepspeed): the peak from stage 0 to 1, from 1 to 2 less ZeRO-2's gradient partition (it
allocates that partition whole at the backward's first reduction, beside nearly every saved activation: measured on the
real engine, helper zero17, session 17; this allowance was added after the rule first failed on it), the model states (parameters, gradients,
optimizer states with the master weights) from 2 to 3. ZeRO-3's peak may be above ZeRO-2's: with DeepSpeed's defaults the
prefetcher keeps up to stage3_max_live_parameters (1e9) gathered beside the module computing, and its module
gradients and the step's fp32 sub-group gradient come on top (memplan.estimate.zero3_buffers, measured on the real
engine), so a model of up to ~1e9 parameters can hold about as much as unsharded, plus those. Refused jobs are
skipped. Exit 1 on any violation.

    python benchmarks/sweep_monotone.py   # ~5 minutes on 2 cores
"""
import sys
from memplan import estimate
from memplan.errors import MemplanError
from memplan.inputs import JobRequest, load_job
from memplan.model.presets import preset_names
def peak(model, flags, states=False):
    try:
        lj = load_job(JobRequest(model=model, flags=flags))
        result = estimate(lj.model, lj.job)
    except MemplanError:
        return None
    if not states:
        return result.peak_allocated_bytes
    return max(s.parameters_bytes + s.gradients_bytes + s.optimizer_bytes  # master weights are in optimizer_bytes
               for s in result.stages)
def grads(model, flags):
    """The largest stage's gradient bytes (ZeRO-2: its partition), None for a refused job."""
    try:
        lj = load_job(JobRequest(model=model, flags=flags))
        return max(s.gradients_bytes for s in estimate(lj.model, lj.job).stages)
    except MemplanError:
        return None


bad: list[tuple] = []
checks = 0


def expect_at_most(low, high, *label) -> None:
    """A check where both peaks exist (refused jobs give None): ``low`` must not be above ``high``."""
    global checks
    if low and high:
        checks += 1
        if low > high:
            bad.append((*label, low, high))


names = list(preset_names())
for model in names:
    for fw in ("megatron", "torchtitan", "deepspeed", "hf"):
        base = {"framework": fw, "gpus": 8}
        for rc in ("none", "full"):
            seqs = [peak(model, {**base, "seq": s, "recompute": rc}) for s in (512, 1024, 2048, 4096)]
            for a, b in zip(seqs, seqs[1:]):
                expect_at_most(a, b, model, fw, rc, "seq")
            mbss = [peak(model, {**base, "mbs": m, "recompute": rc, "seq": 1024}) for m in (1, 2, 4)]
            for a, b in zip(mbss, mbss[1:]):
                expect_at_most(a, b, model, fw, rc, "mbs")
        for s in (1024, 4096):
            n, f = peak(model, {**base, "seq": s}), peak(model, {**base, "seq": s, "recompute": "full"})
            expect_at_most(f, n, model, fw, s, "full>none")
            if fw in ("hf", "torchtitan"):
                o = peak(model, {**base, "seq": s, "offload_activations": True})
                expect_at_most(o, n, model, fw, s, "offload>none")
                for extra in ({"peft": "lora"}, {"recompute": "full"}):
                    n2 = peak(model, {**base, "seq": s, **extra})
                    o2 = peak(model, {**base, "seq": s, **extra, "offload_activations": True})
                    expect_at_most(o2, n2, model, fw, s, f"offload>none {extra}")
        if fw == "deepspeed":
            zs = [peak(model, {**base, "zero": z}) for z in (0, 1, 2)]
            expect_at_most(zs[1], zs[0], model, fw, "zero 0->1")
            # ZeRO-2 allocates its GPU's whole gradient partition at the backward's first reduction (contiguous
            # gradients), beside nearly every saved activation, where ZeRO-1 holds the gradients made so far: at
            # most that partition above ZeRO-1 (memplan.estimate.step_gradients; measured on the real engine, zero17)
            partition = grads(model, {**base, "zero": 2})
            expect_at_most(zs[2] - (partition or 0) if zs[2] else None, zs[1], model, fw, "zero 1->2")
            a, b = (peak(model, {**base, "zero": z}, states=True) for z in (2, 3))
            expect_at_most(b, a, model, fw, "zero states 2->3")
print("checks", checks, "violations", len(bad))
for b in bad:
    print(b)
sys.exit(1 if bad else 0)
