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
every phase constraint grows with the bytes kept before it. Ties go to keeping later blocks. :func:`plan_greedy` is
Mimose's greedy (checkpoint the blocks freeing most bytes per recompute second first) for
comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "BlockCost", "CheckpointPlan", "PlanCache", "StepCost", "plan_greedy", "plan_knapsack", "predicted_peak",
    "size_bucket",
]

#: Values of blocks later in the forward get this relative bonus, so that ties keep later blocks.
_TIE_BONUS = 1e-9
#: Plans are cached per geometric size bucket of this many buckets per doubling of the size.
BUCKETS_PER_OCTAVE = 16


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """What one block costs for this batch (predicted)."""

    #: Activation bytes the block keeps for backward that checkpointing would drop.
    act_bytes: int
    #: Gradient bytes allocated during this block's backward (0 when gradients already exist).
    grad_bytes: int
    #: Seconds of one extra forward of the block (the recompute cost).
    recompute_s: float


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

    @property
    def n_checkpointed(self) -> int:
        return sum(self.checkpoint)


def predicted_peak(blocks: Sequence[BlockCost], step: StepCost, checkpoint: Sequence[bool]) -> int:
    """The largest phase of the step's memory model for this plan (bytes)."""
    kept = sum(b.act_bytes for b, c in zip(blocks, checkpoint) if not c)
    peak = step.static_bytes + step.head_bytes + kept
    kept_before, grads = kept, 0
    for i in reversed(range(len(blocks))):
        b = blocks[i]
        if not checkpoint[i]:
            kept_before -= b.act_bytes
        grads += b.grad_bytes
        extra = max(step.forward_bytes, (step.recompute_bytes if checkpoint[i] else step.block_bytes) + grads)
        peak = max(peak, step.static_bytes + extra + kept_before + b.act_bytes)
    return max(peak, step.static_bytes + step.tail_bytes + grads)


def _make_plan(blocks: Sequence[BlockCost], step: StepCost, checkpoint: Sequence[bool], method: str) -> CheckpointPlan:
    peak = predicted_peak(blocks, step, checkpoint)
    return CheckpointPlan(
        checkpoint=tuple(bool(c) for c in checkpoint),
        predicted_peak_bytes=peak,
        recompute_s=sum(b.recompute_s for b, c in zip(blocks, checkpoint) if c),
        fits=peak <= step.budget_bytes,
        method=method,  # type: ignore[arg-type]
    )


def _phase_extra(blocks: Sequence[BlockCost], step: StepCost, i: int, checkpointed: bool) -> int:
    """Bytes of block i's forward/backward phases on top of the kept activations before it."""
    grads = sum(b.grad_bytes for b in blocks[i:])
    extra = max(step.forward_bytes, (step.recompute_bytes if checkpointed else step.block_bytes) + grads)
    return step.static_bytes + extra + blocks[i].act_bytes


def _exact_keep_mask(blocks: Sequence[BlockCost], step: StepCost, values: Sequence[float]) -> int | None:
    """Exact 0/1 knapsack under every phase of the model: the kept-set bitmask of largest value.

    Blocks are decided in forward order; a state is (kept activation bytes so far, value, mask).
    Every phase constraint only grows with the bytes kept so far, so a state that keeps more bytes
    for less value can never do better and is pruned (a Pareto front: N + 1 states for identical
    blocks). ``None`` when no plan fits.
    """
    budget = step.budget_bytes
    front: list[tuple[int, float, int]] = [(0, 0.0, 0)]
    for i, b in enumerate(blocks):
        grown: list[tuple[int, float, int]] = []
        for w, v, m in front:
            if w + _phase_extra(blocks, step, i, True) <= budget:
                grown.append((w, v, m))
            if w + _phase_extra(blocks, step, i, False) <= budget:
                grown.append((w + b.act_bytes, v + values[i], m | (1 << i)))
        grown.sort(key=lambda s: (s[0], -s[1]))
        front, best = [], -math.inf
        for state in grown:
            if state[1] > best:
                front.append(state)
                best = state[1]
    tail = step.static_bytes + step.tail_bytes + sum(b.grad_bytes for b in blocks)
    head_cap = budget - step.static_bytes - step.head_bytes
    feasible = [s for s in front if s[0] <= head_cap and tail <= budget]
    return max(feasible, key=lambda s: s[1])[2] if feasible else None


def plan_knapsack(blocks: Sequence[BlockCost], step: StepCost) -> CheckpointPlan:
    """The plan that recomputes least (predicted seconds) while every predicted phase fits the budget."""
    n = len(blocks)
    values = [max(b.recompute_s, 1e-12) * (1.0 + _TIE_BONUS * j) for j, b in enumerate(blocks)]
    mask = _exact_keep_mask(blocks, step, values)
    if mask is None:
        return _make_plan(blocks, step, [True] * n, "all")
    checkpoint = [not (mask >> j) & 1 for j in range(n)]
    return _make_plan(blocks, step, checkpoint, "knapsack" if any(checkpoint) else "none")


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
