"""The ckpt benchmark: no / full / static / memplan checkpointing on variable-length batches (CPU).

A GPT-2-style model (transformers ``GPT2LMHeadModel`` built from a config, random weights) trains
with plain SGD on random token batches whose sequence lengths follow a seeded lognormal distribution
(long tail), clipped to ``[min_length, max_length]``. Four methods run on the same batches from the
same initial weights, in lockstep (step i of every method, in rotated order, before step i + 1)
and repeated:

* ``none`` — no checkpointing;
* ``full`` — every block checkpointed (``gradient_checkpointing_enable``, non-reentrant);
* ``static`` — a fixed set of blocks checkpointed: the fewest (earliest-first) for which the longest
  batch fits the budget, found by measurement before the runs (not timed: tuned offline);
* ``memplan`` — :func:`~memplan.ckpt.auto_checkpoint`; its learning steps are part of its time.

The budget is measured too: halfway (``budget_fraction``) between the peaks of ``full`` and ``none``
on the longest batch, so ``none`` exceeds it on the long batches. Every step of every method runs under the CPU meter
(the same overhead for all); its peak covers forward, backward and the optimizer step.
"""

from __future__ import annotations

import copy
import datetime
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from memplan.ckpt.blocks import find_blocks
from memplan.ckpt.controller import CheckpointController
from memplan.ckpt.meter import CpuMeter, MemoryMeter, storage_bytes
from memplan.ckpt.model_state import optimizer_tensors, state_tensors
from memplan.ckpt.wrapper import auto_checkpoint, controller_of

__all__ = ["METHODS", "BenchConfig", "BenchResult", "MethodRun", "run_bench", "sample_lengths"]

