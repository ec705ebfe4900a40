"""Per-block predictors: quadratic fits of measured bytes (and seconds) against the input size.

Every quantity the planner needs is a function of the batch's input size ``s`` (tokens by default):
a block's activation bytes and forward time, and the non-block memory at each phase of the step.
Each is measured at a few sizes and fitted with ``c0 + c1·s + c2·s²`` (numpy least squares): the
linear terms are hidden states and MLP buffers, the quadratic one is attention scores when the
attention kernel keeps them. The simplest polynomial that fits is used (a line before a parabola:
a parabola through a few noisy residuals extrapolates wildly). A fit is *accepted* when its largest
relative error on the measured points is within a threshold, and it always leaves one degree of
freedom for that check. Predictions are shifted up by the largest under-prediction seen, so a fit
never predicts less than it measured.

Known limitation: extrapolating far above the largest measured size trusts the polynomial form;
the runtime's safety net catches a wrong extrapolation and feeds the measurement back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DEFAULT_ERROR_THRESHOLD", "QuadraticFit", "SizeSeries", "fit_quadratic"]

#: Largest relative error on the measured points for a fit to be accepted.
DEFAULT_ERROR_THRESHOLD = 0.05


@dataclass(frozen=True, kw_only=True)
class QuadraticFit:
    """``value(s) = c0 + c1·s + c2·s² + offset`` fitted to measurements."""

    #: Coefficients c0, c1, c2 (unused ones are 0).
    coeffs: tuple[float, float, float]
    #: Added to every prediction: the largest under-prediction on the measured points (>= 0).
    offset: float
    #: Largest error |fit - measured| relative to max(|measured|, mean |measured|) (0 when exact).
    max_rel_error: float
    #: Number of distinct sizes fitted.
    n_points: int
    #: Whether ``max_rel_error`` is within the threshold and there was a degree of freedom to check it.
    accepted: bool

    def __call__(self, size: float) -> float:
        c0, c1, c2 = self.coeffs
        return max(0.0, c0 + c1 * size + c2 * size * size + self.offset)

    def to_dict(self) -> dict[str, object]:
        return {
            "coeffs": list(self.coeffs),
            "offset": self.offset,
            "max_rel_error": self.max_rel_error,
            "n_points": self.n_points,
            "accepted": self.accepted,
        }


def _design(sizes: np.ndarray, degree: int, through_origin: bool) -> np.ndarray:
    cols = [sizes**k for k in range(0 if not through_origin else 1, degree + 1)]
    return np.stack(cols, axis=1)


def _fit_degree(s: np.ndarray, v: np.ndarray, degree: int, through_origin: bool, threshold: float,
                floor: float) -> QuadraticFit:
    scale = float(s.max()) or 1.0  # conditioning: fit on s / scale
    sol, *_ = np.linalg.lstsq(_design(s / scale, degree, through_origin), v, rcond=None)
    full = np.zeros(3)
    for k, c in zip(range(1 if through_origin else 0, degree + 1), sol):
        full[k] = c / scale**k
    resid = v - (full[0] + full[1] * s + full[2] * s * s)
    denom = np.maximum(np.abs(v), max(float(np.mean(np.abs(v))), floor, 1.0))
    rel = float(np.max(np.abs(resid) / denom))
    dof = len(s) - (degree + (0 if through_origin else 1))
    return QuadraticFit(
        coeffs=(float(full[0]), float(full[1]), float(full[2])),
        offset=float(max(0.0, resid.max())),
        max_rel_error=rel,
        n_points=len(s),
        accepted=dof >= 1 and rel <= threshold,
    )


def fit_quadratic(
    sizes: Sequence[float],
    values: Sequence[float],
    *,
    threshold: float = DEFAULT_ERROR_THRESHOLD,
    floor: float = 0.0,
) -> QuadraticFit:
    """The simplest polynomial (degree <= 2) that fits ``values`` against ``sizes`` within ``threshold``.

    Candidates, simplest first, each keeping a degree of freedom to check it: a line through the
    origin (1-2 points), a line (3+ points), a parabola (4+ points). The first accepted one wins;
    if none is, the most flexible one is returned, not accepted. Errors are relative to
    ``max(|value|, mean |value|, floor)``: ``floor`` gives quantities that hover around zero
    (residual terms) a scale to be judged on.
    """
    if len(sizes) != len(values) or not sizes:
        raise ValueError("fit_quadratic needs as many values as sizes, at least one")
    s = np.asarray(sizes, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    n = len(s)
    candidates = [(1, True)] if n <= 2 else [(1, False)] + ([(2, False)] if n >= 4 else [])
    fit = _fit_degree(s, v, *candidates[0], threshold, floor)
    for degree, origin in candidates[1:]:
        if fit.accepted:
            break
        fit = _fit_degree(s, v, degree, origin, threshold, floor)
    return fit


@dataclass(kw_only=True)
class SizeSeries:
    """Measurements of one quantity at distinct sizes, refitted lazily when a new size arrives.

    Repeated measurements at one size keep the largest value (memory: conservative) unless
    ``keep="mean"`` (times).
    """

    keep: str = "max"
    threshold: float = DEFAULT_ERROR_THRESHOLD
    #: Scale below which errors are judged absolutely (see :func:`fit_quadratic`).
    floor: float = 0.0
    #: Distinct sizes needed before the fit can be accepted.
    min_points: int = 2
    points: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    _fit: QuadraticFit | None = None

    def add(self, size: int, value: float) -> bool:
        """Record a measurement; return True when the fit changed materially (new size or new max)."""
        old = self.points.get(size)
        if old is None:
            self.points[size], self.counts[size] = float(value), 1
            self._fit = None
            return True
        if self.keep == "mean":
            n = self.counts[size]
            self.points[size] = (old * n + value) / (n + 1)
            self.counts[size] = n + 1
            return False
        if value > old:
            self.points[size] = float(value)
            self._fit = None
            return True
        return False

    @property
    def fit(self) -> QuadraticFit | None:
        """The current fit (None before any measurement)."""
        if self._fit is None and self.points:
            sizes = sorted(self.points)
            self._fit = fit_quadratic(sizes, [self.points[s] for s in sizes], threshold=self.threshold,
                                      floor=self.floor)
        return self._fit

    @property
    def accepted(self) -> bool:
        f = self.fit
        return f is not None and f.accepted and len(self.points) >= self.min_points

    def __call__(self, size: float) -> float:
        """The fit at ``size``, never below a value measured at a smaller or equal size.

        Memory and time do not shrink as inputs grow; a fit sloping down over a few small sizes
        (where constant buffers dominate) must not extrapolate below what was already seen.
        """
        f = self.fit
        if f is None:
            raise LookupError("no measurement yet")
        seen = max((v for s, v in self.points.items() if s <= size), default=0.0)
        return max(f(size), seen)

    @property
    def largest_size(self) -> int:
        """The largest size measured (0 before any measurement)."""
        return max(self.points, default=0)
