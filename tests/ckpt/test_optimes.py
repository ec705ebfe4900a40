"""Measured option prices (per block, relative to keeping) and whole-step arms."""

from __future__ import annotations

import pytest
import torch

from memplan.ckpt.explore import StepArms, step_clock
from memplan.ckpt.optimes import OptionTimes


def test_an_option_is_priced_by_its_ratio_to_the_blocks_kept_in_the_same_step() -> None:
    times = OptionTimes()
    assert times.observe(1000, ["keep", "keep", "sac0", "full"], [1.0, 1.2, 1.5, None])
    assert times.ratio("sac0", 1000) == pytest.approx(1.5 / 1.1)
    assert not times.informed("full", 1000)  # not measured: the prior stands
    assert times.cost("full", 1000, kept_s=2.0, prior_s=0.7) == 0.7
    assert times.cost("sac0", 1000, kept_s=2.0, prior_s=0.1) == pytest.approx((1.5 / 1.1 - 1) * 2.0)
    # measured within an octave only
    assert times.ratio("sac0", 1900) is not None and times.ratio("sac0", 2100) is None


def test_a_step_without_kept_blocks_is_compared_with_kept_seconds_scaled_by_size() -> None:
    times = OptionTimes()
    times.observe(1000, ["keep"] * 2, [1.0, 1.0])
    assert times.observe(1500, ["full", "full"], [1.8, 1.8])
    assert times.ratio("full", 1500) == pytest.approx(1.8 / 1.5)
    assert times.kept_seconds(5000) is None and not times.observe(5000, ["full"], [9.0])


def test_faster_option_gets_a_negative_price() -> None:
    times = OptionTimes()
    times.observe(4000, ["keep", "sac0"], [2.0, 1.6])
    assert times.cost("sac0", 4000, kept_s=2.0, prior_s=0.5) == pytest.approx(-0.4)


def test_arms_explore_each_once_near_a_size_then_run_the_faster() -> None:
    arms = StepArms()
    assert arms.pick(1000) == "plan"
    arms.observe("plan", 1000, 3.0)
    assert arms.pick(1000) == "compute"
    arms.observe("compute", 1200, 2.5)
    assert arms.pick(1100) == "compute"
    assert arms.pick(4000) == "plan"  # nothing measured near 4,000 yet
    arms.observe("plan", 900, 1.0)
    assert arms.pick(1000) == "plan"  # median of the plan's (1.0, 3.0) = 2.0 < 2.5


def test_steps_are_timed_in_cpu_seconds_on_cpu() -> None:
    import time

    assert step_clock(torch.device("cpu")) is time.process_time
    assert step_clock(torch.device("meta")) is time.perf_counter


