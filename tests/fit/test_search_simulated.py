"""memplan.fit.search with the allocator simulator's reserved figure (``Job(reserved="simulated")``): a job
whose peak allocated alone exceeds the limit is not simulated, and only the peak stage of the others is;
the candidates are still exactly what ``estimate`` says of their jobs, and what is reported of the jobs
that were not simulated says it is their allocated figure."""

from __future__ import annotations

import pytest

from memplan import load_model
from memplan.estimate import estimate
from memplan.estimate.engine import simulated_stage_reserved
from memplan.fit import NoFitError, fit
from memplan.fit.context import FULL_RECOMPUTE, NO_RECOMPUTE, make_context
from memplan.fit.results import FIT_MARGIN
from memplan.fit.space import SearchSpace, enumerate_layouts
from memplan.job import Job, Parallelism

SIMULATED = Job(reserved="simulated")


def test_every_candidate_is_what_estimate_says_of_its_job() -> None:
    model = load_model("llama-3.1-8b")
    result = fit(model, gpus=8, gpu="h100-80gb", seq=4096, top=None, base=SIMULATED)
    assert len(result.candidates) > 20, "the case must list many candidates (pipelines among them)"
    assert any(c.job.parallel.pp > 1 for c in result.candidates)
    for cand in result.candidates:
        again = estimate(model, cand.job)
        assert cand.reserved_bytes == again.peak_reserved_bytes <= result.limit_bytes
        assert cand.allocated_bytes == again.peak_allocated_bytes
        assert cand.peak_stage == again.peak_stage
        assert any("caching-allocator simulator" in note for note in again.assumptions)


def test_the_peak_stage_alone_is_the_estimates_stage_figure() -> None:
    model = load_model("llama-3.1-8b")
    job = Job(parallel=Parallelism(world_size=8, pp=4), reserved="simulated")
    full = estimate(model, job)
    for stage in full.stages:
        assert simulated_stage_reserved(model, job, stage.stage) == stage.peak_reserved_bytes


def test_a_job_over_the_limit_by_allocated_is_not_simulated_and_cannot_fit() -> None:
    model = load_model("llama-3.1-70b")
    ctx = make_context(model, 64, "h100-80gb", 4096, None, "megatron", "bf16-mixed", FIT_MARGIN, 0.10, None,
                       SIMULATED)
    layouts, _ = enumerate_layouts(model, 64, seq=4096, framework="megatron", space=SearchSpace())
    over = under = 0
    for layout in layouts[:40]:
        for recompute in (NO_RECOMPUTE, FULL_RECOMPUTE):
            job = ctx.job(layout, 1, recompute)
            priced = ctx.price(job)
            full = estimate(model, job)
            assert priced.allocated == full.peak_allocated_bytes
            assert full.peak_reserved_bytes >= full.peak_allocated_bytes  # what skipping relies on
            if priced.reserved is None:
                over += 1
                assert priced.allocated > ctx.limit and not ctx.fits(job)
                assert priced.at_least == priced.allocated <= full.peak_reserved_bytes
            else:
                under += 1
                assert priced.reserved == full.peak_reserved_bytes
                assert ctx.fits(job) == (full.peak_reserved_bytes <= ctx.limit)
    assert over and under, "the case must have jobs on both sides of the limit"


def test_rejected_families_say_which_figure_they_report() -> None:
    result = fit("llama-3.1-70b", gpus=64, gpu="h100-80gb", top=None, base=SIMULATED)
    estimated = [r for r in result.rejected if r.min_allocated_bytes is not None]
    assert any(r.min_reserved_bytes is None for r in estimated), "some are over the limit by allocated alone"
    for family in estimated:
        if family.min_reserved_bytes is None:
            assert family.min_allocated_bytes > result.limit_bytes and "GiB allocated >" in family.reason
        else:
            assert family.min_reserved_bytes > result.limit_bytes and "allocated" not in family.reason


@pytest.mark.parametrize("reserved", ["fixed", "simulated"])
def test_a_model_that_fits_nowhere_names_its_figure(reserved: str) -> None:
    with pytest.raises(NoFitError) as info:
        fit("deepseek-v3", gpus=8, gpu="h100-80gb", base=Job(reserved=reserved))
    text = str(info.value)
    if reserved == "simulated":
        assert "GiB allocated (reserved is at least that)" in text and "GiB allocated over all GPUs" in text
    else:
        assert "GiB reserved (" in text and "allocated" not in text
    assert info.value.hint.endswith("try --gpus 256")
