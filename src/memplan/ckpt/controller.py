"""The runtime: per batch, predict → plan → checkpoint; measure → refine; redo a step that misses.

:class:`CheckpointController` is what :func:`memplan.ckpt.auto_checkpoint` attaches to a model. A
forward pre-hook on the model reads the batch's size, the meter's live bytes and which gradients
are still to be allocated, and picks a plan (cached per size bucket). Each block's patched
``forward`` then runs either plainly — measuring the bytes it keeps and its time — or under
non-reentrant ``torch.utils.checkpoint``. Gradient hooks on the block outputs cut the backward
into phases whose peaks calibrate the non-block terms of the memory model (see
:mod:`memplan.ckpt.planner`).

Until every predictor is accepted, steps are *sheltered* learning steps, as Mimose's first steps
are: every block runs under checkpoint and is probed by one extra plain forward whose kept bytes
and time are measured and dropped (RNG state restored, so the step's numbers are unchanged). A
batch more than :data:`SHELTER_BEYOND` times larger than any measured is sheltered too, rather than
trusting a far extrapolation. :meth:`~CheckpointController.warm_up` runs steps on sample batches
before training instead.

The model plans from its own hooks, whatever runs the loop: the forward pre-hook starts a step
(on CPU it also enters the live-storage meter, which stays entered until the optimizer's step has
run), a callback queued on the autograd engine ends it when the backward finishes, and global
optimizer step hooks (:mod:`memplan.ckpt.loop_hooks`) find the optimizer holding the model's
parameters, count its states and meter its step. Only :meth:`~CheckpointController.step` adds the
safety net (a step redone after an out-of-memory): a plain loop cannot be rerun from a hook.
"""

from __future__ import annotations

import gc
import math
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memplan.ckpt.errors import BatchTooLargeError
from memplan.ckpt.loop_hooks import LoopHooks
from memplan.ckpt.meter import CpuMeter, MemoryMeter, storage_bytes, tensor_bytes
from memplan.ckpt.model_state import state_tensors
from memplan.ckpt.offload import OffloadHooks
from memplan.ckpt.explore import explore_sac, sac_share, step_clock
from memplan.ckpt.opcosts import OpCosts
from memplan.ckpt.opprofile import OpRecorder, roofline_for, sac_context
from memplan.ckpt.phases import CkptStepState, block_seconds, grad_tensor, new_bytes, phase_terms, skip_output, tensors_in
from memplan.ckpt.planner import (
    BlockCost,
    CheckpointPlan,
    PlanCache,
    StepCost,
    plan_greedy,
    plan_knapsack,
    size_bucket,
)
from memplan.ckpt.predictor import SizeSeries
from memplan.ckpt.safety import drop_grads, restore_grads, rng_state, set_rng_state, stash_grads
from memplan.ckpt.sizes import SizeFn, batch_of, measure_size
from memplan.ckpt.stats import CkptStats
from memplan.errors import UnsupportedError
from memplan.units import format_bytes

__all__ = ["CheckpointController"]

T = TypeVar("T")
_PHASES = ("forward", "head", "block", "recompute", "tail")
#: Each miss widens the safety margin by this share of the budget, up to _MAX_MARGIN.
_MISS_MARGIN_STEP = 0.01
_MAX_MARGIN = 0.2
#: Share of the budget added to the margin per doubling of the size beyond the sizes measured.
_EXTRAPOLATION_MARGIN = 0.03
#: Phase terms (residuals that may hover near zero) are judged on errors relative to this share of the budget.
_PHASE_FLOOR = 0.2
#: Recompute times are rounded to this share of the mean block time, so near-equal blocks tie.
_TIME_QUANTUM = 0.05
#: A plain loop's step whose predicted peak is below this share of the budget runs without the CPU meter.
METER_ABOVE = 0.6
#: A batch this many times larger than the largest measured one is sheltered (measured, every block checkpointed).
SHELTER_BEYOND = 2.0


def _forced(checkpoint: tuple[bool, ...], method: str, modes: tuple[str, ...] = ()) -> CheckpointPlan:
    """A plan chosen by rule (warm-up, shelter, fixed), not by the planner: no prediction behind it."""
    return CheckpointPlan(checkpoint=checkpoint, predicted_peak_bytes=0, recompute_s=0.0, fits=True, method=method,
                          modes=modes)


