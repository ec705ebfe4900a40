"""Choosing which blocks to checkpoint for one batch: exact knapsack, Mimose's greedy, a plan cache.

The step's memory is modelled by phases (bytes; ``S`` = static bytes live at the start of the step:
weights, existing gradients, optimizer states, the batch):

* **block i forward** (i = 0 … N-1): ``S + H_fwd + Σ_{j<i, kept} a_j + a_i`` — a checkpointed block
  still builds all its intermediates while it runs;
* **head** (loss and its backward): ``S + H_head + Σ_{j kept} a_j``
* **block i backward** (i = N-1 … 0): ``S + H_block + G_{≥i} + Σ_{j<i, kept} a_j + a_i`` —
  block i's activations are live whether kept or recomputed, blocks after it have freed theirs and
  allocated their gradients ``g_j``; a recomputed block uses ``H_recompute`` instead of ``H_block``
  (the recompute's own transients);
* **tail** (embedding backward): ``S + H_tail + G_{≥0}``.

``a_j`` are the per-block activation bytes checkpointing removes, ``H_*`` the non-block bytes of
each phase, all predicted for this batch's size. The plan is the set of kept blocks that maximises
the recompute time saved subject to *every* phase fitting the budget: an exact 0/1 knapsack, solved
by dynamic programming over the Pareto front of (kept bytes so far, seconds saved) — exact because
every phase constraint grows with the bytes kept before it. Ties go to keeping later blocks.

**Per-op options.** A block may offer more than keep / checkpoint (:class:`BlockOption`): selective
checkpointing levels (some ops' outputs saved, the rest recomputed: fewer bytes kept than a plain
block, less recompute than a checkpointed one) and offloading its saved tensors to host memory (bytes
kept near zero, cost the transfer time not hidden behind compute). The same Pareto dynamic
programme picks one option per block, minimising predicted seconds, the bytes a block keeps being
its option's ``kept_bytes``. :func:`plan_greedy` is
Mimose's greedy (checkpoint the blocks freeing most bytes per recompute second first) for
comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "BlockCost", "BlockOption", "CheckpointPlan", "PlanCache", "StepCost", "plan_greedy", "plan_knapsack", "predicted_peak",
    "size_bucket",
]

#: Seconds of blocks later in the forward weigh this much more per block, so that ties keep later blocks.
_TIE_BONUS = 1e-9
#: Seconds added to every option that recomputes, so that an option priced like keeping loses to keeping.
_RECOMPUTE_TIE = 1e-9
#: Plans are cached per geometric size bucket of this many buckets per doubling of the size.
BUCKETS_PER_OCTAVE = 16


@dataclass(frozen=True, kw_only=True)
class BlockOption:
    """One way to run a block: what it keeps until its backward and what it costs in seconds."""

    #: "keep", "full" (checkpointed), "sac<k>" (selective checkpoint level k) or "offload".
    mode: str
    #: Bytes the block holds from its forward to its backward under this option.
    kept_bytes: int
    #: Predicted extra seconds (recompute, or transfer not overlapped with compute).
    cost_s: float
    #: Whether the backward recomputes (its phase uses the recompute term ``H_recompute``).
    recomputes: bool


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """What one block costs for this batch (predicted)."""

    #: Activation bytes the block keeps for backward that checkpointing would drop.
    act_bytes: int
    #: Gradient bytes allocated during this block's backward (0 when gradients already exist).
    grad_bytes: int
    #: Seconds of one extra forward of the block (the recompute cost).
    recompute_s: float
    #: Options beyond keep / full checkpoint (selective levels, offload); keep and full are implied.
    extra: tuple[BlockOption, ...] = ()

    def options(self) -> tuple[BlockOption, ...]:
        """Every option: keep, full checkpoint, then the extra ones."""
        return (BlockOption(mode="keep", kept_bytes=self.act_bytes, cost_s=0.0, recomputes=False),
                BlockOption(mode="full", kept_bytes=0, cost_s=self.recompute_s, recomputes=True), *self.extra)


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """The non-block terms of the step's memory model, and the budget (bytes)."""

    static_bytes: int
    forward_bytes: int
    head_bytes: int
    block_bytes: int
    recompute_bytes: int
    tail_bytes: int
    budget_bytes: int


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """Which blocks to checkpoint for one batch, and what the model predicts for it."""

    #: One flag per block, in forward order: True = run under ``torch.utils.checkpoint``.
    checkpoint: tuple[bool, ...]
    predicted_peak_bytes: int
    #: Predicted seconds of recompute (extra block forwards).
    recompute_s: float
    #: Whether the predicted peak is within the budget (False: even checkpointing everything is not enough).
    fits: bool
    method: Literal["knapsack", "greedy", "all", "none", "static"] = "knapsack"
    #: Per block: "keep", "full", "sac<k>" or "offload" (empty: from ``checkpoint``, keep or full).
    modes: tuple[str, ...] = ()

    @property
    def n_checkpointed(self) -> int:
        return sum(self.checkpoint)

    def mode(self, j: int) -> str:
        """How block ``j`` runs."""
        return self.modes[j] if self.modes else ("full" if self.checkpoint[j] else "keep")


