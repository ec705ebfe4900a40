"""Job changes that may fix an out-of-memory, each re-estimated and priced by the step-time model.

Every change starts from the user's job (:class:`memplan.inputs.LoadedJob`) and changes one thing:
a smaller micro-batch (the global batch kept by gradient accumulation), activation recompute
(selective, then full), a higher ZeRO stage, FSDP or Megatron's distributed optimizer, optimizer offload, LoRA / QLoRA (which change
what trains: said in the action), a chunked loss. Each is estimated with :func:`memplan.estimate`;
it is verified when its predicted peak reserved memory is within the limit: the capacity minus
:data:`memplan.fit.results.FIT_MARGIN` (``memplan fit``'s margin). Its cost is the step time of
:func:`memplan.fit.steptime.step_time` relative to the job's own. When no single change fits, combinations
are searched, the ones that keep the training as it is first: every pair, then every triple, of changes to
different settings (a micro-batch, a recompute mode, one sharding: a ZeRO stage or FSDP, the optimizer offload, the
loss), stopping at the smallest size where one fits; of the fitting combinations of the same settings the cheapest
is kept. This search runs whenever no single change that keeps the training fits (LoRA alone may). Only when
nothing fits are LoRA / QLoRA paired with one of the others.

The GPU for the step-time model is the job's ``--gpu``, else the catalogue GPU whose memory matches
the message's total capacity (within :data:`CAPACITY_MATCH`); without one the cost is unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Any

from memplan.doctor.message import OOMMessage
from memplan.doctor.report import Fix
from memplan.doctor.words import format_bytes
from memplan.errors import ConfigError, UnsupportedError
from memplan.frameworks.native_fix import NativeChange, native_change
from memplan.job import FineTuning, Job, Recompute
from memplan.profiles.framework import get_profile
from memplan.tuning.peft_methods import LORA
from memplan.tuning.quant_formats import NF4

__all__ = ["CAPACITY_MATCH", "COMBINED_AT_MOST", "cheapest_fit", "job_fixes"]

#: A catalogue GPU matches a message's total capacity when within this share of its memory.
CAPACITY_MATCH = 0.03
#: The most changes combined into one fix.
COMBINED_AT_MOST = 3
#: The settings a change sets, where they are not its key alone: a ZeRO stage and FSDP both set the sharding, and
#: optimizer offload on a job without sharded states brings the sharding it needs (one change per setting).
_SETTINGS_OF_KEY = {"zero": ("sharding",), "fsdp": ("sharding",), "distributed_optimizer": ("sharding",),
                    "offload_optimizer,sharding": ("offload", "sharding")}


@dataclass(frozen=True)
class _Change:
    action: str
    flags: str
    key: str
    apply: Callable[[Job], Job]
    changes_training: bool = False
    #: False when the step-time model has no term for the change (CPU offload, chunked loss).
    priced: bool = True


def _divisors_below(n: int) -> list[int]:
    return [d for d in range(n - 1, 0, -1) if n % d == 0]


def _changes(job: Job) -> list[_Change]:
    out: list[_Change] = []
    b, par = job.batch, job.parallel
    gbs = b.global_batch_size or b.micro_batch_size * par.data_parallel
    for mbs in _divisors_below(b.micro_batch_size):
        out.append(_Change(f"Micro-batch {mbs} (global batch {gbs} kept by accumulation)", f"--mbs {mbs} --gbs {gbs}",
                           "mbs", lambda j, m=mbs: replace(j, batch=replace(j.batch, micro_batch_size=m,
                                                                             global_batch_size=gbs))))
    modes = {"none": ("selective", "full"), "selective": ("full",)}.get(job.recompute.mode, ())
    for mode in modes:
        out.append(_Change(f"Recompute activations ({mode})", f"--recompute {mode}", "recompute",
                           lambda j, m=mode: replace(j, recompute=Recompute(mode=m))))
    if par.data_parallel > 1 and job.sharding.fsdp == "none":
        if not (job.sharding.distributed_optimizer or job.sharding.zero):  # refused where Megatron's is not the framework
            out.append(_Change("Distributed optimizer (optimizer states sharded over data parallelism)",
                               "--distributed-optimizer", "distributed_optimizer", _sharded(distributed_optimizer=True)))
        through = " (DeepSpeed through --deepspeed)" if get_profile(job.framework).zero_framework else ""
        for stage in range(job.sharding.zero + 1, 4):
            out.append(_Change(f"ZeRO stage {stage}{through}", f"--zero {stage}", "zero", _sharded(zero=stage)))
        out.append(_Change("FSDP full sharding", "--fsdp full", "fsdp", _sharded(zero=0, fsdp="full")))
    if not job.offload.optimizer and (offload := _offload_change(job)) is not None:
        out.append(offload)
    if not job.finetune.peft_kind.adapters:
        out.append(_Change("Train LoRA adapters instead of all weights (changes what trains)", "--peft lora", "peft",
                           lambda j: replace(j, finetune=FineTuning(peft=LORA.name)), True))
        out.append(_Change("QLoRA: LoRA on an NF4-quantized base (changes what trains)",
                           "--peft lora --quantize-base nf4", "peft",
                           lambda j: replace(j, finetune=FineTuning(peft=LORA.name, quantize_base=NF4.name)), True))
    if job.loss not in ("chunked", "fused-linear"):
        out.append(_Change("Chunked cross-entropy loss (no full logits)", "--loss chunked", "loss",
                           lambda j: replace(j, loss="chunked"), priced=False))
    return out


def _sharded(**fields: Any) -> Callable[[Job], Job]:
    """The job with these ``Sharding`` fields."""
    return lambda job: replace(job, sharding=replace(job.sharding, **fields))


def _offloaded(job: Job) -> Job:
    """Optimizer states offloaded; under FSDP the parameters too: PyTorch FSDP's CPU offload (``CPUOffloadPolicy``,
    ``CPUOffload(offload_params=True)``) moves the sharded parameters with the optimizer step, all or nothing."""
    params = job.sharding.fsdp != "none"
    return replace(job, offload=replace(job.offload, optimizer=True, params=job.offload.params or params))


#: What optimizer offload needs where the job does not shard its optimizer states, in the order tried: the
#: framework's own validation keeps the first it accepts (Megatron's distributed optimizer, else FSDP, else ZeRO stage 1).
_OFFLOAD_SHARDINGS: tuple[tuple[str, str, Callable[[Job], Job]], ...] = (
    ("", "", lambda j: j),
    (" with the distributed optimizer", " --distributed-optimizer", _sharded(distributed_optimizer=True)),
    (" with FSDP full sharding", " --fsdp full", _sharded(fsdp="full")),
    (" with ZeRO stage 1", " --zero 1", _sharded(zero=1)),
)


def _offload_change(job: Job) -> _Change | None:
    """Optimizer offload, with the sharding it needs where the job has none (ZeRO-Offload needs ZeRO; Megatron's
    ``--optimizer-cpu-offload`` its distributed optimizer); None where the framework accepts none of them."""
    for words, flags, shard in _OFFLOAD_SHARDINGS:
        try:
            offloaded = _offloaded(shard(job))
        except ConfigError:
            continue
        params = offloaded.offload.params and not job.offload.params
        return _Change(f"Offload optimizer states{' and parameters' if params else ''} to CPU memory{words}",
                       f"--offload-optimizer{flags}{' --offload-params' if params else ''}",
                       "offload_optimizer" + (",sharding" if flags else ""), lambda j, shard=shard: _offloaded(shard(j)),
                       priced=False)
    return None


def _one_micro_batch(tried: list[tuple[_Change, int, float | None]], limit: int) -> list[
        tuple[_Change, int, float | None]]:
    """Of the single micro-batch changes, keep the largest micro-batch that fits (or the smallest tried)."""
    alone = [t for t in tried if t[0].key == "mbs"]
    if not alone:
        return tried
    fitting = [t for t in alone if t[1] <= limit]
    keep = fitting[0] if fitting else alone[-1]
    return [t for t in tried if t[0].key != "mbs" or t is keep]


def _combine(changes: tuple[_Change, ...]) -> _Change:
    def apply(job: Job) -> Job:
        for change in changes:
            job = change.apply(job)
        return job

    return _Change(" + ".join(c.action for c in changes), " ".join(c.flags for c in changes),
                   ",".join(c.key for c in changes), apply, any(c.changes_training for c in changes),
                   all(c.priced for c in changes))


def _cheapest_per_settings(found: list[tuple[_Change, int, float | None]]) -> list[
        tuple[_Change, int, float | None]]:
    """Of fitting combinations of the same settings (e.g. ZeRO 3 + full recompute + micro-batch 2 or 1), the one
    with the shortest step (else the lowest peak)."""
    best: dict[str, tuple[_Change, int, float | None]] = {}
    for t in sorted(found, key=lambda t: (t[2] if t[2] is not None else float("inf"), t[1])):
        best.setdefault(t[0].key, t)
    return [best[key] for key in dict.fromkeys(t[0].key for t in found)]  # in the order found


def _combined(job: Job, singles: list[_Change], limit: int, peak_and_time: Callable[[Job], tuple[int, float | None]],
              single_fits: bool) -> list[tuple[_Change, int, float | None]]:
    """Combinations of changes to different settings (see the module docstring): the fitting ones of the smallest
    size that has one, training kept; else, unless a single change (LoRA / QLoRA) fits, LoRA / QLoRA with each other
    change, fitting or not."""
    def estimated(change: _Change) -> tuple[_Change, int, float | None] | None:
        try:
            return (change, *peak_and_time(change.apply(job)))
        except (ConfigError, UnsupportedError):
            return None

    kept = [c for c in singles if not c.changes_training]
    for size in range(2, COMBINED_AT_MOST + 1):
        found = []
        for group in combinations(kept, size):
            settings = [name for c in group for name in _SETTINGS_OF_KEY.get(c.key, (c.key,))]
            if len(set(settings)) == len(settings) and (t := estimated(_combine(group))) is not None and t[1] <= limit:
                found.append(t)
        if found:
            return _cheapest_per_settings(found)
    if single_fits:
        return []
    out: list[tuple[_Change, int, float | None]] = []
    for change in (c for c in singles if c.changes_training):
        for other in kept:
            if (t := estimated(_combine((change, other)))) is not None:
                out.append(t)
    return out


def _same_run_once(job: Job, tried: list[tuple[_Change, int, float | None]]) -> list[
        tuple[_Change, int, float | None, NativeChange | None]]:
    """Each tried change with its settings in the framework's own terms (:mod:`memplan.frameworks.native_fix`),
    dropping a change whose settings are another's and that was priced otherwise (its rendering says so in a note):
    Megatron-LM runs FSDP as Megatron-FSDP's sharding strategy, so ``--fsdp full`` and ``--zero 3`` are one Megatron
    run, priced as its arguments read back."""
    natives = [native_change(job, change.apply(job)) for change, _, _ in tried]
    exact = {n.text() for n in natives if n is not None and not n.notes and n.settings}
    return [(*t, n) for t, n in zip(tried, natives, strict=True) if n is None or not n.notes or n.text() not in exact]


def _hardware(gpu: str | None, msg: OOMMessage | None, notes: list[str]) -> Any:
    from memplan.fit.hardware import hardware_for
    from memplan.gpus import list_gpus

    name = gpu
    if name is None and msg is not None:
        total = msg.total.bytes
        close = [g for g in list_gpus() if abs(g.total_bytes - total) <= CAPACITY_MATCH * g.total_bytes]
        if close:
            name = min(close, key=lambda g: abs(g.total_bytes - total)).name
            notes.append(f"step times priced on {name}, the catalogue GPU closest to the message's "
                         f"{msg.total.text} (give --gpu to choose)")
    if name is None:
        notes.append("no GPU known (give --gpu): job fixes are ranked by memory saved, step-time cost unknown")
        return None
    try:
        return hardware_for(name)
    except KeyError:
        notes.append(f"no step-time data for {name}: job fixes ranked by memory saved")
        return None


def cheapest_fit(loaded: Any, gpu: str) -> Fix | None:
    """The cheapest verified change that makes ``loaded`` fit GPU ``gpu`` (its usable memory minus fit's margin),
    as the doctor ranks them: what ``memplan estimate`` suggests for a job that does not fit. None when no
    single change or combination fits."""
    from memplan.doctor.report import rank_fixes
    from memplan.gpus import get_gpu

    notes: list[str] = []
    fixes = job_fixes(loaded, None, get_gpu(gpu).usable_bytes, gpu, notes)
    return next((f for f in rank_fixes(fixes) if f.verified), None)


def job_fixes(loaded: Any, msg: OOMMessage | None, capacity: int | None, gpu: str | None,
              notes: list[str]) -> list[Fix]:
    """Job changes re-estimated against ``capacity`` (see the module docstring)."""
    from memplan.estimate.engine import DEFAULT_FRAGMENTATION, estimate
    from memplan.fit.results import FIT_MARGIN, memory_limit
    from memplan.fit.steptime import step_time

    if capacity is None:
        notes.append("no capacity (message, --gpu or --capacity): job changes were not estimated")
        return []
    model, job = loaded.model, loaded.job
    frag = loaded.fragmentation if loaded.fragmentation is not None else DEFAULT_FRAGMENTATION
    limit = memory_limit(capacity, FIT_MARGIN)
    hw = _hardware(gpu, msg, notes)

    def peak_and_time(j: Job) -> tuple[int, float | None]:
        est = estimate(model, j, fragmentation=frag)
        return est.peak_reserved_bytes, (step_time(model, j, hw).total_s if hw is not None else None)

    base_peak, base_time = peak_and_time(job)
    if base_peak <= limit:
        notes.append(f"the job as given is estimated at {format_bytes(base_peak)} reserved, within the "
                     f"{format_bytes(limit)} limit: the estimate does not reproduce this out-of-memory (inputs "
                     "longer than --seq, another model or a cache beside the job?)")
    tried: list[tuple[_Change, int, float | None]] = []
    for change in _changes(job):
        try:
            tried.append((change, *peak_and_time(change.apply(job))))
        except (ConfigError, UnsupportedError):
            continue
    if not any(peak <= limit and not change.changes_training for change, peak, _ in tried):
        single_fits = any(peak <= limit for _, peak, _ in tried)
        tried += _combined(job, [t[0] for t in tried], limit, peak_and_time, single_fits)
    fixes = []
    for change, peak, seconds, native in _same_run_once(job, _one_micro_batch(tried, limit)):
        fits = peak <= limit
        if not change.priced:
            seconds = None
            cost = "; step time not priced (the step-time model has no term for it: expect a slower step)"
        elif seconds is None or not base_time:
            cost = ""
        else:
            cost = f"; step {base_time:.3g} s -> {seconds:.3g} s ({100 * (seconds / base_time - 1):+.0f}%)"
        text = (f"memplan estimate: peak reserved {format_bytes(peak)} (was {format_bytes(base_peak)}) "
                f"{'<=' if fits else '>'} limit {format_bytes(limit)} ({format_bytes(capacity)} minus "
                f"{FIT_MARGIN:.0%} margin){cost}")
        fixes.append(Fix(action=change.action, kind="job", setting=change.flags, saves_bytes=base_peak - peak,
                         verified=fits, verified_by="estimate", verification=text, peak_bytes=peak,
                         limit_bytes=limit, step_time_s=seconds, base_step_time_s=base_time,
                         config_key=change.key, changes_training=change.changes_training,
                         native=None if native is None else native.to_dict()))
    return fixes
