"""Measured seconds of each way to run a block, relative to keeping it: the planner's time correction.

The op profile prices an option by a roofline (:mod:`memplan.ckpt.opcosts`): keeping a block costs
nothing, a recompute costs the FLOPs and bytes of the ops it reruns. Real machines disagree in ways
a roofline does not see (on the benchmark's CPU the roofline priced a selective recompute at a
third of what it measured). Only measuring tells.

Every training step measures each block's own seconds — its forward (the controller's patched
``forward``) plus its backward (between the gradient hooks on its output and on its input,
recomputation included) — so a step whose plan mixes options measures them side by side, under the
same load. :class:`OptionTimes` keeps, per option, the ratio of its median block seconds to the
median seconds of the blocks *kept* in the same step (or, when none was kept, to the kept seconds
measured at the nearest size, scaled by size), against the step's size. The planner's cost of an
option at a size is then ``(ratio - 1) x`` the block's kept seconds there (negative when the option
is faster than keeping), from the ratios measured within :data:`NEAR_OCTAVES` of the size; the
roofline's price stands where nothing was measured near.

Options the planner never chooses are never measured here; whole-step arms
(:mod:`memplan.ckpt.explore`) cover what a per-block clock cannot see.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["NEAR_OCTAVES", "OptionTimes", "near"]

#: Ratios measured within this many doublings of a size price an option at that size.
NEAR_OCTAVES = 1.0


def near(a: int, b: int) -> bool:
    """Whether sizes ``a`` and ``b`` are within :data:`NEAR_OCTAVES` doublings of each other."""
    return a > 0 and b > 0 and abs(math.log2(a / b)) <= NEAR_OCTAVES


@dataclass(kw_only=True)
class OptionTimes:
    """Per option: (size, seconds / kept seconds) measured in real steps; kept seconds per size."""

    ratios: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    kept: list[tuple[int, float]] = field(default_factory=list)

    def observe(self, size: int, modes: Sequence[str], seconds: Sequence[float | None]) -> bool:
        """One step's per-block seconds (``None``: not measured) under ``modes``; True when a ratio was added."""
        by_mode: dict[str, list[float]] = {}
        for mode, s in zip(modes, seconds):
            if s is not None and s > 0:
                by_mode.setdefault(mode, []).append(s)
        keep = by_mode.pop("keep", None)
        if keep:
            self.kept.append((size, statistics.median(keep)))
            reference: float | None = self.kept[-1][1]
        else:
            reference = self.kept_seconds(size)
        if reference is None or not by_mode:
            return False
        for mode, values in by_mode.items():
            self.ratios.setdefault(mode, []).append((size, statistics.median(values) / reference))
        return True

    def kept_seconds(self, size: int) -> float | None:
        """Seconds of a kept block at ``size``: the nearest measured size's, scaled by size (None: none near)."""
        close = [(abs(math.log2(size / s)), s, t) for s, t in self.kept if near(size, s)]
        if not close:
            return None
        _, s, t = min(close)
        return t * size / s

    def ratio(self, mode: str, size: int) -> float | None:
        """Median measured ratio of ``mode`` near ``size`` (None: not measured near)."""
        close = [r for s, r in self.ratios.get(mode, ()) if near(size, s)]
        return statistics.median(close) if close else None

    def informed(self, mode: str, size: int) -> bool:
        """Whether ``mode`` was measured near ``size`` (keep always is: it is the reference)."""
        return mode == "keep" or self.ratio(mode, size) is not None

    def cost(self, mode: str, size: int, kept_s: float, prior_s: float) -> float:
        """Extra seconds of ``mode`` over keeping the block at ``size``: measured where near, else ``prior_s``."""
        r = self.ratio(mode, size)
        return prior_s if r is None else (r - 1.0) * kept_s