METHODS = ("none", "full", "static", "memplan")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What the benchmark runs. Defaults: a 53M-parameter GPT-2-style model, a few minutes of CPU."""

    n_layer: int = 12
    n_embd: int = 576
    n_head: int = 9
    vocab_size: int = 8192
    n_positions: int = 1024
    #: Sequences per batch; every sequence of a batch has the batch's length (no padding).
    batch_size: int = 2
    #: Training steps per run; every method sees the same batches.
    steps: int = 16
    #: Repetitions; within one, the four methods run in lockstep, step by step (order rotated).
    repeats: int = 3
    #: Lognormal lengths: exp(N(ln median, sigma)), rounded and clipped.
    length_median: int = 112
    length_sigma: float = 0.6
    min_length: int = 32
    max_length: int = 512
    #: The budget sits this far from ``full``'s peak towards ``none``'s, both measured on the longest batch.
    budget_fraction: float = 0.4
    #: Lengths of memplan's warm-up batches before training (timed as part of memplan's run); empty:
    #: memplan learns during its first training steps (one block checkpointed and probed per step).
    warmup_lengths: tuple[int, ...] = ()
    #: Plain SGD: its per-step cost (the same for every method) stays small next to the model's.
    lr: float = 1e-3
    seed: int = 0
    #: torch CPU threads: one thread keeps timings steady on a shared machine.
    threads: int = 1

    @classmethod
    def quick(cls) -> BenchConfig:
        """A seconds-long variant (tiny model) for tests and smoke runs."""
        return cls(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=256, steps=6, repeats=1,
                   length_median=32, length_sigma=0.7, min_length=8, max_length=128, warmup_lengths=(4, 8, 16))


@dataclass(frozen=True, kw_only=True)
class MethodRun:
    """One run of one method over all steps."""

    method: str
    wall_s: float
    tokens: int
    losses: tuple[float, ...]
    peaks: tuple[int, ...]
    #: Block forwards run during backward (recomputation), warm-up included.
    recomputed_forwards: int
    #: Block forwards spent warming up (memplan only): the warm-up batches' forwards and probes.
    warmup_forwards: int
    misses: int = 0
    #: Seconds memplan spent choosing plans (0 for the other methods).
    plan_seconds: float = 0.0
    #: Steps whose plan checkpointed at least one block.
    steps_checkpointing: int = 0
    #: memplan only, re-planned afterwards for every batch with the final predictors: blocks
    #: checkpointed and predicted recompute seconds, summed, by the exact knapsack and by Mimose's greedy.
    knapsack_vs_greedy: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """All runs, the budget and plan used, and the summary against the targets."""

    config: BenchConfig
    n_params: int
    lengths: tuple[int, ...]
    budget_bytes: int
    static_plan: tuple[bool, ...]
    runs: tuple[MethodRun, ...]
    machine: dict[str, str] = field(default_factory=dict)
    date: str = ""

    def by_method(self, method: str) -> list[MethodRun]:
        return [r for r in self.runs if r.method == method]

    def ratio(self, num: str, den: str) -> list[float]:
        """Throughput ratios ``num / den`` per repetition (runs of one repetition are adjacent)."""
        return [a.throughput / b.throughput for a, b in zip(self.by_method(num), self.by_method(den))]

    def summary(self) -> dict[str, Any]:
        """Per-method medians and spreads, and each target with its measured value and verdict."""
        methods = {m: _method_summary(self.by_method(m), self.budget_bytes) for m in METHODS}
        none, mem = self.by_method("none")[0], self.by_method("memplan")[0]
        loss_diff = max(abs(a - b) for a, b in zip(none.losses, mem.losses))
        rec = methods["memplan"]["recomputed_forwards"] / max(1, methods["full"]["recomputed_forwards"])
        rb, rc = self.ratio("memplan", "full"), self.ratio("memplan", "static")
        targets = {
            "memplan within budget on every step": _target(methods["memplan"]["steps_within_budget_pct"], ">= 100 %", methods["memplan"]["steps_within_budget_pct"] >= 100.0),
            "memplan recomputes <= 25% of full": _target(rec, "<= 0.25", rec <= 0.25),
            "memplan throughput >= 1.15x full": _target(statistics.median(rb), ">= 1.15", statistics.median(rb) >= 1.15),
            "memplan throughput >= 1.05x static": _target(statistics.median(rc), ">= 1.05", statistics.median(rc) >= 1.05),
            "memplan losses equal none's": _target(loss_diff, "== 0", loss_diff == 0.0),
"memplan planning < 1% of step time": _target(methods["memplan"]["plan_time_share_pct"], "< 1 %", methods["memplan"]["plan_time_share_pct"] < 1.0),
            "none exceeds the budget on long batches": _target(100.0 - methods["none"]["steps_within_budget_pct"], "> 0 %", methods["none"]["steps_within_budget_pct"] < 100.0),
        }
        return {
            "methods": methods,
            "ratios": {"memplan/full": _spread(rb), "memplan/static": _spread(rc)},
            "max_loss_difference_memplan_vs_none": loss_diff,
            "targets": targets,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "date": self.date,
            "machine": self.machine,
            "config": asdict(self.config),
            "n_params": self.n_params,
            "lengths": list(self.lengths),
            "budget_bytes": self.budget_bytes,
            "static_plan": list(self.static_plan),
            "summary": self.summary(),
            "runs": [{**asdict(r), "throughput_tokens_per_s": r.throughput} for r in self.runs],
        }


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _target(value: float, target: str, met: bool) -> dict[str, Any]:
    return {"value": value, "target": target, "met": bool(met)}


def _method_summary(runs: Sequence[MethodRun], budget: int) -> dict[str, Any]:
    peaks = runs[0].peaks
    return {
        "throughput_tokens_per_s": _spread([r.throughput for r in runs]),
        "steps_within_budget_pct": 100.0 * sum(p <= budget for r in runs for p in r.peaks) / sum(len(r.peaks) for r in runs),
        "max_peak_bytes": max(max(r.peaks) for r in runs),
        "median_peak_bytes": int(statistics.median(peaks)),
        "recomputed_forwards": runs[0].recomputed_forwards,
        "warmup_forwards": runs[0].warmup_forwards,
        "misses": sum(r.misses for r in runs),
        "steps_checkpointing": runs[0].steps_checkpointing,
        "plan_time_share_pct": 100.0 * sum(r.plan_seconds for r in runs) / sum(r.wall_s for r in runs),
        "knapsack_vs_greedy": dict(zip(("knapsack_blocks", "knapsack_recompute_s", "greedy_blocks", "greedy_recompute_s"),
                                       runs[0].knapsack_vs_greedy)),
    }


# ------------------------------------------------------------------------------------ inputs
def sample_lengths(cfg: BenchConfig) -> list[int]:
    """The run's sequence lengths: seeded lognormal, rounded, clipped to [min_length, max_length]."""
    rng = np.random.default_rng(cfg.seed)
    raw = rng.lognormal(mean=math.log(cfg.length_median), sigma=cfg.length_sigma, size=cfg.steps)
    return [int(min(cfg.max_length, max(cfg.min_length, round(x)))) for x in raw]


def _batches(cfg: BenchConfig, lengths: Sequence[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (cfg.batch_size, n), generator=gen) for n in lengths]


