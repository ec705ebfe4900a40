"""Reserved memory from the allocator simulator on the estimate's own schedule (issue 25, item 8)."""

from __future__ import annotations

import pytest

from memplan import Job, Parallelism, estimate, load_model
from memplan.errors import JobConfigError
from memplan.estimate import reserved_sim
from memplan.estimate.engine import _stages
from memplan.estimate.ledger import ACTIVATIONS, ABSENT, PARAMETERS, TEMPORARY, Contribution, Ledger
from memplan.jobflags import build_job

JOBS = {
    "sdpa": dict(seq=2048, attention="sdpa"),
    "eager fp32": dict(seq=2048, attention="eager", precision="fp32"),
    "full recompute": dict(seq=2048, recompute="full"),
    "fsdp 4, tp 2": dict(seq=2048, fsdp=4, tp=2, recompute="full"),
    "pipeline 2": dict(seq=1024, gpus=2, pp=2, gbs=8),
    "megatron distributed optimizer": dict(seq=1024, gpus=2, framework="megatron", distributed_optimizer=True),
}


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    seen: list[object] = []
    real = reserved_sim.simulated_reserved

    def spy(*args: object) -> object:
        seen.append(result := real(*args))  # type: ignore[arg-type]
        return result

    monkeypatch.setattr(reserved_sim, "simulated_reserved", spy)  # stage.py imports it on use
    _stages.cache_clear()
    return seen


@pytest.mark.parametrize("name", sorted(JOBS))
def test_the_schedule_peaks_at_the_estimates_peak_allocated(name: str, captured: list[object]) -> None:
    """The schedule is built from the estimate's contributions: its requested peak is the stage's peak allocated
    (a schedule that holds more or less than the ledger at some moment is wrong)."""
    model = load_model("llama-3.2-1b")
    est = estimate(model, build_job(JOBS[name]), reserved="simulated")
    assert len(captured) == len(est.stages)
    for stage, sim in zip(est.stages, captured):
        assert sim.requested == stage.peak_allocated_bytes  # type: ignore[attr-defined]
        assert stage.peak_reserved_bytes == sim.reserved >= stage.peak_allocated_bytes  # type: ignore[attr-defined]
        assert stage.peak_reserved_bytes % (2 * 1024 * 1024) == 0


def test_the_sentence_comes_with_the_simulated_number() -> None:
    model, job = load_model("llama-3.2-1b"), build_job({"seq": 2048})
    fixed, simulated = estimate(model, job), estimate(model, job, reserved="simulated")
    assert any("allocated / (1 - 0.10)" in a for a in fixed.assumptions)
    assert not any("allocated / (1 -" in a for a in simulated.assumptions)
    assert any("caching-allocator simulator" in a for a in simulated.assumptions)
    assert not any("caching-allocator simulator" in a for a in fixed.assumptions)
    assert simulated.peak_allocated_bytes == fixed.peak_allocated_bytes
    assert simulated.peak_reserved_bytes != fixed.peak_reserved_bytes
    # the result's fragmentation is the simulated share, not the stated 0.10 it did not use
    assert fixed.fragmentation == 0.10
    assert simulated.fragmentation == round(1 - simulated.peak_allocated_bytes / simulated.peak_reserved_bytes, 4)


def test_the_default_stays_the_stated_fragmentation() -> None:
    model, job = load_model("llama-3.2-1b"), Job(parallel=Parallelism(world_size=1))
    est = estimate(model, job)
    assert est.peak_reserved_bytes == -(-int(est.peak_allocated_bytes / 0.9) // 2**21) * 2**21


def test_an_unknown_mode_is_one_clear_error() -> None:
    with pytest.raises(JobConfigError, match="--reserved"):
        estimate(load_model("llama-3.2-1b"), Job(), reserved="measured")


def test_allocated_at_a_moment_subtracts_what_is_absent() -> None:
    ledger = Ledger(("backward", "optimizer step"))
    ledger.add(Contribution(PARAMETERS, 1000), Contribution(ACTIVATIONS, 300, ("backward",)),
               Contribution(ABSENT, 200, ("backward",)), Contribution(TEMPORARY, 340, ("optimizer step",)))
    assert ledger.allocated_at("backward") == 1100
    assert ledger.allocated_at("optimizer step") == 1340
    assert ledger.allocated_at(ledger.peak().phase) == ledger.peak().allocated
