"""--torchtitan-config: torchtitan's training TOMLs read into the Job, every field classified."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import ConfigError
from memplan.frameworks.torchtitan_config import stage_layers
from memplan.frameworks.torchtitan_fields import (
    NO_MEMORY_EFFECT,
    PRESETS,
    field_defaults,
    field_list,
    field_types,
    flavors,
    torchtitan_commit,
)
from memplan.inputs import JobRequest, load_job

DATA = Path(__file__).parent.parent / "data" / "torchtitan"
LLAMA3_8B = DATA / "llama3_8b.toml"


def _load(path: Path, model: str | None = None, **flags: Any) -> Any:
    return load_job(JobRequest(model=model, flags=flags, torchtitan_config=str(path)))


def _toml(tmp_path: Path, text: str, name: str = "train.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _setting(loaded: Any, key: str) -> Any:
    return next(s for s in loaded.settings if s.key == key)


def test_shipped_llama3_8b_maps_to_the_expected_job() -> None:
    loaded = _load(LLAMA3_8B, gpus=64)
    job = loaded.job
    assert loaded.model_ref == "llama-3.1-8b" and loaded.model.num_layers == 32
    assert job.framework == "torchtitan"
    assert (job.batch.seq_length, job.batch.micro_batch_size, job.batch.global_batch_size) == (8192, 1, 64)
    assert (job.parallel.world_size, job.parallel.tp, job.parallel.pp, job.parallel.cp, job.parallel.dp) == \
        (64, 1, 1, 1, 64)
    assert job.sharding.fsdp == "full"
    assert job.recompute.mode == "selective"
    assert job.precision.name == "bf16-mixed" and job.precision.fp8 is None
    assert (job.optimizer.name, job.optimizer.implementation) == ("adamw", "fused")
    assert loaded.unmodelled == ()


def test_shipped_llama3_405b_maps_tp_float8_and_full_recompute() -> None:
    loaded = _load(DATA / "llama3_405b.toml", gpus=512)
    job = loaded.job
    assert loaded.model_ref == "llama-3.1-405b"
    assert (job.parallel.tp, job.parallel.dp, job.parallel.sequence_parallel) == (8, 64, True)
    assert job.recompute.mode == "full" and job.precision.fp8 == "hybrid"
    assert job.compile and job.compile_loss == "on"  # components = ["model", "loss"]
    assert "compile.components" not in {s.key for s in loaded.unmodelled}


def _sample(key: str) -> Any:
    """A TOML value for a field: its default, or one of its type when the default is None."""
    if field_defaults()[key] is not None:
        return field_defaults()[key]
    kind = field_types()[key]
    if kind.startswith("list"):
        return []
    if "int" in kind:
        return 1
    if "float" in kind:
        return 0.5
    if "Literal" in kind:
        return kind.split("'")[1] if "'" in kind else kind.split('"')[1]
    return "x"


def _every_field_toml() -> str:
    sections: dict[str, list[str]] = {}
    for field in field_list():
        section, _, key = field.rpartition(".")
        sections.setdefault(section, []).append(f"{key} = {json.dumps(_sample(field))}")
    return "\n".join(f"[{name}]\n" + "\n".join(lines) for name, lines in sections.items())


@pytest.mark.parametrize("model", [None, "llama-3.2-1b"])
def test_every_torchtitan_field_is_classified(tmp_path: Path, model: str | None) -> None:
    text = _every_field_toml().replace('flavor = "debugmodel"', 'flavor = "8B"')
    loaded = _load(_toml(tmp_path, text), model, gpus=8)
    by_key = {s.key: s for s in loaded.settings}
    fields = field_list()
    assert len(fields) == len(set(fields)) > 140
    for key in fields:
        assert key in by_key, key
        assert by_key[key].effect in ("modelled", "no-memory-effect", "not-modelled")
        assert by_key[key].note, key
        assert "not a field" not in by_key[key].note, key
        assert "does not read" not in by_key[key].note, key


def test_tables_name_only_real_fields_and_flavors() -> None:
    fields, known = set(field_list()), flavors()
    assert set(NO_MEMORY_EFFECT) <= fields
    for (name, flavor), preset in PRESETS.items():
        assert flavor in known[name], (name, flavor)
        assert load_job(JobRequest(model=preset)).model.num_layers > 0
    assert len(torchtitan_commit()) == 40


def test_unknown_key_is_reported_not_modelled(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nfancy_new_thing = 3\n')
    setting = _setting(_load(path, gpus=8), "training.fancy_new_thing")
    assert setting.effect == "not-modelled" and "not a field" in setting.note


def test_defaults_apply_as_torchtitan_does(tmp_path: Path) -> None:
    """No [training]/[activation_checkpoint]: local_batch_size 8, seq 2048, selective every 2nd layer."""
    loaded = _load(_toml(tmp_path, '[model]\nname = "llama3"\nflavor = "8B"\n'), gpus=8)
    job = loaded.job
    assert (job.batch.micro_batch_size, job.batch.seq_length, job.batch.global_batch_size) == (8, 2048, 64)
    assert (job.recompute.mode, job.recompute.method, job.recompute.num_layers) == ("full", "block", 16)
    assert "torchtitan's default" in _setting(loaded, "activation_checkpoint.selective_ac_option").note


def _job(tmp_path: Path, body: str, model: str = "llama-3.1-8b", **flags: Any) -> Any:
    return _load(_toml(tmp_path, body), model, **flags)


def test_every_nth_layer_checkpointing_per_pipeline_stage(tmp_path: Path) -> None:
    body = ("[parallelism]\npipeline_parallel_degree = 2\n[training]\nlocal_batch_size = 4\n"
            "[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"3\"\n")
    loaded = _job(tmp_path, body, gpus=8)
    job = loaded.job
    # 32 layers + 1 + 1 over 2 stages: 16 and 16 decoder layers; every 3rd of 16 → 5 per stage.
    assert job.parallel.chunk_layers == (16, 16) and job.parallel.vpp == 1
    assert (job.recompute.mode, job.recompute.method, job.recompute.num_layers) == ("full", "block", 5)
    assert (job.batch.micro_batch_size, job.batch.global_batch_size) == (1, 16)
    assert _setting(loaded, "activation_checkpoint.selective_ac_option").effect == "modelled"


def test_interleaved_schedule_uses_two_stages_per_rank(tmp_path: Path) -> None:
    body = '[parallelism]\npipeline_parallel_degree = 4\npipeline_parallel_schedule = "Interleaved1F1B"\n'
    job = _job(tmp_path, body, gpus=8).job
    assert job.parallel.vpp == 2 and job.parallel.chunk_layers == stage_layers(8, 32, 1, 1)
    assert sum(job.parallel.chunk_layers) == 32


def test_stage_split_follows_torchtitan() -> None:
    # torchtitan's docstring example: 3 layers, embedding and output weighted 2, two stages.
    assert stage_layers(2, 3, 2, 2) == (2, 1)
    assert stage_layers(4, 126, 1, 1) == (31, 32, 32, 31)
    with pytest.raises(ConfigError):
        stage_layers(40, 30, 1, 1)


def test_hsdp_and_shard_auto_degree(tmp_path: Path) -> None:
    body = "[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = -1\n"
    job = _job(tmp_path, body, gpus=16).job
    assert (job.sharding.fsdp, job.sharding.fsdp_shard_size, job.parallel.dp) == ("hybrid", 8, 16)


def test_explicit_degrees_must_match_gpus(tmp_path: Path) -> None:
    body = "[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n"
    assert _job(tmp_path, body).job.parallel.world_size == 8
    with pytest.raises(ConfigError, match="must equal --gpus 16"):
        _job(tmp_path, body, gpus=16)


def test_precision_modes(tmp_path: Path) -> None:
    assert _job(tmp_path, '[training]\ndtype = "bfloat16"\n', gpus=8).job.precision.name == "bf16"
    assert _job(tmp_path, '[training]\nmixed_precision_param = "float32"\n', gpus=8).job.precision.name == "fp32"
    # TP without FSDP: torchtitan applies no mixed precision at all (maybe_enable_amp); the file says
    # bf16-mixed and the torchtitan profile resolves it to fp32, as for the same job given by flags.
    from memplan.estimate.precision import resolve_precision
    from memplan.profiles.framework import TORCHTITAN

    tp_only = "[parallelism]\ndata_parallel_shard_degree = 1\ntensor_parallel_degree = 8\n"
    job = _job(tmp_path, tp_only, gpus=8).job
    assert job.precision.name == "bf16-mixed" and job.torchtitan_model
    prec = resolve_precision(job, TORCHTITAN)
    assert (prec.param, prec.compute, prec.residual, prec.weight_copies) == ("fp32", "fp32", "fp32", None)
    assert "maybe_enable_amp" in prec.notes[0]
    flags = load_job(JobRequest(model="llama-3.2-1b", flags={"framework": "torchtitan", "gpus": 2, "tp": 2})).job
    assert resolve_precision(flags, TORCHTITAN).compute == "fp32"
    fsdp_tp = load_job(JobRequest(model="llama-3.2-1b", flags={"framework": "torchtitan", "gpus": 4, "tp": 2,
                                                               "fsdp": "full"})).job
    assert resolve_precision(fsdp_tp, TORCHTITAN).weight_copies == "fsdp"
    single = _job(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 1\n", gpus=1).job
    assert resolve_precision(single, TORCHTITAN).weight_copies == "autocast"


def test_optimizer_offload_and_in_backward(tmp_path: Path) -> None:
    body = ('[optimizer]\nname = "Adam"\nimplementation = "foreach"\nearly_step_in_backward = true\n'
            "[training]\nenable_cpu_offload = true\n")
    job = _job(tmp_path, body, gpus=8).job
    assert (job.optimizer.name, job.optimizer.implementation, job.optimizer.in_backward) == ("adam", "foreach", True)
    assert job.offload.params and job.offload.optimizer


def test_memory_budget_is_the_memory_budget_policy_and_unknown_optimizer_is_not_modelled(tmp_path: Path) -> None:
    compiled = '[compile]\nenable = true\n'
    body = compiled + '[activation_checkpoint]\nmode = "memory_budget"\nmemory_budget = 0.3\n[optimizer]\nname = "Muon"\n'
    loaded = _job(tmp_path, body, gpus=8)
    assert (loaded.job.recompute.mode, loaded.job.recompute.memory_budget) == ("memory-budget", 0.3)
    unmodelled = {s.key for s in loaded.unmodelled}
    assert "optimizer.name" in unmodelled
    assert not {"activation_checkpoint.mode", "activation_checkpoint.memory_budget"} & unmodelled
    default = _job(tmp_path, compiled + '[activation_checkpoint]\nmode = "memory_budget"\n', gpus=8).job
    assert default.recompute.memory_budget == 0.5  # torchtitan's default
    with pytest.raises(ConfigError, match="needs compile.enable = true"):
        _job(tmp_path, '[activation_checkpoint]\nmode = "memory_budget"\n', gpus=8)


def test_typed_flags_win(tmp_path: Path) -> None:
    job = _load(LLAMA3_8B, gpus=64, seq=4096, recompute="full").job
    assert (job.batch.seq_length, job.recompute.mode) == (4096, "full")
    # A typed --tp replaces the file's degree before -1 resolves: dp 32, no gradient accumulation.
    job = _load(LLAMA3_8B, gpus=64, tp=2).job
    assert (job.parallel.tp, job.parallel.dp, job.batch.global_batch_size, job.num_microbatches) == (2, 32, 32, 1)


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["estimate", *args])


@pytest.mark.parametrize("text, needle", [
    ('[model]\nname = "llama3"\nflavor = "9B"\n', "known: debugmodel"),
    ('[model]\nname = "llama3"\nflavor = "8B"\n[training\nseq_len = 4\n', "line 4"),
    ('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ntensor_parallel_degree = -2\n',
     "tensor_parallel_degree: must be a positive integer"),
    ('[model]\nname = "llama3"\nflavor = "debugmodel"\n', "give MODEL"),
    ('[model]\nname = "llama3"\nflavor = "8B"\n[activation_checkpoint]\nselective_ac_option = "some"\n',
     "must be 'op' or a non-negative integer"),
])
def test_bad_files_are_one_line_exit_2(tmp_path: Path, text: str, needle: str) -> None:
    path = _toml(tmp_path, text)
    result = _cli("--torchtitan-config", str(path), "--gpus", "8")
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and needle in result.output, result.output


def test_malformed_toml_names_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[training]\nseq_len = = 3\n", "broken.toml")
    result = _cli("--torchtitan-config", str(path))
    assert result.exit_code == 2 and "broken.toml" in result.output and "line 2" in result.output, result.output


def test_json_has_input_settings(tmp_path: Path) -> None:
    result = _cli("--torchtitan-config", str(DATA / "llama3_405b.toml"), "--gpus", "512", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["framework"] == "torchtitan" and data["model"] == "llama-3.1-405b"
    keys = {s["key"] for s in data["input_settings"]}
    assert {"training.seq_len", "parallelism.tensor_parallel_degree", "model.converters"} <= keys
    # the compiled loss over TP-sharded logits (loss parallel) has no rule: priced as eager, and said
    assert any(s.startswith("--compile compiled loss = true: a loss over TP-sharded logits")
               for s in data["unmodelled_settings"])
    # compiled blocks under full recompute (and torchtitan's own model code) have no partitioner rule: said
    assert any(s.startswith("--compile compiled layers = true: the activation policy 'full'")
               for s in data["unmodelled_settings"])


def test_fit_trace_and_report_take_the_option(tmp_path: Path) -> None:
    runner = CliRunner()
    for command in ("fit", "trace", "report"):
        help_text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert "--torchtitan-config" in help_text, command
    html = tmp_path / "r.html"
    report = runner.invoke(app, ["report", "--torchtitan-config", str(LLAMA3_8B), "--gpus", "64", "-o", str(html)])
    assert report.exit_code == 0 and html.is_file(), report.output
    fit = runner.invoke(app, ["fit", "llama-3.1-8b", "--gpus", "64", "--torchtitan-config", str(LLAMA3_8B),
                              "--top", "1", "--json"])
    assert fit.exit_code in (0, 1), fit.output


def _extractor() -> Any:
    import importlib.util

    path = Path(__file__).parents[2] / "tools" / "torchtitan_fields.py"
    spec = importlib.util.spec_from_file_location("torchtitan_fields_tool", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extraction_script_walks_nested_dataclasses_and_flavor_dicts() -> None:
    tool = _extractor()
    source = (
        "from dataclasses import dataclass, field\n"
        "@dataclass\nclass Loader:\n    num_workers: int = 0\n"
        "@dataclass\nclass Training:\n    seq_len: int = 2048\n    path: str | None = None\n"
        "    loader: Loader = field(default_factory=Loader)\n"
        "    names: list[str] = field(default_factory=lambda: ['output'])\n"
        "@dataclass\nclass JobConfig:\n    training: Training = field(default_factory=Training)\n"
    )
    leaves = tool._leaves(tool._classes(source), "JobConfig", "")
    assert [(f["key"], f["default"]) for f in leaves] == [
        ("training.seq_len", 2048), ("training.path", None), ("training.loader.num_workers", 0),
        ("training.names", ["output"])]
    flavor_source = "__all__ = ['x']\nargs = {'debugmodel': Args(dim=4), '8B': Args(dim=8)}\n"
    assert tool._flavors(flavor_source) == ["debugmodel", "8B"]


def test_flags_split_the_pipeline_as_the_toml_does(tmp_path: Path) -> None:
    """Same job, same answer: --framework torchtitan --pp 4 --vpp 2 from flags prices torchtitan's own
    split (the profile's rule), which is what the TOML reader gives."""
    from memplan.estimate import estimate

    body = ('[parallelism]\npipeline_parallel_degree = 4\npipeline_parallel_schedule = "Interleaved1F1B"\n'
            "data_parallel_shard_degree = 2\n")
    loaded = _job(tmp_path, body, gpus=8)
    flags = replace(loaded.job, parallel=replace(loaded.job.parallel, chunk_layers=None, vpp=2))
    toml_est, flags_est = estimate(loaded.model, loaded.job), estimate(loaded.model, flags)
    assert [s.layers for s in toml_est.stages] == [s.layers for s in flags_est.stages] == [8, 9, 8, 7]
    assert toml_est.peak_allocated_bytes == flags_est.peak_allocated_bytes


def test_the_pp_reshard_default_is_modelled_and_always_under_pp_is_reported(tmp_path: Path) -> None:
    """torchtitan keeps blocks unsharded under PP by default: priced (memplan.estimate.pipeline_fsdp), so
    nothing is reported from flags or from a TOML that says default; "always" under PP is reported."""
    from memplan.estimate import estimate
    from memplan.job import Job, Parallelism, Sharding
    from memplan.model import load_preset

    model = load_preset("llama-3.1-8b")
    flags = Job(framework="torchtitan", parallel=Parallelism(world_size=64, pp=8), sharding=Sharding(fsdp="full"))
    result = estimate(model, flags)
    assert result.unmodelled_settings == ()
    assert any("FSDP under pipeline parallelism" in a for a in result.assumptions)
    for value, count in (("default", 0), ("never", 0), ("always", 1)):
        body = (f'[parallelism]\npipeline_parallel_degree = 2\ndata_parallel_shard_degree = 4\n'
                f'fsdp_reshard_after_forward = "{value}"\n')
        loaded = _job(tmp_path, body, gpus=8)
        found = [s for s in estimate(loaded.model, loaded.job, settings=loaded.settings).unmodelled_settings
                 if "fsdp_reshard_after_forward" in s]
        assert len(found) == count and all(s.startswith("--torchtitan-config") for s in found)


