"""memplan.jobfile: round trips, and one clear error per bad job file."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.errors import ConfigError
from memplan.estimate import estimate
from memplan.job import Batch, Job, Parallelism, Precision, Recompute, Sharding
from memplan.inputs import JobRequest, load_job
from memplan.jobfile import dump_job_file, load_job_file
from memplan.jobflags import build_job, job_flags

JOBS = [
    Job(),
    Job(parallel=Parallelism(world_size=64, tp=8, pp=2, vpp=2, sequence_parallel=True),
        sharding=Sharding(distributed_optimizer=True), batch=Batch(seq_length=8192, global_batch_size=512),
        recompute=Recompute(mode="full", method="block", num_layers=2)),
    Job(parallel=Parallelism(world_size=16), sharding=Sharding(fsdp="hybrid", fsdp_shard_size=8),
        framework="torchtitan", precision=Precision(name="bf16-mixed", grad_dtype="bf16"), attention="sdpa"),
    Job(parallel=Parallelism(world_size=8), sharding=Sharding(zero=3), framework="deepspeed", dropout=0.1),
]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize("index", range(len(JOBS)))
def test_round_trip(tmp_path: Path, suffix: str, index: int) -> None:
    job = JOBS[index]
    path = tmp_path / f"job{suffix}"
    assert dump_job_file("llama-3.1-8b", job, path, gpu="h100-80gb") == ()
    values = load_job_file(path)
    assert values["model"] == "llama-3.1-8b" and values["gpu"] == "h100-80gb"
    assert build_job(values) == job


def test_keys_are_the_estimate_parameters(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("model: llama-3.1-8b\ngpus: 8\nsequence-parallel: true\ntp: 2\nfragmentation: 0.2\n")
    values = load_job_file(path)
    assert values == {"model": "llama-3.1-8b", "gpus": 8, "sequence_parallel": True, "tp": 2, "fragmentation": 0.2}
    assert set(values) <= {f.name for f in job_flags()} | {"model", "fragmentation"}


def test_dump_reports_settings_without_a_flag(tmp_path: Path) -> None:
    job = Job(parallel=Parallelism(world_size=8, pp=4, microbatch_group_size=2))
    dropped = dump_job_file("gpt2", job, tmp_path / "j.yaml")
    assert dropped == ("parallel.microbatch_group_size",)


def test_relative_paths_follow_the_file(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}')
    path = tmp_path / "j.yaml"
    path.write_text("model: gpt2\ngpus: 8\ndeepspeed-config: ds.json\n")
    assert load_job_file(path)["deepspeed_config"] == str(tmp_path / "ds.json")


BAD = {
    "unknown": ("model: gpt2\ntpp: 2\n", "tpp", "did you mean tp"),
    "twice": ("model: gpt2\ntp: 2\ntp: 4\n", "tp", "given twice"),
    "two spellings": ("model: gpt2\nsequence-parallel: true\nsequence_parallel: false\n", "sequence_parallel", "conflicts"),
    "fsdp and zero": ("model: gpt2\ngpus: 8\nfsdp: full\nzero: 2\n", "fsdp", "cannot be combined"),
    "layers without full": ("model: gpt2\nrecompute: selective\nrecompute-layers: 2\n", "recompute-layers", "only applies"),
    "dp mismatch": ("model: gpt2\ngpus: 8\ntp: 2\ndp: 8\n", "dp", "must equal"),
    "wrong type": ("model: gpt2\ngpus: eight\n", "gpus", "must be an int"),
    "bad for model": ("model: gpt2\ngpus: 8\ntp: 8\n", "tp", "attention heads"),
    "not a mapping": ("- gpus\n- 8\n", "--job", "mapping"),
    "bad yaml": ("model: [gpt2\n", "--job", "not valid YAML"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_job_files(tmp_path: Path, name: str) -> None:
    text, field, words = BAD[name]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_job(JobRequest(job_file=str(path)))
    assert info.value.field == (field if field == "--job" else f"{path}: {field}")
    assert words in str(info.value)


def test_duplicate_json_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"model": "gpt2", "tp": 2, "tp": 4}')
    with pytest.raises(ConfigError, match="given twice"):
        load_job_file(path)


def test_megatron_args_round_trip(tmp_path: Path) -> None:
    """A job from a Megatron launch saves its launch file beside the flags and loads back equal."""
    args = tmp_path / "args.yaml"
    args.write_text("MODEL_ARGS:\n  --num-layers: 4\n  --hidden-size: 256\n  --num-attention-heads: 8\n"
                    "  --seq-length: 512\n  --max-position-embeddings: 512\n  --micro-batch-size: 2\n"
                    "  --global-batch-size: 32\n  --bf16: true\n  --tensor-model-parallel-size: 2\n"
                    "  --vocab-size: 1024\n")
    loaded = load_job(JobRequest(flags={"gpus": 8}, megatron_args=str(args)))
    spec, job = loaded.model, loaded.job
    out = tmp_path / "saved.json"
    dump_job_file(None, job, out, megatron_args=str(args))
    assert load_job_file(out)["megatron_args"] == str(args.resolve())
    reloaded = load_job(JobRequest(job_file=str(out)))
    spec2, job2 = reloaded.model, reloaded.job
    assert job2 == job and spec2.hidden_size == spec.hidden_size


def test_megatron_microbatch_group_size_round_trips(tmp_path: Path) -> None:
    """``--microbatch-group-size-per-virtual-pipeline-stage`` has no memplan flag: the saved job keeps the launch
    file, loading it again gives the setting back, so --save-job names nothing; without the file it is named."""
    from memplan.commands.estimate import _reloaded

    args = tmp_path / "args.yaml"
    args.write_text("MODEL_ARGS:\n  --num-layers: 8\n  --hidden-size: 256\n  --num-attention-heads: 8\n"
                    "  --seq-length: 512\n  --max-position-embeddings: 512\n  --micro-batch-size: 1\n"
                    "  --global-batch-size: 64\n  --bf16: true\n  --pipeline-model-parallel-size: 2\n"
                    "  --num-layers-per-virtual-pipeline-stage: 2\n"
                    "  --microbatch-group-size-per-virtual-pipeline-stage: 4\n  --vocab-size: 1024\n")
    loaded = load_job(JobRequest(flags={"gpus": 8}, megatron_args=str(args)))
    assert loaded.job.parallel.microbatch_group_size == 4
    out = tmp_path / "saved.yaml"
    assert dump_job_file(None, loaded.job, out, megatron_args=str(args), reload=_reloaded) == ()
    again = load_job(JobRequest(job_file=str(out)))
    assert again.job == loaded.job
    assert (estimate(again.model, again.job).peak_allocated_bytes
            == estimate(loaded.model, loaded.job).peak_allocated_bytes)
    assert dump_job_file("llama-3.1-8b", loaded.job, tmp_path / "bare.yaml") == ("parallel.microbatch_group_size",)


def test_overrides_are_validated_with_the_file(tmp_path: Path) -> None:
    """A partial file (tp without gpus) is valid once the command line supplies --gpus."""
    path = tmp_path / "partial.yaml"
    path.write_text("model: llama-3.1-8b\ntp: 2\n")
    with pytest.raises(ConfigError, match="gpus"):
        load_job(JobRequest(job_file=str(path)))
    assert load_job_file(path) == {"model": "llama-3.1-8b", "tp": 2}
    loaded = load_job(JobRequest(job_file=str(path), flags={"gpus": 8, "pp": None}))
    assert (loaded.job.parallel.tp, loaded.job.parallel.dp) == (2, 4)
    with pytest.raises(ConfigError, match="attention heads"):
        load_job(JobRequest(job_file=str(path), model="gpt2", flags={"gpus": 8, "tp": 8}))