def predicted_peak(blocks: Sequence[BlockCost], step: StepCost, checkpoint: Sequence[bool]) -> int:
    """The largest phase of the step's memory model for this plan (bytes)."""
    return peak_of_options(blocks, step, [_flag_option(b, c) for b, c in zip(blocks, checkpoint)])


def _flag_option(block: BlockCost, checkpointed: bool) -> BlockOption:
    return block.options()[1 if checkpointed else 0]


def peak_of_options(blocks: Sequence[BlockCost], step: StepCost, chosen: Sequence[BlockOption]) -> int:
    """The largest phase of the step's memory model when block ``j`` runs as ``chosen[j]`` (bytes)."""
    kept = sum(o.kept_bytes for o in chosen)
    peak = step.static_bytes + step.head_bytes + kept
    kept_before, grads = kept, 0
    for i in reversed(range(len(blocks))):
        b = blocks[i]
        kept_before -= chosen[i].kept_bytes
        grads += b.grad_bytes
        extra = max(step.forward_bytes, (step.recompute_bytes if chosen[i].recomputes else step.block_bytes) + grads)
        peak = max(peak, step.static_bytes + extra + kept_before + b.act_bytes)
    return max(peak, step.static_bytes + step.tail_bytes + grads)


def _make_plan(blocks: Sequence[BlockCost], step: StepCost, checkpoint: Sequence[bool], method: str) -> CheckpointPlan:
    return _plan_of_options(blocks, step, [_flag_option(b, c) for b, c in zip(blocks, checkpoint)], method)


def _plan_of_options(blocks: Sequence[BlockCost], step: StepCost, chosen: Sequence[BlockOption],
                     method: str) -> CheckpointPlan:
    peak = peak_of_options(blocks, step, chosen)
    modes = tuple(o.mode for o in chosen)
    return CheckpointPlan(
        checkpoint=tuple(o.recomputes for o in chosen),
        predicted_peak_bytes=peak,
        recompute_s=sum(o.cost_s for o in chosen),
        fits=peak <= step.budget_bytes,
        method=method,  # type: ignore[arg-type]
        modes=() if set(modes) <= {"keep", "full"} else modes,
    )


def _phase_extra(blocks: Sequence[BlockCost], step: StepCost, i: int, recomputes: bool) -> int:
    """Bytes of block i's forward/backward phases on top of the bytes kept before it."""
    grads = sum(b.grad_bytes for b in blocks[i:])
    extra = max(step.forward_bytes, (step.recompute_bytes if recomputes else step.block_bytes) + grads)
    return step.static_bytes + extra + blocks[i].act_bytes


