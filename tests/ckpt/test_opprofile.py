"""Per-op profiles, selective-checkpoint levels and contexts, offload hooks, option planning."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.ckpt.offload import OffloadHooks, offload_seconds
from memplan.ckpt.opprofile import OpRecorder, Roofline, roofline_for, sac_context, sac_levels
from memplan.ckpt.planner import BlockCost, BlockOption, StepCost, peak_of_options, plan_knapsack

aten = torch.ops.aten


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def test_the_recorder_counts_flops_bytes_and_what_backward_saves() -> None:
    mlp = _Mlp()
    x = torch.randn(8, 16, requires_grad=True)
    with OpRecorder() as rec:
        mlp(x)
    ops = {op.key: op for op in rec.records()}
    up = ops[(aten.addmm.default, 0)]
    assert up.flops == 2 * 8 * 16 * 64 and up.out_bytes == 8 * 64 * 4 and up.saved  # gelu saves its input
    down = ops[(aten.addmm.default, 1)]
    assert not down.saved  # the residual add saves nothing
    assert ops[(aten.gelu.default, 0)].saved  # the second matmul saves gelu's output


def test_levels_save_what_is_dearest_to_recompute_per_byte() -> None:
    mlp = _Mlp()
    x = torch.randn(64, 16, requires_grad=True)
    with OpRecorder() as rec:
        mlp(x)
    roof = Roofline(flops_per_s=1e9, bytes_per_s=1e12, overhead_s=0.0)  # FLOPs dominate
    levels = sac_levels(rec.records(), roof, shares=(0.4,))
    # the first matmul's output: half the recompute seconds for half the bytes backward saves
    assert len(levels) == 1 and levels[0].keys == {(aten.addmm.default, 0)}
    assert levels[0].saved_bytes == 64 * 64 * 4
    assert roofline_for(torch.device("cpu")).flops_per_s > 0


class _CountInBackward(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.addmm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is aten.addmm.default and torch._C._current_graph_task_id() >= 0:
            self.addmm += 1
        return func(*args, **(kwargs or {}))


def test_a_selective_context_keeps_the_gradients_and_skips_saved_ops_in_recompute() -> None:
    from torch.utils.checkpoint import checkpoint

    mlp = _Mlp()
    x = torch.randn(8, 16, requires_grad=True)
    mlp(x).sum().backward()
    want = [p.grad.clone() for p in mlp.parameters()]
    counts = {}
    for name, context in (("full", None), ("sac", sac_context(frozenset({(aten.addmm.default, 0)})))):
        mlp.zero_grad()
        with _CountInBackward() as counter:
            out = checkpoint(mlp, x, use_reentrant=False, **({"context_fn": context} if context else {}))
            out.sum().backward()
        assert all(torch.allclose(p.grad, w) for p, w in zip(mlp.parameters(), want))
        counts[name] = counter.addmm
    # the selective recompute runs the first matmul no more (its output was saved); the second one
    # is not recomputed either way (backward saves nothing of its output), so one addmm less
    assert counts["full"] - counts["sac"] == 1


def test_offload_hooks_keep_values_and_gradients_on_cpu() -> None:
    mlp = _Mlp()
    x = torch.randn(64, 16, requires_grad=True)
    mlp(x).sum().backward()
    want = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    hooks = OffloadHooks(torch.device("cpu"), min_bytes=1024)
    with hooks:
        out = mlp(x)
    out.sum().backward()
    assert hooks.offloaded_bytes >= 64 * 64 * 4
    assert all(torch.equal(p.grad, w) for p, w in zip(mlp.parameters(), want))
    assert offload_seconds(torch.device("cpu"), 10**9, 0.0) is None  # frees nothing on a CPU
    assert offload_seconds(torch.device("cuda"), 10**9, 0.01) == pytest.approx(2 * 10**9 / 20e9 - 0.01)


def _step(budget: int) -> StepCost:
    return StepCost(static_bytes=100, forward_bytes=5, head_bytes=20, block_bytes=3, recompute_bytes=4,
                    tail_bytes=10, budget_bytes=budget)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5), budget=st.integers(150, 800), data=st.data())
def test_option_planning_is_exact(n: int, budget: int, data: st.DataObject) -> None:
    blocks = []
    for _ in range(n):
        act = data.draw(st.integers(10, 100))
        sac = data.draw(st.integers(0, act))
        blocks.append(BlockCost(act_bytes=act, grad_bytes=data.draw(st.integers(0, 5)), recompute_s=1.0,
                                extra=(BlockOption(mode="sac0", kept_bytes=sac,
                                                   cost_s=data.draw(st.floats(0.05, 0.95)), recomputes=True),)))
    step = _step(budget)
    best = None
    for choice in itertools.product(range(3), repeat=n):
        chosen = [b.options()[k] for b, k in zip(blocks, choice)]
        if peak_of_options(blocks, step, chosen) <= budget:
            cost = sum(o.cost_s for o in chosen)
            best = cost if best is None else min(best, cost)
    plan = plan_knapsack(blocks, step)
    if best is None:
        assert not plan.fits or plan.method == "all"
    else:
        assert plan.fits and plan.recompute_s == pytest.approx(best, rel=1e-6)
        assert plan.predicted_peak_bytes <= budget
