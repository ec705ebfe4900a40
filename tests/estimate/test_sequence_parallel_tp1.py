"""``--sequence-parallel`` at tp 1: kept as given, no figure changes, and the estimate says so (it was rewritten to
off without a word before)."""

from __future__ import annotations

from memplan import Job, Parallelism, estimate, load_model
from memplan.trace.setup import check_traceable


def test_at_tp_1_the_flag_is_kept_changes_no_figure_and_is_named() -> None:
    model = load_model("llama-3.2-1b")
    plain = estimate(model, Job())
    asked = estimate(model, Job(parallel=Parallelism(sequence_parallel=True)))
    assert asked.job.parallel.sequence_parallel and not asked.job.parallel.splits_sequence
    assert asked.stages == plain.stages
    said = [a for a in asked.assumptions if a.startswith("--sequence-parallel")]
    assert said == ["--sequence-parallel: no effect at --tp 1, there is nothing to split (Megatron warns and turns it off)"]
    assert not any(a.startswith("--sequence-parallel") for a in plain.assumptions)


def test_at_tp_2_it_splits_and_no_such_sentence() -> None:
    model = load_model("llama-3.2-1b")
    on = estimate(model, Job(parallel=Parallelism(world_size=2, tp=2, sequence_parallel=True)))
    off = estimate(model, Job(parallel=Parallelism(world_size=2, tp=2)))
    assert on.job.parallel.splits_sequence
    assert on.stages[0].activations_bytes < off.stages[0].activations_bytes
    assert not any(a.startswith("--sequence-parallel") for a in on.assumptions)


def test_the_tracer_runs_it_at_tp_1_as_without_it() -> None:
    check_traceable(Job(framework="hf", parallel=Parallelism(sequence_parallel=True)))