def _exact_choice(blocks: Sequence[BlockCost], step: StepCost) -> tuple[int, ...] | None:
    """Exact choice of one option per block under every phase of the model, least predicted seconds.

    Blocks are decided in forward order; a state is (bytes kept so far, seconds, option indices).
    Every phase constraint only grows with the bytes kept so far, so a state that keeps more bytes
    for more seconds can never do better and is pruned (a Pareto front). Recomputing block ``j``
    costs ``1 + 1e-9·j`` times its seconds, so ties keep later blocks, and every option that
    recomputes 1e-9 s more, so an option priced like keeping (per-op SAC measured as cheap) loses
    to keeping where both fit. ``None`` when no choice fits.
    """
    budget = step.budget_bytes
    front: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for i, b in enumerate(blocks):
        grown = []
        weight = 1.0 + _TIE_BONUS * i
        rooms = {r: budget - _phase_extra(blocks, step, i, r) for r in (False, True)}
        for k, o in enumerate(b.options()):
            if o.kept_bytes < 0:
                continue
            room = rooms[o.recomputes]
            cost = o.cost_s * weight + (_RECOMPUTE_TIE if o.recomputes else 0.0)
            grown += [(w + o.kept_bytes, c + cost, ks + (k,)) for w, c, ks in front if w <= room]
        grown.sort(key=lambda s: (s[0], s[1]))
        front, best = [], math.inf
        for state in grown:
            if state[1] < best:
                front.append(state)
                best = state[1]
    tail = step.static_bytes + step.tail_bytes + sum(b.grad_bytes for b in blocks)
    head_cap = budget - step.static_bytes - step.head_bytes
    feasible = [s for s in front if s[0] <= head_cap and tail <= budget]
    return min(feasible, key=lambda s: s[1])[2] if feasible else None


def plan_knapsack(blocks: Sequence[BlockCost], step: StepCost) -> CheckpointPlan:
    """The plan of least predicted seconds (recompute, transfers) while every predicted phase fits the budget."""
    n = len(blocks)
    choice = _exact_choice(blocks, step)
    if choice is None:
        return _make_plan(blocks, step, [True] * n, "all")
    chosen = [b.options()[k] for b, k in zip(blocks, choice)]
    return _plan_of_options(blocks, step, chosen, "none" if all(k == 0 for k in choice) else "knapsack")


def plan_greedy(blocks: Sequence[BlockCost], step: StepCost) -> CheckpointPlan:
    """Mimose's greedy baseline: checkpoint blocks by bytes freed per recompute second until it fits."""
    n = len(blocks)
    checkpoint = [False] * n
    order = sorted(range(n), key=lambda j: (-blocks[j].act_bytes / max(blocks[j].recompute_s, 1e-12), j))
    for j in order:
        if predicted_peak(blocks, step, checkpoint) <= step.budget_bytes:
            break
        checkpoint[j] = True
    plan = _make_plan(blocks, step, checkpoint, "greedy" if any(checkpoint) else "none")
    return plan if plan.fits or all(checkpoint) else _make_plan(blocks, step, [True] * n, "all")


def size_bucket(size: int) -> tuple[int, int]:
    """The geometric bucket of ``size``: (index, upper edge). Plans are made for the upper edge."""
    if size <= 1:
        return 0, 1
    index = math.ceil(math.log2(size) * BUCKETS_PER_OCTAVE - 1e-9)
    return index, max(size, math.ceil(2 ** (index / BUCKETS_PER_OCTAVE)))


@dataclass(kw_only=True)
class PlanCache:
    """Plans per (size bucket, static-bytes MiB, predictor version); cleared when predictors change."""

    plans: dict[tuple[int, int, int, bool], CheckpointPlan] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def get(self, key: tuple[int, int, int, bool]) -> CheckpointPlan | None:
        plan = self.plans.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
        return plan

    def put(self, key: tuple[int, int, int, bool], plan: CheckpointPlan) -> None:
        self.plans[key] = plan
