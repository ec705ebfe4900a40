"""memplan.fit.limits: the largest micro-batch / sequence fits and the next one does not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from memplan import Batch, Job, Parallelism, Recompute, Sharding, estimate, load_model
from memplan.fit.limits import max_micro_batch, max_seq_length, plot_limit

MODEL = load_model("llama-3.1-8b")
JOB = Job(parallel=Parallelism(world_size=8, tp=2, sequence_parallel=True), sharding=Sharding(distributed_optimizer=True),
          recompute=Recompute(mode="selective"))


def _reserved(job: Job) -> int:
    return estimate(MODEL, job).peak_reserved_bytes


def test_max_micro_batch_is_tight() -> None:
    lim = max_micro_batch(MODEL, JOB, gpu="h100-80gb")
    assert lim.best >= 1 and lim.job is not None
    best = dataclasses.replace(JOB, batch=dataclasses.replace(JOB.batch, micro_batch_size=lim.best))
    above = dataclasses.replace(JOB, batch=dataclasses.replace(JOB.batch, micro_batch_size=lim.best + 1))
    assert _reserved(best) <= lim.limit_bytes < _reserved(above)
    values = [p.value for p in lim.curve]
    assert values == sorted(values)
    reserved = [p.reserved_bytes for p in lim.curve]
    assert reserved == sorted(reserved), "memory must grow with the micro-batch"


def test_max_micro_batch_respects_the_global_batch() -> None:
    job = dataclasses.replace(JOB, batch=Batch(global_batch_size=48))  # dp = 4 -> 12 per rank
    lim = max_micro_batch(MODEL, job, gpu="h100-80gb")
    assert all(12 % p.value == 0 for p in lim.curve)
    assert 12 % lim.best == 0


def test_max_seq_length_is_tight_and_a_multiple_of_the_granularity() -> None:
    lim = max_seq_length(MODEL, JOB, gpu="h100-80gb", granularity=256)
    assert lim.best % 256 == 0 and lim.best > 0
    fits = dataclasses.replace(JOB, batch=dataclasses.replace(JOB.batch, seq_length=lim.best))
    over = dataclasses.replace(JOB, batch=dataclasses.replace(JOB.batch, seq_length=lim.best + 256))
    assert _reserved(fits) <= lim.limit_bytes < _reserved(over)


def test_nothing_fits_gives_zero() -> None:
    big = Job(parallel=Parallelism(world_size=1))
    lim = max_micro_batch(load_model("llama-3.1-70b"), big, gpu="h100-80gb")
    assert lim.best == 0 and lim.job is None
    assert [p.fits for p in lim.curve] == [False]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    lim = max_micro_batch(MODEL, JOB, gpu="h100-80gb")
    out = tmp_path / "curve.png"
    plot_limit(lim, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
