"""How a framework splits decoder layers over pipeline stages when the job names no split.

A profile names its rule (:attr:`memplan.profiles.framework.FrameworkProfile.pipeline_split`); the
pipeline layout (:mod:`memplan.estimate.layout`), the job's checks (:mod:`memplan.jobcheck`) and the
torchtitan TOML reader all take the split from here, so one job gets one split.
"""

from __future__ import annotations

from memplan.errors import JobConfigError

__all__ = ["rule_chunk_layers", "weighted_split"]

#: The rule's sentence, as an impossible split names it.
RULE_TEXT = {
    "embedding-output-weighted": ("torchtitan's split (generate_llm_fqn_per_model_part: the embedding and "
                                  "norm + output each count as one layer, the rest split as evenly as possible)"),
}


def weighted_split(num_stages: int, num_layers: int, first_less: int, last_less: int) -> tuple[int, ...] | None:
    """Decoder layers of each stage as torchtitan's ``generate_llm_fqn_per_model_part`` gives them:
    ``num_layers + first_less + last_less`` split over ``num_stages``, the first ``remainder`` stages
    one more, then the first stage gives up ``first_less`` and the last ``last_less``. None where
    torchtitan refuses (more stages than weighted layers, or a weight above a stage's share)."""
    if num_stages == 1:
        return (num_layers,)
    effective = num_layers + first_less + last_less
    per_stage, extra = divmod(effective, num_stages)
    if num_stages > effective or per_stage == 0 or max(first_less, last_less) > per_stage:
        return None
    out, left = [], num_layers
    for stage in range(num_stages):
        take = per_stage + (1 if stage < extra else 0)
        take -= first_less if stage == 0 else last_less if stage == num_stages - 1 else 0
        take = max(0, min(take, left))
        out.append(take)
        left -= take
    return tuple(out)


def rule_chunk_layers(rule: str, num_layers: int, pp: int, vpp: int) -> tuple[int, ...] | None:
    """Layers of each of the ``pp * vpp`` model chunks in model order under ``rule``, or None where
    the rule is the even (or ceil) split the layout computes itself. An impossible split raises
    :class:`~memplan.errors.JobConfigError` naming the rule."""
    if rule == "even-or-ceil" or pp == 1:
        return None
    stages = pp * vpp
    split = weighted_split(stages, num_layers, 1, 1)
    if split is None:
        raise JobConfigError("--pp", f"{RULE_TEXT[rule]} cannot split {num_layers} layers over pp*vpp = {stages} "
                             "stages; give --stage-layers", pp)
    return split