def _build_model(cfg: BenchConfig) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(
        n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, vocab_size=cfg.vocab_size,
        n_positions=cfg.n_positions, use_cache=False, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(cfg.seed)
    return GPT2LMHeadModel(config).train()


# ------------------------------------------------------------------------------------ counting
class _ForwardCounter:
    """Counts block forwards (via the first submodule of each block) inside and outside backward."""

    def __init__(self, blocks: Sequence[torch.nn.Module]) -> None:
        self.forward = self.backward = 0
        self._handles = [next(b.children()).register_forward_pre_hook(self._hook) for b in blocks]

    def _hook(self, *_: Any) -> None:
        if torch._C._current_graph_task_id() >= 0:
            self.backward += 1
        else:
            self.forward += 1


def _hf_checkpoint_every_block(model: Any) -> None:
    """Hugging Face's own full checkpointing, non-reentrant (renamed in transformers 5)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(find_blocks(model)[0])


def _train_step(model: torch.nn.Module, batch: torch.Tensor) -> Callable[[], torch.Tensor]:
    def fn() -> torch.Tensor:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss.detach()

    return fn


def _measure_peak(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Peak live bytes of one forward + backward (weights, batch and grads included), grads dropped."""
    meter = CpuMeter()
    with meter:
        meter.adopt(state_tensors(model, None))
        meter.adopt([batch])
        _train_step(model, batch)()
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


# ------------------------------------------------------------------------------------ one repetition
@dataclass(kw_only=True)
class _Runner:
    """One method's model, optimizer, controller and what its steps measured so far."""

    method: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    ctl: CheckpointController | None
    counter: _ForwardCounter
    meter: MemoryMeter
    wall_s: float = 0.0
    warmup_forwards: int = 0
    checkpointing: int = 0
    losses: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)

    @property
    def adaptive(self) -> CheckpointController | None:
        return self.ctl if self.method == "memplan" else None


def _prepare(method: str, cfg: BenchConfig, init: dict[str, torch.Tensor], budget: int,
             static_plan: Sequence[bool]) -> _Runner:
    """A fresh model with the initial weights, its optimizer and (static, memplan) its controller."""
    model = _build_model(cfg)
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    counter = _ForwardCounter(_blocks(model))
    if method == "full":
        _hf_checkpoint_every_block(model)
    ctl = None
    if method in ("static", "memplan"):
        ctl = controller_of(auto_checkpoint(model, budget, optimizer=opt))
        if method == "static":
            ctl.fix_plan(static_plan)
            ctl.meter.limit_bytes = None  # measured, not enforced: a static plan has no safety net
    meter: MemoryMeter = ctl.meter if ctl is not None else CpuMeter()
    return _Runner(method=method, model=model, opt=opt, ctl=ctl, counter=counter, meter=meter)


def _warm_up(runner: _Runner, cfg: BenchConfig) -> None:
    """memplan's optional warm-up on short sample batches, timed as part of its run."""
    if runner.adaptive is None or not cfg.warmup_lengths:
        return
    t0 = time.perf_counter()
    batches = _batches(cfg, cfg.warmup_lengths, cfg.seed + 7)
    runner.adaptive.warm_up([_train_step(runner.model, b) for b in batches])
    runner.wall_s += time.perf_counter() - t0
    runner.warmup_forwards = runner.counter.forward + runner.counter.backward


def _train(runner: _Runner, batch: torch.Tensor) -> None:
    """One timed, metered training step (forward, backward, optimizer step) of one method."""
    model, opt, meter, adaptive = runner.model, runner.opt, runner.meter, runner.adaptive
    t0 = time.perf_counter()
    with meter:
        meter.adopt(state_tensors(model, opt))
        meter.adopt([batch])
        meter.mark()
        opt.zero_grad(set_to_none=True)
        step = _train_step(model, batch)
        loss = adaptive.step(step) if adaptive is not None else step()
        opt.step()
        peak = meter.mark()
    runner.wall_s += time.perf_counter() - t0
    if adaptive is not None and adaptive.last is not None:
        peak = max(peak, adaptive.last[2])
        runner.checkpointing += adaptive.last[1].n_checkpointed > 0
    runner.losses.append(float(loss))
    runner.peaks.append(int(peak))


def _result(runner: _Runner, batches: Sequence[torch.Tensor], static_plan: Sequence[bool]) -> MethodRun:
    adaptive = runner.adaptive
    stats = adaptive.stats() if adaptive is not None else None
    compare = _compare_planners(adaptive, runner.model, runner.opt, batches) if adaptive else (0, 0.0, 0, 0.0)
    method = runner.method
    return MethodRun(
        method=method, wall_s=runner.wall_s, tokens=sum(b.numel() for b in batches), losses=tuple(runner.losses),
        peaks=tuple(runner.peaks), recomputed_forwards=runner.counter.backward, warmup_forwards=runner.warmup_forwards,
        misses=stats.misses if stats else 0,
        plan_seconds=stats.plan_seconds if stats else 0.0,
        steps_checkpointing=runner.checkpointing if stats else (
            len(batches) if method == "full" or (method == "static" and any(static_plan)) else 0),
        knapsack_vs_greedy=compare,
    )


