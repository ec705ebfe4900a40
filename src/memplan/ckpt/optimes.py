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

Options the planner never chooses are never measured here. What a per-block clock cannot see (on
a CPU, fresh memory faulted in by the head, the loss and the optimizer because blocks were kept) a
whole-step clock can: :class:`StepPrices` prices per-op SAC per block from whole steps
(:mod:`memplan.ckpt.explore` runs the steps that measure it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["CLOSEST", "NEAR_OCTAVES", "OptionTimes", "StepPrices", "near"]

#: Ratios measured within this many doublings of a size price an option at that size.
NEAR_OCTAVES = 1.0
#: A whole-step price at a size uses this many measurements of each kind nearest that size.
CLOSEST = 3


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


@dataclass(kw_only=True)
class StepPrices:
    """Per-op SAC's price per block from whole steps: (size, SAC share, step seconds per roofline second).

    Every planned step records its seconds (process CPU time on CPU, wall time elsewhere; forward
    pre-hook to the end of the backward) over the roofline seconds of the blocks' forwards at its
    size, and the *SAC share*: the roofline share of the blocks it ran under per-op SAC (level 0).
    Only steps whose blocks were all kept or under level 0 are samples (a whole recompute, another
    level or an offload has no term in the model); those with share 0 are the baseline. The model is linear in the
    share: ``t(step) = t(baseline) + r x share``, so one block ``j`` under SAC costs ``r x`` its
    roofline forward seconds — with blocks alike, ``r x roof_j = (t(all SAC) - t(baseline)) /
    blocks`` in seconds, the formula of a step that runs every block under SAC. Near a size (within
    :data:`NEAR_OCTAVES`), ``r`` is the median over the :data:`CLOSEST` nearest SAC steps of
    ``(t - median of the CLOSEST nearest baseline steps) / share``, floored at 0: a block under SAC runs
    every op a kept block runs plus its unsaved ops again, so a step measured faster with SAC is a
    difference the blocks do not own (noise, or a kept step that grew the process's heap and faulted
    its pages in once) and is not a reason to recompute. Memory is bounded: the last :data:`CLOSEST`
    measurements per quarter-octave of size are kept, with and without SAC, so prices follow the run.
    """

    #: (quarter-octave of the size, whether blocks ran under SAC) → the last CLOSEST (size, share, seconds)
    by_bin: dict[tuple[int, bool], list[tuple[int, float, float]]] = field(default_factory=dict)

    @property
    def seen(self) -> list[tuple[int, float, float]]:
        """Every measurement kept (the last :data:`CLOSEST` per quarter-octave of size, with and without SAC)."""
        return [m for ms in self.by_bin.values() for m in ms]

    def observe(self, size: int, sac_share: float, normalised: float) -> bool:
        """One whole step; True when the price near ``size`` changed (plans made from it are stale)."""
        if size <= 0 or normalised <= 0 or not 0.0 <= sac_share <= 1.0:
            return False
        before = self.ratio(size)
        kept = self.by_bin.setdefault((math.floor(4 * math.log2(size)), sac_share > 0), [])
        kept.append((size, sac_share, normalised))
        del kept[:-CLOSEST]
        return self.ratio(size) != before

    def _nearest(self, size: int, with_sac: bool) -> list[tuple[float, float]]:
        close = sorted((abs(math.log2(s / size)), share, v) for s, share, v in self.seen
                       if near(size, s) and (share > 0) == with_sac)
        return [(share, v) for _, share, v in close[:CLOSEST]]

    def measured(self, size: int) -> bool:
        """Whether a step with blocks under SAC was measured near ``size``."""
        return bool(self._nearest(size, True))

    def ratio(self, size: int) -> float | None:
        """``r`` near ``size``: extra step seconds per roofline second of the blocks under SAC (None: not measured)."""
        base, sac = self._nearest(size, False), self._nearest(size, True)
        if not base or not sac:
            return None
        reference = statistics.median(v for _, v in base)
        return max(0.0, statistics.median((v - reference) / share for share, v in sac))