def test_a_seeded_controller_explores_the_compute_arm_once_then_runs_the_faster_arm() -> None:
    from ckpt_helpers import tiny_gpt2, tokens

    from memplan.ckpt import auto_checkpoint

    model = auto_checkpoint(tiny_gpt2(), 512 * 2**20, step_arms=True)
    ctl = model.memplan_ckpt
    ctl.seed([lambda n=n: model(input_ids=(ids := torch.randint(0, 256, (2, n))), labels=ids).loss.backward()
              for n in (8, 32, 128)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(n: int) -> tuple[str, ...]:
        batch = tokens(n)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert ctl.last is not None
        plan = ctl.last[1]
        return tuple(plan.mode(j) for j in range(ctl.n_blocks))

    assert train(64) == ("keep",) * ctl.n_blocks  # the plan's arm first: nothing to fit, everything kept
    assert train(64) == ("sac0",) * ctl.n_blocks  # then the compute-bound arm, once
    assert ctl.stats().explored_steps == 1
    assert set(ctl.arms.seen) == {"plan", "compute"}
    ctl.arms.seen["compute"] = [(128, 1e-9)]  # say the compute arm was measured far faster here
    assert train(64) == ("sac0",) * ctl.n_blocks
    ctl.arms.seen["compute"] = [(128, 1e9)]  # and far slower
    assert train(64) == ("keep",) * ctl.n_blocks
    assert ctl.stats().explored_steps == 1
    assert ctl.stats().metered_steps < ctl.stats().steps  # far below the budget: steps ran unmetered


def test_without_step_arms_every_step_runs_the_plan() -> None:
    from ckpt_helpers import tiny_gpt2, tokens

    from memplan.ckpt import auto_checkpoint

    model = auto_checkpoint(tiny_gpt2(), 512 * 2**20, step_arms=False)
    ctl = model.memplan_ckpt
    ctl.seed([lambda n=n: model(input_ids=(ids := torch.randint(0, 256, (2, n))), labels=ids).loss.backward()
              for n in (8, 32, 128)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(4):
        batch = tokens(64)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert ctl.stats().explored_steps == 0
    assert not ctl.arms.seen


def _seeded(step_arms: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from ckpt_helpers import tiny_gpt2

    from memplan.ckpt import auto_checkpoint

    model = auto_checkpoint(tiny_gpt2(), 512 * 2**20, step_arms=step_arms)
    model.memplan_ckpt.seed([lambda n=n: model(input_ids=(ids := torch.randint(0, 256, (2, n))),
                                                labels=ids).loss.backward() for n in (8, 32, 128)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _modes_of_step(model: torch.nn.Module, opt: torch.optim.Optimizer, length: int) -> set[str]:
    from ckpt_helpers import tokens

    batch = tokens(length)
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ctl = model.memplan_ckpt
    assert ctl.last is not None
    return {ctl.last[1].mode(j) for j in range(ctl.n_blocks)}


def test_per_op_sac_is_chosen_per_size_where_it_was_measured_faster() -> None:
    """SAC on every block is a candidate plan priced per size: chosen where measured faster, keep elsewhere."""
    model, opt = _seeded()
    ctl = model.memplan_ckpt
    assert ctl.step_arms  # on by default
    # 2 x 64 = 128 and 2 x 256 = 512 tokens are two doublings apart: priced separately
    ctl.arms.seen = {"plan": [(128, 2.0), (512, 1.0)], "compute": [(128, 1.0), (512, 2.0)]}
    assert _modes_of_step(model, opt, 64) == {"sac0"}
    assert _modes_of_step(model, opt, 256) == {"keep"}
    ctl.arms.seen = {"plan": [(128, 1.0), (512, 2.0)], "compute": [(128, 2.0), (512, 1.0)]}
    assert _modes_of_step(model, opt, 64) == {"keep"}
    assert _modes_of_step(model, opt, 256) == {"sac0"}
    assert ctl.stats().explored_steps == 0  # both arms were measured near both sizes: nothing explored


def test_a_near_tie_goes_to_the_plan_and_real_steps_price_both_arms() -> None:
    from memplan.ckpt.explore import PREFER_PLAN

    model, opt = _seeded()
    ctl = model.memplan_ckpt
    assert _modes_of_step(model, opt, 64) == {"keep"}  # first the plan, timed
    assert _modes_of_step(model, opt, 64) == {"sac0"}  # then SAC once, timed
    plan, compute = ctl.arms.median("plan", 128), ctl.arms.median("compute", 128)
    assert plan is not None and compute is not None and plan > 0 and compute > 0  # measured, not assumed
    ctl.arms.seen = {"plan": [(128, 1.0)], "compute": [(128, 1.0 - PREFER_PLAN / 2)]}
    assert _modes_of_step(model, opt, 64) == {"keep"}  # SAC faster by less than the margin: keep
    ctl.arms.seen = {"plan": [(128, 1.0)], "compute": [(128, 1.0 - 2 * PREFER_PLAN)]}
    assert _modes_of_step(model, opt, 64) == {"sac0"}


def test_an_arm_is_priced_by_its_measurements_nearest_the_size() -> None:
    arms = StepArms()
    for size, value in ((100, 9.0), (110, 9.0), (180, 1.0), (190, 1.0), (200, 1.0)):
        arms.observe("plan", size, value)
    assert arms.median("plan", 190) == 1.0  # the three nearest, not the two far ones
    assert arms.median("plan", 100) == 9.0


def test_sac_is_not_explored_below_a_size_where_it_already_lost() -> None:
    arms = StepArms()
    arms.observe("plan", 4000, 1.0)
    arms.observe("compute", 4000, 1.5)  # measured slower at 4,000
    arms.observe("plan", 500, 1.0)
    assert arms.pick(500) == "plan"  # smaller: not explored
    arms.observe("plan", 30000, 1.0)
    assert arms.pick(30000) == "compute"  # larger: still explored once
    arms.seen["compute"] = [(4000, 0.5)]  # had it won at 4,000, smaller sizes would be explored
    assert arms.pick(500) == "compute"