class CheckpointController(LoopHooks):
    """Decides, per batch, which blocks of a model run under ``torch.utils.checkpoint``.

    Created by :func:`memplan.ckpt.auto_checkpoint`; reach it as ``model.memplan_ckpt``.
    Use :meth:`step` around forward + backward for the safety net and for measurements on CPU.
    """

    def __init__(
        self, model: nn.Module, blocks: Sequence[nn.Module], *, budget_bytes: int, size_fn: SizeFn,
        meter: MemoryMeter, device: torch.device, optimizer: torch.optim.Optimizer | None, margin: float,
        step_arms: bool = True,
    ) -> None:
        self.model = model
        self.blocks = tuple(blocks)
        self.budget_bytes = budget_bytes
        self.meter = meter
        self.device = device
        self.optimizer = optimizer
        self.size_fn = size_fn
        self.planner: Callable[[Sequence[BlockCost], StepCost], CheckpointPlan] = plan_knapsack
        self._margin = margin
        self._acts = [SizeSeries(keep="max") for _ in self.blocks]
        self._times = [SizeSeries(keep="mean") for _ in self.blocks]
        # phase terms have an intercept (constant buffers): a line through three sizes, not two
        self._phases = {name: SizeSeries(keep="max", floor=_PHASE_FLOOR * budget_bytes, min_points=3)
                        for name in _PHASES}
        self._block_params = [[p for p in b.parameters() if p.requires_grad] for b in self.blocks]
        self._cache = PlanCache()
        #: off: no whole-step timing of planned steps, no SAC exploration (memplan.ckpt.explore)
        self.step_arms = step_arms
        self._timed = False
        self._clock = step_clock(device)
        #: op-level predictors (per-op profiles from seed(), FLOP-based seconds, selective levels, offload)
        self.ops = OpCosts(roof=roofline_for(device), device=device)
        #: a fast seeding pass: (mode per block, blocks skipped, blocks whose ops are recorded)
        self._seed_spec: tuple[tuple[str, ...], frozenset[int], frozenset[int]] | None = None
        self._seed_seconds = 0.0
        self._version = 0
        self._fixed: tuple[bool, ...] | None = None
        self._ready = False
        self._warm_index: int | None = None
        self._force: str | None = None
        self._step: CkptStepState | None = None
        self._count = dict.fromkeys(
            ("steps", "sheltered", "misses", "over", "recomputed", "probes", "opt_steps", "opt_metered", "seeded",
             "selective", "offloaded", "explored", "metered"), 0)
        self._seeding = False  # a fake-tensor pass of seed_from_fake is running
        self._owned = False  # the CPU meter was entered by a hook (plain loop), not by step()
        self._optimizers: dict[int, Any] = {}  # id → weak reference of the optimizers found by the hooks
        self._opt_depth = 0
        self._opt_peak = 0
        self._opt_over = 0
        if optimizer is not None:
            self._optimizers[id(optimizer)] = weakref.ref(optimizer)
        self._plan_seconds = 0.0
        #: what was done to the host allocator (memplan.ckpt.hostmem; set by auto_checkpoint on CPU)
        self.host_memory = "unchanged: not a CPU device"
        self._max_peak = 0
        self._handles: list[Any] = []
        self._last_size = 0
        #: (size, plan, measured peak bytes) of the last finished step (peak 0: the step ran unmetered).
        self.last: tuple[int, CheckpointPlan, int] | None = None

    # ------------------------------------------------------------------ public surface
    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def ready(self) -> bool:
        """Whether every predictor has been accepted once (then no more sheltered steps are run)."""
        if not self._ready:
            phases = [s for name, s in self._phases.items() if name != "block"]
            self._ready = all(s.accepted for s in self._acts) and all(s.accepted for s in phases)
        return self._ready

    def stats(self) -> CkptStats:
        """A snapshot of the counters."""
        c = self._count
        return CkptStats(
            steps=c["steps"], sheltered_steps=c["sheltered"], misses=c["misses"], over_budget_steps=c["over"],
            recomputed_forwards=c["recomputed"], probe_forwards=c["probes"], plan_seconds=self._plan_seconds,
            plan_cache_hits=self._cache.hits, plan_cache_misses=self._cache.misses, max_peak_bytes=self._max_peak,
            optimizer_steps=c["opt_steps"], max_optimizer_peak_bytes=self._opt_peak,
            optimizer_over_budget_steps=self._opt_over,
            optimizer_states="measured" if self.optimizer is not None else "assumed AdamW (no optimizer seen yet)",
            seeded_passes=c["seeded"], seed_seconds=self._seed_seconds, selective_forwards=c["selective"],
            offloaded_forwards=c["offloaded"], time_scale=self.ops.scale, explored_steps=c["explored"],
            metered_steps=c["metered"], host_memory=self.host_memory,
        )

    def series(self) -> dict[str, Any]:
        """The predictors: per-block activation bytes and seconds, and the phase terms (name → series)."""
        out: dict[str, Any] = {f"block{j}.act_bytes": s for j, s in enumerate(self._acts)}
        out.update({f"block{j}.forward_s": s for j, s in enumerate(self._times)})
        out.update({f"{name}_bytes": s for name, s in self._phases.items()})
        return out

    def fix_plan(self, checkpoint_blocks: Sequence[bool] | None) -> None:
        """Use this plan for every batch (a static plan), or ``None`` to plan per batch again."""
        if checkpoint_blocks is not None and len(checkpoint_blocks) != self.n_blocks:
            raise ValueError(f"fix_plan needs {self.n_blocks} flags, got {len(checkpoint_blocks)}")
        self._fixed = None if checkpoint_blocks is None else tuple(bool(c) for c in checkpoint_blocks)

    def plan_for(
        self, size: int, *, static_bytes: int, grad_bytes: Sequence[int] | None = None, method: str = "knapsack",
    ) -> CheckpointPlan:
        """The plan the predictors give for a batch of ``size`` (needs measurements at a few sizes).

        Plans against the budget less the safety margin; when nothing fits that, against the budget.
        """
        grads = tuple(grad_bytes) if grad_bytes is not None else tuple(
            sum(tensor_bytes(p) for p in ps) for ps in self._block_params)
        costs = self._block_costs(size, grads)
        planner = plan_greedy if method == "greedy" else plan_knapsack
        plan = planner(costs, self._step_cost(size, static_bytes, self._extrapolation_margin(size)))
        if not plan.fits:
            plan = planner(costs, self._step_cost(size, static_bytes, 0.0))
        return plan

    def measured_size(self) -> int:
        """The largest size at which every phase of a step has been measured (0 before any step).

        The backward through the blocks is one phase measured in either of its two forms: ``block``
        (a block kept) or ``recompute`` (a block checkpointed); a step that checkpoints nothing
        measures only the first, a sheltered step only the second. Requiring both would shelter
        every batch beyond twice the largest *sheltered* one even after plain steps measured it.
        """
        p = self._phases
        backward = max(p["block"].largest_size, p["recompute"].largest_size)
        return min(p["forward"].largest_size, p["head"].largest_size, p["tail"].largest_size, backward)

    def _extrapolation_margin(self, size: int) -> float:
        """The safety margin, widened per doubling of ``size`` beyond the sizes measured in every phase."""
        seen = min(s.largest_size for name, s in self._phases.items() if name != "block") or 1
        widen = _EXTRAPOLATION_MARGIN * max(0.0, math.log2(size / seen))
        return min(_MAX_MARGIN, self._margin + widen)

    def _block_costs(self, size: int, grads: Sequence[int]) -> list[BlockCost]:
        """Per block: bytes kept, gradient bytes, recompute seconds, and its op-level options.

        Seconds come from the op profile (FLOPs, rescaled by measured times) where :meth:`seed`
        recorded one, else from measured block times rounded so that near-equal blocks tie.
        """
        raw = [self._times[j](size) if self._times[j].points else 1.0 for j in range(self.n_blocks)]
        quantum = _TIME_QUANTUM * (sum(raw) / len(raw) or 1.0)
        costs = []
        for j in range(self.n_blocks):
            act = math.ceil(self._acts[j](size))
            if self.ops.has(j):
                costs.append(BlockCost(act_bytes=act, grad_bytes=grads[j], recompute_s=self.ops.full_s(j, size),
                                       extra=self.ops.options(j, size, act)))
            else:
                costs.append(BlockCost(act_bytes=act, grad_bytes=grads[j],
                                       recompute_s=max(quantum, round(raw[j] / quantum) * quantum)))
        return costs

    def _step_cost(self, size: int, static_bytes: int, margin: float) -> StepCost:
        def term(name: str) -> int:
            return math.ceil(self._phases[name](size))

        kept = term("block" if self._phases["block"].points else "recompute")
        return StepCost(
            static_bytes=static_bytes,
            forward_bytes=term("forward"),
            head_bytes=term("head"),
            block_bytes=kept,
            recompute_bytes=max(kept, term("recompute")),  # a recompute holds what a kept block does, and more
            tail_bytes=term("tail"),
            budget_bytes=int(self.budget_bytes * (1.0 - margin)),
        )

    def warm_up(self, steps: Iterable[Callable[[], object]], *, sheltered: bool = False) -> None:
        """Run each callable (forward + backward of a small sample batch) to seed the predictors.

        By default warm-up step ``k`` checkpoints only one block (the last, then the one before, …)
        and probes it, so the batches must fit without checkpointing; ``sheltered=True`` checkpoints
        every block (Mimose's sheltered steps) for sizes that might not. Gradients and the RNG
        state are restored afterwards: training continues as if nothing ran.
        """
        for k, fn in enumerate(steps):
            stash, rng = stash_grads(self.model), rng_state(self.device)
            self._warm_index = None if sheltered else self.n_blocks - 1 - k % self.n_blocks
            try:
                with self._metered():
                    result, failed = self._attempt(fn, force="shelter")
                if failed:
                    raise BatchTooLargeError(
                        f"a warm-up batch does not fit the budget {format_bytes(self.budget_bytes)}"
                        + ("" if sheltered else " without checkpointing; pass sheltered=True or smaller batches"))
                del result
            finally:
                self._warm_index = None
                drop_grads(self.model)
                restore_grads(stash)
                set_rng_state(rng, self.device)

    def seed_from_fake(self, steps: Iterable[Callable[[], object]]) -> None:
        """Seed the predictors from fake-tensor runs of sample steps: no compute, no memory used.

        Each callable runs forward + backward of a sample batch; it is run twice on fake tensors
        (:mod:`memplan.ckpt.seed`), with every block checkpointed and probed and with none. Three
        sizes make every predictor ready; seed up to the largest batch expected and no training
        step is sheltered. CPU meter only; gradients, RNG state and training counters unchanged.
        """
        from memplan.ckpt.seed import seed_from_fake

        seed_from_fake(self, steps)

    def seed(self, steps: Iterable[Callable[[], object]]) -> float:
        """Seed every predictor before training from fake runs of a few blocks: no compute, no memory.

        Each callable runs forward + backward of a sample batch (two or three sizes up to the
        largest batch expected). Under fake tensors, one block of each block class runs plainly with
        its ops profiled (FLOPs, bytes, what backward saves), one checkpointed, the others are
        skipped; the measurements are shared by the blocks of that class. Returns the seconds spent
        (also in ``stats().seed_seconds``). See :mod:`memplan.ckpt.fastseed`.
        """
        from memplan.ckpt.fastseed import seed_fast

        t0 = time.perf_counter()
        seed_fast(self, steps)
        elapsed = time.perf_counter() - t0
        self._seed_seconds += elapsed
        return elapsed

    def run_seed_pass(self, fn: Callable[[], object], *, force: str) -> None:
        """One fake pass of :meth:`seed_from_fake` with a forced plan: bytes observed, counters untouched."""
        counts = dict(self._count)
        self._force, self._seeding = force, True
        try:
            with self._metered():
                fn()
                self._finish_step()
        except BaseException:
            self._step = None
            raise
        finally:
            self._force, self._seeding = None, False
            self._count = counts
        self._count["seeded"] += 1

    def step(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (forward + backward of one batch) with the safety net; return its result.

        If the step runs out of memory (CUDA) or over the budget (the CPU meter's limit), its partial
        gradients are dropped, the RNG state restored, and it is run again with every block
        checkpointed; the miss is counted and fed to the predictors. Gradients that existed before
        the step are set aside during it and added back afterwards.
        """
        stash, rng = stash_grads(self.model), rng_state(self.device)
        try:
            with self._metered():
                result, failed = self._attempt(fn, force=None)
                if failed:
                    self._count["misses"] += 1
                    drop_grads(self.model)
                    set_rng_state(rng, self.device)
                    result, failed = self._attempt(fn, force="all" if self.ready else "shelter")
                    if failed:
                        drop_grads(self.model)
                        raise BatchTooLargeError(
                            f"a batch of size {self._last_size} does not fit the budget "
                            f"{format_bytes(self.budget_bytes)} even with every block checkpointed; "
                            "raise the budget or split the batch")
        finally:
            restore_grads(stash)
        return result  # type: ignore[return-value]

    # ------------------------------------------------------------------ step mechanics
    def _metered(self) -> Any:
        from contextlib import nullcontext

        return nullcontext() if self.meter.active else self.meter

    def _attempt(self, fn: Callable[[], T], *, force: str | None) -> tuple[T | None, bool]:
        self._force = force
        limited = isinstance(self.meter, CpuMeter)
        if limited:  # the CPU meter simulates an out-of-memory only where the safety net can redo the step
            self.meter.limit_bytes = self.budget_bytes
        try:
            result = fn()
        except torch.OutOfMemoryError:
            self._abort_step()
            failed = True
        except BaseException:
            self._step = None  # a bug in fn, or an interrupt: measure nothing from it
            raise
        else:
            self._finish_step()
            failed = False
        finally:
            self._force = None
            if limited:
                self.meter.limit_bytes = None
        if failed:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return None, True
        return result, False

    # ------------------------------------------------------------------ hooks
    def on_model_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the model: start a step and choose its plan."""
        if torch.compiler.is_compiling():
            raise UnsupportedError(
                "auto_checkpoint: torch.compile is not supported (the plan changes per batch, and the CPU meter "
                "is a dispatch mode dynamo cannot trace); train the wrapped model uncompiled, or compile "
                "it with a fixed checkpointing policy instead")
        if self._step is not None:
            self._finish_step()
        if not (self.model.training and torch.is_grad_enabled()):
            if self._opt_depth == 0:
                self.release_meter()  # an evaluation forward after training steps
            return
        size = measure_size(self.size_fn, batch_of(args, kwargs))
        self._last_size = size
        self._block_params = [[p for p in b.parameters() if p.requires_grad] for b in self.blocks]  # may be replaced
        resident = [*state_tensors(self.model, self.optimizer), *tensors_in((args, kwargs))]
        if self.meter.active or not isinstance(self.meter, CpuMeter):
            self.meter.adopt(resident)
            static = self.meter.current_bytes
        else:
            static = storage_bytes(resident)
        grads = tuple(sum(tensor_bytes(p) for p in ps if p.grad is None) for ps in self._block_params)
        skip = self._seed_spec[1] if self._seeding and self._seed_spec else frozenset()
        grads = tuple(0 if j in skip else g for j, g in enumerate(grads))
        t0, self._timed = time.perf_counter(), False
        plan, probe = self._choose(size, static, grads)
        self._plan_seconds += time.perf_counter() - t0
        if not self.meter.active and isinstance(self.meter, CpuMeter) and self._worth_metering(plan, probe):
            self._enter_meter()
            self.meter.adopt(resident)
            static = self.meter.current_bytes
        metered = self.meter.active or not isinstance(self.meter, CpuMeter)
        if metered and self._force is None and not self._seeding:
            self._count["metered"] += 1
        self._step = CkptStepState(size=size, plan=plan, static_bytes=static, grad_bytes=grads, probe=probe,
                                metered=metered, seed=self._seeding, skip=skip, timed=self._timed, clock0=self._clock())
        self._count["sheltered"] += probe
        if self._force is None:
            self._count["steps"] += 1
        self.meter.mark()

    def _worth_metering(self, plan: CheckpointPlan, probe: bool) -> bool:
        """Whether a plain loop's step is measured by the CPU meter (a dispatch mode: Python work per operator).

        A step is measured while the predictors learn (forced or sheltered plans, not ready yet) and
        whenever its predicted peak comes within :data:`METER_ABOVE` of the budget, where a
        misprediction could matter; a small batch predicted far below the budget runs unmetered
        (its block seconds are still measured). ``step()`` always meters (its safety net needs it).
        """
        if probe or self._force is not None or plan.method not in ("knapsack", "none") or not self.ready:
            return True
        return plan.predicted_peak_bytes >= METER_ABOVE * self.budget_bytes

    def _choose(self, size: int, static: int, grads: tuple[int, ...]) -> tuple[CheckpointPlan, bool]:
        n = self.n_blocks
        if self._force == "all":
            return _forced((True,) * n, "all"), False
        if self._force == "none":
            return _forced((False,) * n, "none"), False
        if self._force == "seed" and self._seed_spec is not None:
            modes = self._seed_spec[0]
            return _forced(tuple(m != "keep" for m in modes), "static", modes), False  # acts: from the kept block
        if self._fixed is not None:
            return _forced(self._fixed, "static"), False
        if self._force == "shelter" and self._warm_index is not None:
            flags = tuple(j == self._warm_index for j in range(n))
            return _forced(flags, "static"), True
        if self._force == "shelter":
            return _forced((True,) * n, "all"), True
        if not self.ready or size > SHELTER_BEYOND * self.measured_size():  # a sheltered learning step: all checkpointed, probed
            return _forced((True,) * n, "all"), True
        index, upper = size_bucket(size)
        key = (index, static >> 20, self._version, any(grads))
        plan = self._cache.get(key)
        if plan is None:
            plan = self.plan_for(upper, static_bytes=static, grad_bytes=grads)
            self._cache.put(key, plan)
        plan, self._timed = explore_sac(self, plan, size, upper, static, grads)
        return plan, False

    def block_forward(self, j: int, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The patched ``forward`` of block ``j``: plain (measured), checkpointed, selective or offloaded, as planned."""
        st = self._step
        if st is None or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if j in st.skip:  # a fast seeding pass: the block is an identity on the hidden states
            return skip_output(st.templates.get(type(self.blocks[j])), args, kwargs)
        if j == 0:
            self._hook(st, grad_tensor((args, kwargs)), -1)
        t0 = time.perf_counter()
        mode = st.plan.mode(j)
        if st.plan.checkpoint[j]:
            if st.probe:
                self._probe(st, j, forward, args, kwargs)
            before = self.meter.current_bytes
            context = sac_context(self.ops.level(j, int(mode[3:])).keys) if mode.startswith("sac") else None
            out = checkpoint(forward, *args, use_reentrant=False, **({"context_fn": context} if context else {}),
                             **kwargs)
            if context is not None:
                st.kept[j] = self._held_since(before, out, args, kwargs)
                self._count["selective"] += 1
            self._count["recomputed"] += 1
        else:
            out = self._plain_forward(st, j, mode, forward, args, kwargs)
        st.peaks[("forward", j)] = self.meter.mark()
        self._hook(st, grad_tensor(out), j)
        st.forward_s[j] = time.perf_counter() - t0
        return out

    def _plain_forward(self, st: CkptStepState, j: int, mode: str, forward: Callable[..., Any], args: Any,
                       kwargs: Any) -> Any:
        """Block ``j`` run without recompute: kept (its bytes and time measured) or with its saved tensors offloaded."""
        before, t0 = self.meter.current_bytes, time.perf_counter()
        if mode == "offload":
            with OffloadHooks(self.device):
                out = forward(*args, **kwargs)
            st.kept[j] = self._held_since(before, out, args, kwargs)
            self._count["offloaded"] += 1
            return out
        record = st.seed and self._seed_spec is not None and j in self._seed_spec[2]
        if record:
            with OpRecorder() as recorder:
                out = forward(*args, **kwargs)
            st.ops[j] = recorder.records()
            st.templates.setdefault(type(self.blocks[j]), out)
        else:
            out = forward(*args, **kwargs)
        st.times[j] = time.perf_counter() - t0
        if st.metered:  # an unmetered step's bytes are not observed
            st.acts[j] = self._held_since(before, out, args, kwargs)
        return out

    def _held_since(self, before: int, out: Any, args: Any, kwargs: Any) -> int:
        """Bytes a block's forward left held since the meter read ``before``, beyond its output's new tensors."""
        return max(0, self.meter.current_bytes - before - new_bytes(out, (args, kwargs)))

    def _probe(self, st: CkptStepState, j: int, forward: Callable[..., Any], args: Any, kwargs: Any) -> None:
        rng, before, peak = rng_state(self.device), self.meter.current_bytes, self.meter.peak_bytes
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        st.times[j] = time.perf_counter() - t0
        st.acts[j] = self._held_since(before, out, args, kwargs)
        del out
        set_rng_state(rng, self.device)
        if isinstance(self.meter, CpuMeter):
            self.meter.mark()
            self.meter._peak = max(peak, self.meter.current_bytes)
        self._count["probes"] += 1

    def _hook(self, st: CkptStepState, tensor: torch.Tensor | None, j: int) -> None:
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(lambda _grad: self._boundary(st, j))

    def _boundary(self, st: CkptStepState, j: int) -> None:
        """Gradient of block j's output is complete: the phase before it ends, block j's begins.

        The first boundary of a backward queues :meth:`_end_backward` to run when the backward is over.
        """
        if not st.backward_started:
            st.backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_backward(st))
        st.marks[j] = time.perf_counter()
        st.peaks[st.phase] = max(st.peaks.get(st.phase, 0), self.meter.mark())
        st.phase = j if j >= 0 else "tail"

    def _end_backward(self, st: CkptStepState) -> None:
        """Callback at the end of the backward: the step is over (its tail phase included)."""
        if self._step is st:
            self._finish_step()

    # ------------------------------------------------------------------ learning
    def _finish_step(self) -> None:
        st, self._step = self._step, None
        if st is None:
            return
        st.peaks[st.phase] = max(st.peaks.get(st.phase, 0), self.meter.mark())
        if not (st.seed or st.probe) and self.ops.times.observe(
                st.size, [st.plan.mode(j) for j in range(self.n_blocks)], block_seconds(st, self.n_blocks)):
            self._version += 1  # the options' prices changed: plans again
        if st.timed:
            self._observe_step_time(st)
        if not st.metered:
            if not st.seed:
                self.last = (st.size, st.plan, 0)
            return
        if st.seed:  # a fake pass: its peak is no training step's
            self._observe(st)
            return
        peak = max(st.peaks.values())
        self._max_peak = max(self._max_peak, peak)
        self.last = (st.size, st.plan, peak)
        if peak > self.budget_bytes:
            self._count["over"] += 1
        self._observe(st)

    def _observe_step_time(self, st: CkptStepState) -> None:
        """A whole planned step's seconds, per roofline second, with its share of blocks under per-op SAC."""
        modes = tuple(st.plan.mode(j) for j in range(self.n_blocks))
        share = sac_share(modes, tuple(self.ops.roof_block_s(j, st.size) for j in range(self.n_blocks)))
        seconds = (self._clock() - st.clock0) / self.ops.roof_s(st.size)
        if share is not None and self.ops.steps.observe(st.size, share, seconds):
            self._version += 1  # SAC's price changed near this size: plan again

    def _abort_step(self) -> None:
        st, self._step = self._step, None
        if st is None:
            return
        st.peaks[st.phase] = max(st.peaks.get(st.phase, 0), self.meter.mark())
        self._margin = min(_MAX_MARGIN, self._margin + _MISS_MARGIN_STEP)
        self._version += 1
        if st.metered:
            self._observe(st)

    def _observe(self, st: CkptStepState) -> None:
        """Feed the step's measurements to the predictors; new information invalidates cached plans."""
        changed = False
        for j, value in st.acts.items():
            changed |= self._acts[j].add(st.size, value)
            if not st.seed:  # a fake kernel takes no time
                self._times[j].add(st.size, st.times[j])
                if st.plan.mode(j) == "keep":
                    self.ops.observe_forward(j, st.size, st.times[j])
        for j, held in st.kept.items():
            mode = st.plan.mode(j)
            if mode.startswith("sac"):
                changed |= self.ops.observe_held(j, int(mode[3:]), st.size, held)
        acts: list[float] = []
        for j in range(self.n_blocks):
            if j in st.skip:
                acts.append(0.0)
            elif j in st.acts or self._acts[j].points:
                acts.append(float(st.acts.get(j, self._acts[j](st.size) if self._acts[j].points else 0)))
            else:
                if changed:
                    self._version += 1
                return
        kept = [0.0 if j in st.skip else float(st.kept.get(j, 0 if st.plan.checkpoint[j] else acts[j]))
                for j in range(self.n_blocks)]
        for name, term in phase_terms(st, acts, kept).items():
            changed |= self._phases[name].add(st.size, term)
        if changed:
            self._version += 1
