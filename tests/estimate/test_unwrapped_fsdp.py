"""``--fsdp`` over a shard group of one rank where the framework does not wrap the model there
(:mod:`memplan.profiles.unwrapped_fsdp`): torchtitan's ``ParallelDims.fsdp_enabled`` needs ``dp_shard > 1`` (or
context parallelism), so such a job is priced as ``--fsdp none``, with a sentence; accelerate (hf) wraps at one
process too. Witness: ``memplan trace`` runs torchtitan's one rank unwrapped (tests/trace/test_chunked_fsdp_trace.py),
toy llama seq 256 bf16-mixed: -9.43% at int18 (FSDP2 priced), -0.02% now (docs/benchmarks.md, lead, session 18)."""

from __future__ import annotations

from typer.testing import CliRunner

from memplan import Batch, Job, Parallelism, estimate, load_model
from memplan.cli import app
from memplan.job import Sharding

MODEL = load_model("llama-3.2-1b")


def _job(framework: str, fsdp: str, gpus: int, tp: int = 1, cp: int = 1, shard: int | None = None) -> Job:
    return Job(framework=framework, parallel=Parallelism(world_size=gpus, tp=tp, cp=cp),
               sharding=Sharding(fsdp=fsdp, fsdp_shard_size=shard), batch=Batch(micro_batch_size=1, seq_length=2048))


def _unwrapped_note(est: object) -> bool:
    return any("applies FSDP2 only over two or more" in note for note in est.assumptions)  # type: ignore[attr-defined]


def test_torchtitan_one_rank_priced_unwrapped() -> None:
    """At f30d0e2 the one-rank job priced FSDP2's all-gather and reduce-scatter buffers above the unwrapped job."""
    wrapped, plain = estimate(MODEL, _job("torchtitan", "full", 1)), estimate(MODEL, _job("torchtitan", "none", 1))
    assert wrapped.peak_allocated_bytes == plain.peak_allocated_bytes
    assert _unwrapped_note(wrapped) and not _unwrapped_note(plain)


def test_torchtitan_tensor_parallel_only_and_hybrid_group_of_one() -> None:
    """tp over every GPU leaves one data-parallel rank; a hybrid shard group of one is torchtitan's replicate (DDP)."""
    assert estimate(MODEL, _job("torchtitan", "full", 2, tp=2)).peak_allocated_bytes == \
        estimate(MODEL, _job("torchtitan", "none", 2, tp=2)).peak_allocated_bytes
    hybrid = estimate(MODEL, _job("torchtitan", "hybrid", 4, shard=1))
    assert _unwrapped_note(hybrid)
    assert hybrid.peak_allocated_bytes == estimate(MODEL, _job("torchtitan", "none", 4)).peak_allocated_bytes


def test_wrapped_where_the_framework_wraps() -> None:
    """Two shard ranks, context parallelism (torchtitan shards over dp_shard x cp), and accelerate at one process
    keep FSDP2 and say nothing."""
    for job in (_job("torchtitan", "full", 2), _job("torchtitan", "full", 2, cp=2), _job("hf", "full", 1)):
        est = estimate(MODEL, job)
        assert not _unwrapped_note(est)
    assert estimate(MODEL, _job("hf", "full", 1)).peak_allocated_bytes != \
        estimate(MODEL, _job("hf", "none", 1)).peak_allocated_bytes


def test_fsdp_only_setting_refused_with_the_rule() -> None:
    """Parameter offload is FSDP2's: with no FSDP at one torchtitan rank the job cannot run as given (exit 2)."""
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--framework", "torchtitan", "--fsdp", "full",
                                      "--gpus", "1", "--offload-params", "--offload-optimizer"])
    assert result.exit_code == 2, result.output
    assert "--fsdp" in result.output and "one rank" in result.output and "Traceback" not in result.output


def test_torchtitan_replicate_keeps_ddp_bucket_copies() -> None:
    """torchtitan's data parallelism without FSDP (a hybrid group of one, or ``--fsdp none``) is ``replicate``:
    DistributedDataParallel with ``gradient_as_bucket_view=False``, one bucket copy of every gradient (int18 priced
    none; review of session 18). One rank has no DDP."""
    replicated = estimate(MODEL, _job("torchtitan", "hybrid", 4, shard=1)).stages[0]
    assert replicated.communication_bytes == replicated.gradients_bytes > 0
    assert estimate(MODEL, _job("torchtitan", "none", 1)).stages[0].communication_bytes == 0
