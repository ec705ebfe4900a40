"""The estimator's per-job memo (:func:`memplan.estimate.engine._stages`): same job, same answer,
and nothing of one call leaks into another."""

from __future__ import annotations

import dataclasses

import pytest

from memplan import Batch, Job, JobConfigError, Parallelism, estimate, get_gpu, load_model
from memplan.estimate import engine


def _job(seq: int = 4096) -> Job:
    return Job(parallel=Parallelism(world_size=8), batch=Batch(micro_batch_size=1, seq_length=seq))


def test_a_repeated_job_gives_the_same_estimate_as_a_fresh_computation() -> None:
    model = load_model("llama-3.1-8b")
    engine._stages.cache_clear()
    fresh = estimate(model, _job())
    again = estimate(model, _job())  # an equal, distinct Job object: served by the memo
    assert engine._stages.cache_info().hits >= 1
    assert again == fresh
    assert again.to_dict() == fresh.to_dict()


def test_the_result_carries_the_callers_own_job_gpu_and_settings() -> None:
    model = load_model("llama-3.1-8b")
    first, second = _job(), _job()
    estimate(model, first)
    result = estimate(model, second, gpu=get_gpu("h100-80gb"))
    assert result.job is second
    assert result.gpu == get_gpu("h100-80gb")
    assert estimate(model, first).gpu is None


def test_different_jobs_models_and_fragmentation_are_kept_apart() -> None:
    model = load_model("llama-3.1-8b")
    base = estimate(model, _job(4096))
    assert estimate(model, _job(8192)).peak_allocated_bytes > base.peak_allocated_bytes
    assert estimate(model, _job(4096), fragmentation=0.2).peak_reserved_bytes > base.peak_reserved_bytes
    other = dataclasses.replace(model, name="llama-renamed")  # an equal spec, another object
    assert estimate(other, _job(4096)).model == "llama-renamed"
    assert estimate(other, _job(4096)).peak_allocated_bytes == base.peak_allocated_bytes


def test_a_refused_job_is_refused_every_time() -> None:
    model = load_model("llama-3.1-8b")
    bad = Job(parallel=Parallelism(world_size=64, tp=64), batch=Batch(micro_batch_size=1, seq_length=4096))
    for _ in range(2):  # valid alone, refused for this model (64 does not divide its 32 heads)
        with pytest.raises(JobConfigError, match="--tp"):
            estimate(model, bad)
