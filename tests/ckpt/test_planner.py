"""The planner: exact knapsack (checked against brute force), greedy baseline, peak model, buckets."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.ckpt.planner import (
    BlockCost,
    BlockOption,
    PlanCache,
    StepCost,
    plan_greedy,
    plan_knapsack,
    predicted_peak,
    size_bucket,
)


def _step(budget: int, *, static: int = 1000, head: int = 0, block: int = 0, tail: int = 0, fwd: int = 0) -> StepCost:
    return StepCost(static_bytes=static, forward_bytes=fwd, head_bytes=head, block_bytes=block,
                    recompute_bytes=block, tail_bytes=tail, budget_bytes=budget)


def test_peak_model_by_hand() -> None:
    blocks = [BlockCost(act_bytes=100, grad_bytes=10, recompute_s=1.0)] * 3
    step = _step(10_000, static=1000, head=50, block=5, tail=7)
    # nothing checkpointed: head phase 1000 + 50 + 300; block 2 phase 1000 + 5 + 10 + 200 + 100
    assert predicted_peak(blocks, step, [False] * 3) == 1350
    # all checkpointed: head 1050; block 0 phase 1000 + 5 + 30 + 0 + 100 = 1135
    assert predicted_peak(blocks, step, [True] * 3) == 1135


def test_nothing_is_checkpointed_when_everything_fits() -> None:
    blocks = [BlockCost(act_bytes=100, grad_bytes=0, recompute_s=1.0)] * 4
    plan = plan_knapsack(blocks, _step(10_000))
    assert plan.checkpoint == (False,) * 4 and plan.fits


def test_identical_blocks_keep_the_later_ones() -> None:
    blocks = [BlockCost(act_bytes=100, grad_bytes=0, recompute_s=1.0)] * 4
    plan = plan_knapsack(blocks, _step(1000 + 250))
    assert plan.checkpoint == (True, True, False, False)
    assert plan.predicted_peak_bytes <= 1250


def test_an_option_priced_like_keeping_loses_to_keeping_and_sheds_only_where_needed() -> None:
    sac = BlockOption(mode="sac0", kept_bytes=40, cost_s=0.0, recomputes=True)  # measured as cheap as keeping
    blocks = [BlockCost(act_bytes=100, grad_bytes=0, recompute_s=1.0, extra=(sac,))] * 4
    assert plan_knapsack(blocks, _step(10_000)).modes == ()  # everything fits: all kept, no recompute
    plan = plan_knapsack(blocks, _step(1000 + 100 * 3 + 40))  # one block must shed 60 bytes
    assert plan.modes == ("sac0", "keep", "keep", "keep") and plan.fits


def test_infeasible_budget_checkpoints_everything_and_says_so() -> None:
    blocks = [BlockCost(act_bytes=100, grad_bytes=0, recompute_s=1.0)] * 2
    plan = plan_knapsack(blocks, _step(1050, head=200))
    assert plan.checkpoint == (True, True) and not plan.fits


def _brute_force(blocks: list[BlockCost], step: StepCost) -> float | None:
    """Least recompute seconds over all 2^N plans whose predicted peak fits (None: none fits)."""
    best = None
    for flags in itertools.product([False, True], repeat=len(blocks)):
        if predicted_peak(blocks, step, flags) <= step.budget_bytes:
            cost = sum(b.recompute_s for b, c in zip(blocks, flags) if c)
            best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100), st.integers(1, 100), st.integers(0, 30)), min_size=1, max_size=8),
       st.integers(0, 600), st.integers(0, 50), st.integers(0, 50))
def test_knapsack_is_exact_against_brute_force(items: list[tuple[int, int, int]], room: int, head: int, block: int) -> None:
    blocks = [BlockCost(act_bytes=a, grad_bytes=g, recompute_s=float(t)) for a, t, g in items]
    step = StepCost(static_bytes=1000, forward_bytes=block // 2, head_bytes=head, block_bytes=block,
                    recompute_bytes=block + 5, tail_bytes=head // 3, budget_bytes=1000 + room)
    plan = plan_knapsack(blocks, step)
    best = _brute_force(blocks, step)
    assert plan.fits == (best is not None)
    if best is not None:
        assert plan.predicted_peak_bytes <= step.budget_bytes
        assert abs(plan.recompute_s - best) < 1e-6 * max(1.0, best)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 500), st.floats(0.01, 5.0)), min_size=1, max_size=8), st.integers(0, 3000))
def test_knapsack_never_recomputes_more_than_greedy_when_both_fit(items: list[tuple[int, float]], budget: int) -> None:
    blocks = [BlockCost(act_bytes=a, grad_bytes=0, recompute_s=t) for a, t in items]
    step = _step(1000 + budget)
    exact, greedy = plan_knapsack(blocks, step), plan_greedy(blocks, step)
    assert exact.fits == greedy.fits or exact.fits
    if exact.fits and greedy.fits:
        assert exact.recompute_s <= greedy.recompute_s * (1 + 1e-6)
    if exact.fits:
        assert exact.predicted_peak_bytes <= step.budget_bytes


def test_greedy_can_be_worse_than_the_exact_plan() -> None:
    # a big slow block first, two small fast ones after it: keeping the two small ones fits
    blocks = [BlockCost(act_bytes=100, grad_bytes=0, recompute_s=10.0),
              BlockCost(act_bytes=60, grad_bytes=0, recompute_s=1.0),
              BlockCost(act_bytes=60, grad_bytes=0, recompute_s=1.0)]
    step = _step(1000 + 125)
    assert plan_knapsack(blocks, step).checkpoint == (True, False, False)
    assert plan_knapsack(blocks, step).recompute_s == 10.0
    assert plan_greedy(blocks, step).recompute_s == 12.0  # frees bytes cheaply first, ends checkpointing all


def test_size_buckets_are_monotone_and_cover_the_size() -> None:
    edges = [size_bucket(s) for s in range(1, 5000)]
    assert all(upper >= s for s, (_, upper) in zip(range(1, 5000), edges))
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(edges))
    assert all(upper <= s * 2 ** (1 / 16) + 1 for s, (_, upper) in zip(range(1, 5000), edges))


def test_plan_cache_counts_hits() -> None:
    cache = PlanCache()
    key = (1, 2, 3, True)
    assert cache.get(key) is None
    plan = plan_knapsack([BlockCost(act_bytes=1, grad_bytes=0, recompute_s=1.0)], _step(10_000))
    cache.put(key, plan)
    assert cache.get(key) is plan and cache.hits == 1 and cache.misses == 1
