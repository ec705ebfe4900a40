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

The budget is measured too: ``budget_fraction`` of the way from the peak of ``full`` to that of
``none`` on the longest batch, so ``none`` exceeds it on the long batches.

Timing and metering are separate passes over the same batches from the same initial weights:

* the *metered* pass (one repetition, first) runs every step of every method under the CPU meter:
  peaks, budget verdicts, recompute counts and losses come from it. memplan learns from the meter
  here; before each of its steps the controller's planning state is snapshotted and its plan and
  the time spent refitting its predictors are recorded;
* the *timed* passes (``repeats`` repetitions) run without the dispatch-mode meter, which costs
  per operator and only exists because CPU tensors have no allocator statistics (on CUDA the meter
  is free). memplan's timed controller still does everything a GPU run does — reads the size,
  plans (its own plan cache), checkpoints, probes in learning steps, runs the safety net's
  bookkeeping — from the state the metered run had before the same step, so it must choose the
  same plan (checked step by step); the refit seconds the metered run spent on that step are added
  to its time. Same weights, batch and plan mean the same memory as the metered step measured.

Within each pass the four methods run in lockstep (step i of each, in an order rotated every step
and every repetition, before step i + 1 of any). Throughput is taken from the per-step median over
the timed repetitions; the spread is the per-repetition throughput.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
#: What a plan depends on besides the batch and the bytes live: copied from the metered memplan
#: run into the timed one before each step (the learning-step counter too).
_PLAN_STATE = ("_acts", "_times", "_phases", "_margin", "_version", "_ready")


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
    steps: int = 32
    #: Timed (unmetered) repetitions after the one metered pass; within each, the four methods run in
    #: lockstep, step by step (order rotated). Throughput comes from per-step medians over these.
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
    #: Pin the process to this CPU core (``os.sched_setaffinity``) while it runs; ``None``: no pinning.
    pin_core: int | None = None

    @classmethod
    def quick(cls) -> BenchConfig:
        """A seconds-long variant (tiny model) for tests and smoke runs."""
        return cls(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=256, steps=6, repeats=1,
                   length_median=32, length_sigma=0.7, min_length=8, max_length=128, warmup_lengths=(4, 8, 16))


