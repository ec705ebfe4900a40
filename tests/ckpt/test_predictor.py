"""Quadratic fits: exact on polynomial data, the simplest degree first, never under the points."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.ckpt.predictor import SizeSeries, fit_quadratic


def test_recovers_an_exact_parabola_and_accepts_it() -> None:
    sizes = [64, 128, 256, 512, 1024]
    values = [1000 + 30 * s + 0.5 * s * s for s in sizes]
    fit = fit_quadratic(sizes, values)
    assert fit.accepted
    assert fit(2048) == pytest.approx(1000 + 30 * 2048 + 0.5 * 2048**2, rel=1e-9)


def test_prefers_a_line_when_a_line_fits() -> None:
    fit = fit_quadratic([8, 16, 24, 32], [100.0, 200.0, 300.0, 401.0])
    assert fit.accepted
    assert fit.coeffs[2] == 0.0


def test_two_points_fit_a_line_through_the_origin_and_three_need_a_spare_point() -> None:
    assert fit_quadratic([10, 20], [100.0, 200.0]).accepted
    assert not fit_quadratic([10], [100.0]).accepted  # no degree of freedom left to check it


def test_noisy_points_are_not_accepted() -> None:
    fit = fit_quadratic([1, 2, 3, 4, 5], [10.0, 50.0, 5.0, 80.0, 1.0])
    assert not fit.accepted
    assert fit.max_rel_error > 0.05


def test_floor_judges_near_zero_residuals_absolutely() -> None:
    values = [300.0, -100.0, 50.0, 200.0]
    assert not fit_quadratic([8, 16, 24, 32], values).accepted
    assert fit_quadratic([8, 16, 24, 32], values, floor=100_000.0).accepted


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.floats(0, 1e9)), min_size=1, max_size=8,
                unique_by=lambda p: p[0]))
def test_prediction_is_never_below_a_measured_point(points: list[tuple[int, float]]) -> None:
    sizes, values = zip(*points)
    fit = fit_quadratic(list(sizes), list(values))
    for s, v in points:
        assert fit(s) >= v - 1e-6 * max(1.0, v)


def test_series_keeps_the_largest_memory_value_and_refits_on_news() -> None:
    series = SizeSeries(keep="max")
    assert series.add(10, 100.0)
    assert not series.add(10, 90.0)
    assert series.add(10, 120.0)
    assert series.points == {10: 120.0}
    assert series(10) == pytest.approx(120.0)


def test_time_series_averages_repeated_sizes() -> None:
    series = SizeSeries(keep="mean")
    series.add(10, 1.0)
    series.add(10, 3.0)
    assert series.points[10] == pytest.approx(2.0)
