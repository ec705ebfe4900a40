"""What no estimate may say, whatever its job: the invariants the golden corpus and the property tests hold.

:func:`violations` lists each broken one in a sentence: a byte or element figure that is not a non-negative
``int``; a stage whose parts do not add up to its peak; gradients absent at the peak beyond the gradients; an
optimizer figure that is not its master weights plus moments; reserved below allocated; a job peak that is not
its highest stage's. (A sweep of the golden corpus found a DeepSeek-V3 job with -58.7 GB of parameters in CPU
memory; its record alone could not.)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memplan.estimate.result import Estimate, StageEstimate

__all__ = ["violations"]


def _stage_violations(stage: StageEstimate) -> list[str]:
    out = [f"stage {stage.stage} {field.name} = {getattr(stage, field.name)!r}"
           for field in dataclasses.fields(stage)
           if field.name.endswith(("_bytes", "_numel"))
           and (type(getattr(stage, field.name)) is not int or getattr(stage, field.name) < 0)]
    if out:
        return out
    parts = (stage.parameters_bytes + stage.gradients_bytes + stage.optimizer_bytes + stage.activations_bytes
             + stage.logits_bytes + stage.other_bytes - stage.gradients_absent_at_peak_bytes)
    if parts != stage.peak_allocated_bytes:
        out.append(f"stage {stage.stage}: parts add up to {parts}, peak {stage.peak_allocated_bytes}")
    if stage.gradients_absent_at_peak_bytes > stage.gradients_bytes:
        out.append(f"stage {stage.stage}: {stage.gradients_absent_at_peak_bytes} gradient bytes absent at the peak, "
                   f"of {stage.gradients_bytes}")
    if stage.optimizer_bytes != stage.master_weights_bytes + stage.optimizer_moments_bytes:
        out.append(f"stage {stage.stage}: optimizer {stage.optimizer_bytes} is not master weights "
                   f"{stage.master_weights_bytes} + moments {stage.optimizer_moments_bytes}")
    if stage.peak_reserved_bytes < stage.peak_allocated_bytes:
        out.append(f"stage {stage.stage}: reserved {stage.peak_reserved_bytes} < allocated {stage.peak_allocated_bytes}")
    return out


def violations(result: Estimate) -> list[str]:
    """Every invariant ``result`` breaks, one sentence each (empty when it holds them all)."""
    out = [line for stage in result.stages for line in _stage_violations(stage)]
    if result.peak_reserved_bytes < result.peak_allocated_bytes:
        out.append(f"reserved {result.peak_reserved_bytes} < allocated {result.peak_allocated_bytes}")
    if result.peak_allocated_bytes != max(s.peak_allocated_bytes for s in result.stages):
        out.append("the job's peak is not its highest stage's")
    return out