@dataclass(frozen=True, kw_only=True)
class MethodRun:
    """One run of one method over all steps, metered (the reference) or timed."""

    method: str
    #: ``"metered"``: every step under the CPU meter (peaks, losses, counts); ``"timed"``: no meter.
    kind: str
    #: Repetition index within its kind.
    rep: int
    wall_s: float
    #: Seconds of each step (memplan, timed: plus the refit seconds its metered twin spent on that step).
    step_s: tuple[float, ...]
    #: Seconds of memplan's warm-up before the first step (0 without warm-up batches); in ``wall_s``.
    warmup_s: float
    tokens: int
    losses: tuple[float, ...]
    #: Peak bytes per step (metered runs only; empty for timed runs).
    peaks: tuple[int, ...]
    #: Block forwards run during backward (recomputation), warm-up included.
    recomputed_forwards: int
    #: Block forwards spent warming up (memplan only): the warm-up batches' forwards and probes.
    warmup_forwards: int
    #: memplan: extra plain forwards of checkpointed blocks in learning (and warm-up) steps.
    probe_forwards: int = 0
    misses: int = 0
    #: Seconds memplan spent choosing plans (0 for the other methods).
    plan_seconds: float = 0.0
    #: Seconds memplan spent refitting its predictors after steps (metered run; added to the timed runs).
    observe_seconds: float = 0.0
    #: Steps whose plan checkpointed at least one block.
    steps_checkpointing: int = 0
    #: memplan, timed runs: steps whose plan (blocks and probe) equals the metered run's on that step.
    plans_matching: int = 0
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

    def by_method(self, method: str, kind: str = "timed") -> list[MethodRun]:
        return [r for r in self.runs if r.method == method and r.kind == kind]

    def ratio(self, num: str, den: str) -> list[float]:
        """Throughput ratios ``num / den`` per timed repetition."""
        return [a.throughput / b.throughput for a, b in zip(self.by_method(num), self.by_method(den))]

    def median_throughput(self, method: str) -> float:
        """Tokens over the sum of per-step median seconds across the timed repetitions."""
        runs = self.by_method(method)
        steps = sum(statistics.median(s) for s in zip(*(r.step_s for r in runs)))
        return runs[0].tokens / (statistics.median(r.warmup_s for r in runs) + steps)

    def summary(self) -> dict[str, Any]:
        """Per-method medians and spreads, and each target with its measured value and verdict."""
        methods = {m: _method_summary(self, m) for m in METHODS}
        none = self.by_method("none", "metered")[0]
        loss_diff = max(abs(a - b) for r in self.by_method("memplan", "metered") + self.by_method("memplan")
                        for a, b in zip(none.losses, r.losses))
        timed_loss_diff = max((abs(a - b) for m in METHODS for r in self.by_method(m)
                               for a, b in zip(self.by_method(m, "metered")[0].losses, r.losses)), default=0.0)
        rec = methods["memplan"]["recomputed_forwards"] / max(1, methods["full"]["recomputed_forwards"])
        tp = {m: self.median_throughput(m) for m in METHODS}
        rb, rc = tp["memplan"] / tp["full"], tp["memplan"] / tp["static"]
        mem = methods["memplan"]
        targets = {
            "memplan within budget on every step": _target(mem["steps_within_budget_pct"], ">= 100 %", mem["steps_within_budget_pct"] >= 100.0),
            "memplan timed plans equal the metered ones": _target(mem["timed_plans_matching_pct"], "== 100 %", mem["timed_plans_matching_pct"] >= 100.0),
            "memplan recomputes <= 25% of full": _target(rec, "<= 0.25", rec <= 0.25),
            "memplan throughput >= 1.15x full": _target(rb, ">= 1.15", rb >= 1.15),
            "memplan throughput >= 1.05x static": _target(rc, ">= 1.05", rc >= 1.05),
            "memplan losses equal none's": _target(loss_diff, "== 0", loss_diff == 0.0),
            "memplan planning < 1% of step time": _target(mem["plan_time_share_pct"], "< 1 %", mem["plan_time_share_pct"] < 1.0),
            "none exceeds the budget on long batches": _target(100.0 - methods["none"]["steps_within_budget_pct"], "> 0 %", methods["none"]["steps_within_budget_pct"] < 100.0),
        }
        return {
            "methods": methods,
            "ratios": {
                "memplan/full": {"per_step_median": rb, **_spread(self.ratio("memplan", "full"))},
                "memplan/static": {"per_step_median": rc, **_spread(self.ratio("memplan", "static"))},
                "memplan/none": {"per_step_median": tp["memplan"] / tp["none"], **_spread(self.ratio("memplan", "none"))},
                "full/none": {"per_step_median": tp["full"] / tp["none"], **_spread(self.ratio("full", "none"))},
            },
            "max_loss_difference_memplan_vs_none": loss_diff,
            "max_loss_difference_timed_vs_metered": timed_loss_diff,
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


def _method_summary(result: BenchResult, method: str) -> dict[str, Any]:
    ref, timed = result.by_method(method, "metered")[0], result.by_method(method)
    budget = result.budget_bytes
    n_steps = len(ref.step_s)
    return {
        "throughput_tokens_per_s": {"per_step_median": result.median_throughput(method),
                                    **_spread([r.throughput for r in timed])},
        "metered_throughput_tokens_per_s": ref.throughput,
        "steps_within_budget_pct": 100.0 * sum(p <= budget for p in ref.peaks) / len(ref.peaks),
        "max_peak_bytes": max(ref.peaks),
        "median_peak_bytes": int(statistics.median(ref.peaks)),
        "recomputed_forwards": ref.recomputed_forwards,
        "timed_recomputed_forwards": sorted({r.recomputed_forwards for r in timed}),
        "warmup_forwards": ref.warmup_forwards,
        "probe_forwards": ref.probe_forwards,
        "misses": ref.misses,
        "steps_checkpointing": ref.steps_checkpointing,
        "timed_plans_matching_pct": (100.0 * sum(r.plans_matching for r in timed) / (n_steps * len(timed))
                                     if method == "memplan" else 100.0),
        "plan_time_share_pct": 100.0 * sum(r.plan_seconds for r in timed) / sum(r.wall_s for r in timed),
        "observe_time_share_pct": 100.0 * sum(r.observe_seconds for r in timed) / sum(r.wall_s for r in timed),
        "knapsack_vs_greedy": dict(zip(("knapsack_blocks", "knapsack_recompute_s", "greedy_blocks", "greedy_recompute_s"),
                                       ref.knapsack_vs_greedy)),
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


class _UnmeteredCpuMeter(CpuMeter):
    """The controller's meter in timed runs: no dispatch mode, never "active" (so nothing is learned
    from it), but it still tracks the storages adopted at each forward (weights, gradients, batch),
    so the bytes live at the start of a step, which the plan depends on, read as in the metered run."""

    @property
    def active(self) -> bool:
        return False

    def __enter__(self) -> _UnmeteredCpuMeter:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        return None


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
    metered: bool
    wall_s: float = 0.0
    warmup_s: float = 0.0
    warmup_forwards: int = 0
    checkpointing: int = 0
    observe_s: float = 0.0
    plans_matching: int = 0
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    #: memplan: the (blocks, probe) choices of the current step, in order (a redo adds one).
    choices: list[tuple[tuple[bool, ...], bool]] = field(default_factory=list)
    #: memplan, metered: per step, the planning state before it, its first choice, whether it missed,
    #: and the refit seconds it spent.
    trace: list[tuple[dict[str, Any], tuple[tuple[bool, ...], bool], bool, float]] = field(default_factory=list)

    @property
    def adaptive(self) -> CheckpointController | None:
        return self.ctl if self.method == "memplan" else None


def _prepare(method: str, cfg: BenchConfig, init: dict[str, torch.Tensor], budget: int,
             static_plan: Sequence[bool], *, metered: bool) -> _Runner:
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
        if not metered:
            ctl.meter = _UnmeteredCpuMeter()
        if method == "static":
            ctl.fix_plan(static_plan)
            ctl.meter.limit_bytes = None  # measured, not enforced: a static plan has no safety net
    meter: MemoryMeter = ctl.meter if ctl is not None else CpuMeter()
    runner = _Runner(method=method, model=model, opt=opt, ctl=ctl, counter=counter, meter=meter, metered=metered)
    if method == "memplan":
        _record_choices(runner)
    return runner


def _record_choices(runner: _Runner) -> None:
    """Wrap the controller's plan choice and refit (instance attributes) to record them."""
    ctl = runner.ctl
    assert ctl is not None
    choose, observe = ctl._choose, ctl._observe

    def recorded_choose(*args: Any) -> Any:
        plan, probe = choose(*args)
        runner.choices.append((tuple(plan.checkpoint), bool(probe)))
        return plan, probe

    def timed_observe(*args: Any) -> None:
        t0 = time.perf_counter()
        observe(*args)
        runner.observe_s += time.perf_counter() - t0

    ctl._choose = recorded_choose  # type: ignore[method-assign,assignment]
    ctl._observe = timed_observe  # type: ignore[method-assign,assignment]


def _planning_state(ctl: CheckpointController) -> dict[str, Any]:
    state = copy.deepcopy({name: getattr(ctl, name) for name in _PLAN_STATE})
    state["learning"] = ctl._count["learning"]
    return state


def _load_planning_state(ctl: CheckpointController, state: dict[str, Any]) -> None:
    for name in _PLAN_STATE:
        setattr(ctl, name, copy.deepcopy(state[name]))
    ctl._count["learning"] = state["learning"]


def _warm_up(runner: _Runner, cfg: BenchConfig) -> None:
    """memplan's optional warm-up on short sample batches, timed as part of its run."""
    if runner.adaptive is None or not cfg.warmup_lengths:
        return
    t0 = time.perf_counter()
    batches = _batches(cfg, cfg.warmup_lengths, cfg.seed + 7)
    runner.adaptive.warm_up([_train_step(runner.model, b) for b in batches])
    runner.warmup_s = time.perf_counter() - t0
    runner.wall_s += runner.warmup_s
    runner.warmup_forwards = runner.counter.forward + runner.counter.backward


def _train_metered(runner: _Runner, batch: torch.Tensor) -> None:
    """One metered step (forward, backward, optimizer step) of one method; memplan's state traced."""
    model, opt, meter, adaptive = runner.model, runner.opt, runner.meter, runner.adaptive
    state = _planning_state(adaptive) if adaptive is not None else {}
    misses, observed = (adaptive.stats().misses if adaptive else 0), runner.observe_s
    runner.choices.clear()
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
    dt = time.perf_counter() - t0
    if adaptive is not None:
        if adaptive.last is not None:
            peak = max(peak, adaptive.last[2])
        runner.checkpointing += any(runner.choices[0][0]) if runner.choices else 0
        runner.trace.append((state, runner.choices[0] if runner.choices else ((), False),
                             adaptive.stats().misses > misses, runner.observe_s - observed))
    runner.wall_s += dt
    runner.step_s.append(dt)
    runner.losses.append(float(loss))
    runner.peaks.append(int(peak))


def _train_timed(runner: _Runner, batch: torch.Tensor, reference: _Runner, i: int) -> None:
    """One unmetered, timed step. memplan plans from the metered run's state before step ``i``."""
    model, opt, adaptive = runner.model, runner.opt, runner.adaptive
    redo = False
    if adaptive is not None:
        state, choice, redo, observe_s = reference.trace[i]
        _load_planning_state(adaptive, state)
        runner.choices.clear()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    step = _train_step(model, batch)
    loss = adaptive.step(step) if adaptive is not None else step()
    if redo:  # the metered step missed and was redone: pay a whole extra step with every block checkpointed
        opt.zero_grad(set_to_none=True)
        adaptive.fix_plan([True] * adaptive.n_blocks)  # type: ignore[union-attr]
        loss = adaptive.step(step)  # type: ignore[union-attr]
        adaptive.fix_plan(None)  # type: ignore[union-attr]
    opt.step()
    dt = time.perf_counter() - t0
    if adaptive is not None:
        dt += observe_s  # the refit a metered (or CUDA) step does after its backward
        runner.observe_s += observe_s
        runner.plans_matching += bool(runner.choices) and runner.choices[0] == choice
        runner.checkpointing += any(runner.choices[0][0]) if runner.choices else 0
    runner.wall_s += dt
    runner.step_s.append(dt)
    runner.losses.append(float(loss))


def _result(runner: _Runner, rep: int, batches: Sequence[torch.Tensor], static_plan: Sequence[bool]) -> MethodRun:
    adaptive = runner.adaptive
    stats = adaptive.stats() if adaptive is not None else None
    compare = (_compare_planners(adaptive, runner.model, runner.opt, batches) if adaptive and runner.metered
               else (0, 0.0, 0, 0.0))
    method = runner.method
    return MethodRun(
        method=method, kind="metered" if runner.metered else "timed", rep=rep, wall_s=runner.wall_s,
        step_s=tuple(runner.step_s), warmup_s=runner.warmup_s, tokens=sum(b.numel() for b in batches), losses=tuple(runner.losses),
        peaks=tuple(runner.peaks), recomputed_forwards=runner.counter.backward, warmup_forwards=runner.warmup_forwards,
        probe_forwards=stats.probe_forwards if stats else 0,
        misses=stats.misses if stats else 0,
        plan_seconds=stats.plan_seconds if stats else 0.0,
        observe_seconds=runner.observe_s,
        steps_checkpointing=runner.checkpointing if stats else (
            len(batches) if method == "full" or (method == "static" and any(static_plan)) else 0),
        plans_matching=runner.plans_matching,
        knapsack_vs_greedy=compare,
    )


def _metered_pass(cfg: BenchConfig, init: dict[str, torch.Tensor], batches: Sequence[torch.Tensor], budget: int,
                  static_plan: Sequence[bool]) -> tuple[list[_Runner], list[MethodRun]]:
    """The four methods in lockstep under the meter: step i of each (order rotated) before step i + 1 of any."""
    runners = [_prepare(m, cfg, init, budget, static_plan, metered=True) for m in METHODS]
    for runner in runners:
        _warm_up(runner, cfg)
    for i, batch in enumerate(batches):
        k = i % len(runners)
        for runner in runners[k:] + runners[:k]:
            _train_metered(runner, batch)
    return runners, [_result(r, 0, batches, static_plan) for r in runners]


def _timed_pass(cfg: BenchConfig, init: dict[str, torch.Tensor], batches: Sequence[torch.Tensor], budget: int,
                static_plan: Sequence[bool], rep: int, reference: _Runner) -> list[MethodRun]:
    """The four methods in lockstep without the meter; the rotation is shifted every repetition."""
    runners = [_prepare(m, cfg, init, budget, static_plan, metered=False) for m in METHODS]
    for runner in runners:
        _warm_up(runner, cfg)
    for i, batch in enumerate(batches):
        k = (i + rep + 1) % len(runners)
        for runner in runners[k:] + runners[:k]:
            _train_timed(runner, batch, reference, i)
    return [_result(r, rep, batches, static_plan) for r in runners]


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
        "cpu_affinity": ",".join(map(str, sorted(os.sched_getaffinity(0)))) if hasattr(os, "sched_getaffinity") else "",
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


@contextmanager
def _pinned(core: int | None) -> Iterator[None]:
    if core is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_bench(cfg: BenchConfig | None = None, *, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Run the benchmark (see the module docstring) and return every run with its summary."""
    cfg = cfg or BenchConfig()
    say = progress or (lambda _msg: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        with _pinned(cfg.pin_core):
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
    machine = _machine()
    refs, runs = _metered_pass(cfg, init, batches, budget, static_plan)
    for run in runs:
        say(f"metered {run.method}: {run.throughput:.1f} tokens/s, max peak {max(run.peaks)}")
    reference = refs[METHODS.index("memplan")]
    for ref in refs:  # free the metered models before timing
        ref.model = ref.opt = ref.ctl = None  # type: ignore[assignment]
    for rep in range(cfg.repeats):
        for run in _timed_pass(cfg, init, batches, budget, static_plan, rep, reference):
            say(f"timed {rep + 1}/{cfg.repeats} {run.method}: {run.throughput:.1f} tokens/s")
            runs.append(run)
    runs.sort(key=lambda r: (r.kind != "metered", METHODS.index(r.method), r.rep))
    return BenchResult(
        config=cfg, n_params=n_params, lengths=tuple(lengths), budget_bytes=budget, static_plan=static_plan,
        runs=tuple(runs), machine=machine,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def with_overrides(cfg: BenchConfig, **changes: Any) -> BenchConfig:
    """``cfg`` with the given fields replaced (``None`` values ignored)."""
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})
