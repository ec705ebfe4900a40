"""Per-block op-level predictors: forward seconds from FLOPs, selective-checkpoint levels, offload.

Seeded from a fake step's per-op profile (:mod:`memplan.ckpt.opprofile`) at a few sizes, before
training: for each block, the roofline seconds of its forward, and for each selective level the
bytes it would hold and the roofline seconds it would recompute — each a :class:`SizeSeries`. Real
steps correct them: every plain block forward measured gives one ratio *measured / roofline*, and
the median of the recent ratios rescales every predicted second (one factor per model: the ops'
relative costs come from the profile, their absolute level from the machine); a selectively
checkpointed block's measured held bytes are added to its level's series (keep the largest).
Those are priors: every real step also measures each block's seconds under the option it ran, and
where an option was measured near a size its price there is its measured ratio to a kept block
(:mod:`memplan.ckpt.optimes`), so the plans follow the machine, not the roofline. Per-op SAC (level 0)
is priced first by whole steps where they measured it (:class:`~memplan.ckpt.optimes.StepPrices`),
then by the per-block clock, then by the roofline. An option that recomputes is never priced below
keeping the block (it runs every op a kept block runs, and more).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from memplan.ckpt.offload import offload_seconds
from memplan.ckpt.opprofile import OpRecord, Roofline, SacLevel, level_bytes_and_seconds
from memplan.ckpt.optimes import OptionTimes, StepPrices
from memplan.ckpt.planner import BlockOption
from memplan.ckpt.predictor import SizeSeries

__all__ = ["OpCosts", "SAC_OVERHEAD_S_PER_OP"]

#: Roofline seconds per op that selective checkpointing's two dispatch modes add (Python, per op).
SAC_OVERHEAD_S_PER_OP = 4e-5
#: Measured / predicted ratios kept for the time scale.
_RATIOS_KEPT = 32
#: A block's backward takes about this many times its forward (the roofline's kept-block seconds).
BACKWARD_FACTOR = 2.0


@dataclass(kw_only=True)
class _BlockOps:
    levels: tuple[SacLevel, ...]
    n_ops: int
    forward_s: SizeSeries = field(default_factory=lambda: SizeSeries(keep="max"))
    sac_s: list[SizeSeries] = field(default_factory=list)
    sac_kept: list[SizeSeries] = field(default_factory=list)


@dataclass(kw_only=True)
class OpCosts:
    """Op-level predictors of every profiled block (see the module docstring)."""

    roof: Roofline
    device: torch.device
    blocks: dict[int, _BlockOps] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)
    #: measured seconds of each option relative to keeping the block (:mod:`memplan.ckpt.optimes`)
    times: OptionTimes = field(default_factory=OptionTimes)
    #: whole-step seconds with and without blocks under per-op SAC (:mod:`memplan.ckpt.explore`)
    steps: StepPrices = field(default_factory=StepPrices)

    @property
    def scale(self) -> float:
        """Measured seconds per roofline second (1.0 before any real block forward)."""
        return statistics.median(self.ratios) if self.ratios else 1.0

    def add_profile(self, j: int, size: int, ops: Sequence[OpRecord], levels: tuple[SacLevel, ...]) -> None:
        """Record block ``j``'s per-op profile at ``size``; ``levels`` fixes its selective levels."""
        b = self.blocks.get(j)
        if b is None or [lv.keys for lv in b.levels] != [lv.keys for lv in levels]:
            b = self.blocks[j] = _BlockOps(levels=levels, n_ops=len(ops),
                                           sac_s=[SizeSeries(keep="max") for _ in levels],
                                           sac_kept=[SizeSeries(keep="max") for _ in levels])
        b.forward_s.add(size, sum(self.roof.seconds(op) for op in ops))
        for k, level in enumerate(levels):
            held, seconds = level_bytes_and_seconds(ops, level, self.roof)
            b.sac_kept[k].add(size, held)
            b.sac_s[k].add(size, seconds + SAC_OVERHEAD_S_PER_OP * 2 * len(ops))

    def has(self, j: int) -> bool:
        return j in self.blocks

    def forward_s(self, j: int, size: int) -> float:
        """Predicted seconds of block ``j``'s forward at ``size`` (rescaled by measured times)."""
        return self.scale * self.blocks[j].forward_s(size)

    def roof_s(self, size: int) -> float:
        """Roofline seconds of every profiled block's forward at ``size`` (unscaled; a step's yardstick)."""
        return sum(b.forward_s(size) for b in self.blocks.values()) or 1.0

    def roof_block_s(self, j: int, size: int) -> float:
        """Roofline seconds of block ``j``'s forward at ``size`` (unscaled; 0 for a block not profiled)."""
        b = self.blocks.get(j)
        return b.forward_s(size) if b is not None else 0.0

    def kept_s(self, j: int, size: int) -> float:
        """Seconds of block ``j`` kept at ``size`` (forward + backward): measured near, else the roofline's."""
        measured = self.times.kept_seconds(size)
        return measured if measured is not None else (1.0 + BACKWARD_FACTOR) * self.forward_s(j, size)

    def full_s(self, j: int, size: int) -> float:
        """Extra seconds of checkpointing block ``j`` whole at ``size``: measured near, else one more forward."""
        return max(0.0, self.times.cost("full", size, self.kept_s(j, size), self.forward_s(j, size)))

    def level(self, j: int, k: int) -> SacLevel:
        return self.blocks[j].levels[k]

    def options(self, j: int, size: int, act_bytes: int) -> tuple[BlockOption, ...]:
        """Block ``j``'s options beyond keep / full checkpoint at ``size``: selective levels, offload."""
        b = self.blocks.get(j)
        if b is None:
            return ()
        kept_s = self.kept_s(j, size)
        out = [BlockOption(mode=f"sac{k}", kept_bytes=int(b.sac_kept[k](size)), cost_s=self.sac_s(j, k, size, kept_s),
                           recomputes=True) for k in range(len(b.levels))]
        # a level no cheaper in bytes than keeping the block is no option
        out = [o for o in out if o.kept_bytes < act_bytes]
        offload = offload_seconds(self.device, act_bytes, self.forward_s(j, size))
        if offload is not None:
            out.append(BlockOption(mode="offload", kept_bytes=0, cost_s=offload, recomputes=False))
        return tuple(out)

    def sac_s(self, j: int, k: int, size: int, kept_s: float) -> float:
        """Extra seconds of block ``j`` at selective level ``k``: whole steps' price (level 0), else the
        per-block clock's, else the roofline's; never below keeping (0)."""
        b = self.blocks[j]
        r = self.steps.ratio(size) if k == 0 else None
        if r is not None:
            return r * b.forward_s(size)
        return max(0.0, self.times.cost(f"sac{k}", size, kept_s, self.scale * b.sac_s[k](size)))

    def observe_forward(self, j: int, size: int, seconds: float) -> None:
        """A real plain forward of block ``j`` took ``seconds``: one more ratio for the time scale."""
        b = self.blocks.get(j)
        if b is None or seconds <= 0:
            return
        predicted = b.forward_s(size)
        if predicted > 0:
            self.ratios.append(seconds / predicted)
            del self.ratios[:-_RATIOS_KEPT]

    def observe_held(self, j: int, k: int, size: int, held: int) -> bool:
        """A real selective level ``k`` of block ``j`` held ``held`` bytes; True when the fit changed."""
        b = self.blocks.get(j)
        return b is not None and k < len(b.sac_kept) and b.sac_kept[k].add(size, held)