def _repetition(cfg: BenchConfig, init: dict[str, torch.Tensor], batches: Sequence[torch.Tensor], budget: int,
                static_plan: Sequence[bool], rep: int) -> list[MethodRun]:
    """The four methods in lockstep: step i of each (order rotated) before step i + 1 of any.

    Interleaving at the step, not the run, exposes every method to the same machine load.
    """
    runners = [_prepare(m, cfg, init, budget, static_plan) for m in METHODS]
    for runner in runners:
        _warm_up(runner, cfg)
    for i, batch in enumerate(batches):
        k = (i + rep) % len(runners)
        for runner in runners[k:] + runners[:k]:
            _train(runner, batch)
    return [_result(r, batches, static_plan) for r in runners]


def _compare_planners(ctl: CheckpointController, model: torch.nn.Module, opt: torch.optim.Optimizer,
                      batches: Sequence[torch.Tensor]) -> tuple[int, float, int, float]:
    """Plan every batch again with both planners (untimed): blocks and predicted seconds, summed."""
    static = storage_bytes([*model.parameters(), *model.buffers(), *optimizer_tensors(opt)])  # grads: None
    totals = [0, 0.0, 0, 0.0]
    for batch in batches:
        for k, method in ((0, "knapsack"), (2, "greedy")):
            plan = ctl.plan_for(batch.numel(), static_bytes=static + batch.numel() * batch.element_size(), method=method)
            totals[k] += plan.n_checkpointed
            totals[k + 1] += plan.recompute_s
    return int(totals[0]), float(totals[1]), int(totals[2]), float(totals[3])


# ------------------------------------------------------------------------------------ setup
def _calibrate(cfg: BenchConfig, init: dict[str, torch.Tensor], lengths: Sequence[int]) -> tuple[int, tuple[bool, ...]]:
    """The budget and the static plan, both measured on the longest batch before the runs.

    Budget: ``full``'s peak plus ``budget_fraction`` of the way to ``none``'s peak, on the longest
    batch (plain SGD keeps no optimizer states). Static plan: the fewest blocks, earliest first,
    for which the longest batch fits that budget.
    """
    model = _build_model(cfg)
    model.load_state_dict(init)
    longest = _batches(cfg, [max(lengths)], cfg.seed + 11)[0]
    peak_none = _measure_peak(model, longest)
    ctl = controller_of(auto_checkpoint(model, 2**50))

    def peak(k: int) -> int:
        ctl.fix_plan([j < k for j in range(cfg.n_layer)])
        return _measure_peak(model, longest)

    peak_full = peak(cfg.n_layer)
    budget = int(peak_full + cfg.budget_fraction * (peak_none - peak_full))
    lo, hi = 0, cfg.n_layer  # the smallest k that fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if peak(mid) <= budget else (mid + 1, hi)
    return budget, tuple(j < lo for j in range(cfg.n_layer))


def _machine() -> dict[str, str]:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def run_bench(cfg: BenchConfig | None = None, *, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Run the benchmark (see the module docstring) and return every run with its summary."""
    cfg = cfg or BenchConfig()
    say = progress or (lambda _msg: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run_all(cfg, say)
    finally:
        torch.set_num_threads(threads)


def _run_all(cfg: BenchConfig, say: Callable[[str], None]) -> BenchResult:
    lengths = sample_lengths(cfg)
    model = _build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    init = copy.deepcopy(model.state_dict())
    del model
    budget, static_plan = _calibrate(cfg, init, lengths)
    say(f"budget {budget} bytes, static plan checkpoints {sum(static_plan)} of {cfg.n_layer} blocks")
    batches = _batches(cfg, lengths, cfg.seed + 1)
    runs: list[MethodRun] = []
    for rep in range(cfg.repeats):
        for run in _repetition(cfg, init, batches, budget, static_plan, rep):
            say(f"rep {rep + 1}/{cfg.repeats} {run.method}: {run.throughput:.1f} tokens/s, max peak {max(run.peaks)}")
            runs.append(run)
    runs.sort(key=lambda r: METHODS.index(r.method))  # stable: repetitions stay in order per method
    return BenchResult(
        config=cfg, n_params=n_params, lengths=tuple(lengths), budget_bytes=budget, static_plan=static_plan,
        runs=tuple(runs), machine=_machine(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def with_overrides(cfg: BenchConfig, **changes: Any) -> BenchConfig:
    """``cfg`` with the given fields replaced (``None`` values ignored)."""
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})
