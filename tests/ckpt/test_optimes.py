"""Measured option prices: per block relative to keeping, and per-op SAC's from whole steps."""

from __future__ import annotations

import pytest
import torch

from memplan.ckpt.explore import sac_share, step_clock
from memplan.ckpt.optimes import OptionTimes, StepPrices


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


def test_sac_is_priced_by_the_step_difference_per_share_of_blocks_under_it() -> None:
    prices = StepPrices()
    assert prices.ratio(1000) is None
    prices.observe(1000, 0.0, 2.0)
    prices.observe(1100, 0.0, 2.2)
    assert prices.ratio(1000) is None and not prices.measured(1000)  # no step with SAC blocks yet
    assert prices.observe(1000, 1.0, 2.8)  # every block under SAC: 0.7 per roofline second over the baseline
    assert prices.ratio(1000) == pytest.approx(0.7)
    prices.observe(1050, 0.25, 2.3)  # a quarter of the blocks: (2.3 - 2.1) / 0.25 = 0.8
    assert prices.ratio(1000) == pytest.approx(0.75)
    assert prices.ratio(2300) is None and prices.measured(1900)  # within an octave only


def test_sac_measured_faster_than_keeping_is_priced_as_keeping() -> None:
    prices = StepPrices()
    prices.observe(4000, 0.0, 2.0)
    prices.observe(4000, 1.0, 1.5)
    assert prices.ratio(4000) == 0.0


def test_whole_step_prices_use_the_measurements_nearest_the_size() -> None:
    prices = StepPrices()
    for size, value in ((100, 9.0), (110, 9.0), (180, 1.0), (190, 1.0), (200, 1.0)):
        prices.observe(size, 0.0, value)
    prices.observe(190, 1.0, 1.5)
    assert prices.ratio(190) == pytest.approx(0.5)  # the three nearest baselines, not the two far ones


def test_the_sac_share_is_the_roofline_share_of_the_blocks_under_level_0() -> None:
    assert sac_share(("keep", "sac0", "keep", "sac0"), (1.0, 1.0, 1.0, 2.0)) == pytest.approx(0.6)
    assert sac_share(("keep", "keep"), (1.0, 1.0)) == 0.0  # a baseline step
    # a block recomputed whole, at another level or offloaded: its cost has no term in the model, no sample
    for other in ("full", "sac1", "offload"):
        assert sac_share((other, "sac0"), (1.0, 1.0)) is None


def test_steps_are_timed_in_cpu_seconds_on_cpu() -> None:
    import time

    assert step_clock(torch.device("cpu")) is time.process_time
    assert step_clock(torch.device("meta")) is time.perf_counter
