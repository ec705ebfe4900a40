"""The ``memplan`` command line: output contract, JSON contract, error handling, start-up imports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.job import Job, Parallelism
from memplan.jobflags import build_job, job_flags
from memplan.report.text import stage_breakdown

runner = CliRunner()
#: A wide terminal so that rich does not wrap the lines the tests look for.
WIDE = {"COLUMNS": "400", "NO_COLOR": "1"}

TOP_KEYS = {"peak_allocated_bytes", "peak_reserved_bytes", "peak_stage", "stages", "assumptions"}
STAGE_INT_KEYS = {
    "stage", "layers", "parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
    "transformer_layer_activations_bytes", "other_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
}


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), env=WIDE)


def estimate_json(*args: str) -> dict:  # type: ignore[type-arg]
    result = invoke("estimate", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------------- estimate, text


def test_estimate_prints_a_table() -> None:
    result = invoke("estimate", "llama-3.1-8b", "--gpus", "8")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for row in ("parameters", "gradients", "optimizer states (moments)", "master weights",
                "activations: transformer layers", "loss / logits", "communication buffers",
                "peak allocated", "predicted reserved"):
        assert row in out
    assert "GiB (2^30 bytes)" in out
    assert "Peak:" in out


def test_header_names_every_split_of_the_layout() -> None:
    moe = invoke("estimate", "qwen3-30b-a3b", "--gpus", "16", "--ep", "8").stdout
    assert "dp 16 x tp 1 x pp 1 x cp 1, ep 8 ·" in moe
    dense = invoke("estimate", "llama-3.1-70b", "--gpus", "64", "--tp", "4", "--pp", "4", "--vpp", "2",
                   "--sequence-parallel").stdout
    assert "dp 4 x tp 4 x pp 4 x cp 1, vpp 2, sequence parallel ·" in dense
    plain = invoke("estimate", "llama-3.1-8b", "--gpus", "8").stdout
    assert "dp 8 x tp 1 x pp 1 x cp 1 ·" in plain


def test_estimate_one_column_per_stage() -> None:
    out = invoke("estimate", "llama-3.1-8b", "--gpus", "8", "--pp", "4", "--gbs", "64").stdout
    for stage in range(4):
        assert f"stage {stage}" in out
    assert "pipeline stage" in out


def test_many_stages_are_split_over_tables() -> None:
    out = invoke("estimate", "llama-3.1-8b", "--gpus", "16", "--pp", "16", "--gbs", "64").stdout
    assert "stage 15" in out
    assert out.count("peak allocated") == 4


def test_explain_lists_every_assumption() -> None:
    data = estimate_json("llama-3.1-8b", "--gpus", "8", "--recompute", "selective")
    out = invoke("estimate", "llama-3.1-8b", "--gpus", "8", "--recompute", "selective", "--explain").stdout
    assert "Assumptions" in out
    for i, line in enumerate(data["assumptions"], 1):
        assert f"{i}. {line}" in out


def test_fits_and_does_not_fit() -> None:
    fits = invoke("estimate", "llama-3.2-1b", "--gpu", "h100-80gb")
    assert fits.exit_code == 0
    assert "Fits on h100-80gb" in fits.stdout and "headroom" in fits.stdout
    too_big = invoke("estimate", "llama-3.1-70b", "--gpu", "h100-80gb")
    assert too_big.exit_code == 0
    assert "Does not fit on h100-80gb" in too_big.stdout and "short by" in too_big.stdout


def test_warns_when_pipeline_has_no_global_batch() -> None:
    out = invoke("estimate", "llama-3.1-8b", "--gpus", "8", "--pp", "4").stdout
    assert "--gbs not given" in out


# ---------------------------------------------------------------------------- estimate, JSON


def test_json_contract() -> None:
    data = estimate_json("llama-3.1-8b", "--gpus", "8", "--pp", "4", "--gbs", "64")
    assert TOP_KEYS <= data.keys()
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_stage"):
        assert _is_int(data[key]), key
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2, 3]
    for stage in data["stages"]:
        assert STAGE_INT_KEYS <= stage.keys()
        for key in STAGE_INT_KEYS:
            assert _is_int(stage[key]), key
    assert data["peak_allocated_bytes"] == max(s["peak_allocated_bytes"] for s in data["stages"])
    assert all(isinstance(a, str) and a for a in data["assumptions"])


def test_json_gpu_verdict() -> None:
    data = estimate_json("llama-3.2-1b", "--gpu", "h100")
    assert data["gpu"]["name"] == "h100-80gb"
    assert data["gpu"]["fits"] is True
    assert _is_int(data["gpu"]["headroom_bytes"])


def test_json_reflects_every_job_flag() -> None:
    data = estimate_json(
        "mixtral-8x7b", "--gpus", "64", "--tp", "2", "--pp", "4", "--ep", "8", "--etp", "1",
        "--sequence-parallel", "--distributed-optimizer", "--mbs", "2", "--gbs", "256", "--seq", "2048",
        "--precision", "bf16-mixed", "--grad-dtype", "bf16", "--optimizer", "adam", "--optimizer-impl", "foreach",
        "--recompute", "full", "--recompute-method", "block", "--recompute-layers", "2", "--attention", "sdpa",
        "--dropout", "0.1", "--loss", "fused", "--framework", "megatron", "--make-vocab-size-divisible-by", "64",
        "--fragmentation", "0.2",
    )
    job = data["job"]
    expected = {"world_size": 64, "tp": 2, "pp": 4, "ep": 8, "etp": 1, "dp": 8, "sequence_parallel": True}
    assert {k: job["parallel"][k] for k in expected} == expected
    assert job["sharding"]["distributed_optimizer"] is True
    assert job["batch"] == {"micro_batch_size": 2, "seq_length": 2048, "global_batch_size": 256, "packing": False}
    assert job["precision"]["grad_dtype"] == "bf16"
    assert job["optimizer"]["name"] == "adam" and job["optimizer"]["implementation"] == "foreach"
    assert job["recompute"] == {"mode": "full", "method": "block", "num_layers": 2, "reentrant": False,
                               "modules": None, "memory_budget": None, "partition_activations": False,
                               "cpu_checkpointing": False, "contiguous_checkpoints": None}
    assert (job["attention"], job["dropout"], job["loss"], job["vocab_divisible_by"]) == ("sdpa", 0.1, "fused", 64)
    assert data["fragmentation"] == 0.2
    assert len(data["stages"]) == 4


def test_rendered_rows_add_up_to_the_peak() -> None:
    from memplan import Batch, estimate, load_model
    from memplan.job import Sharding

    jobs = [Job(parallel=Parallelism(world_size=8, pp=4), batch=Batch(global_batch_size=32)),
            # frameworks that free gradients after each step peak before most are made (hf at the loss)
            Job(framework="hf", parallel=Parallelism(world_size=8)),
            # torchtitan's pipelined FSDP2 accumulates gradients unsharded until the last micro-batch
            Job(framework="torchtitan", parallel=Parallelism(world_size=16, pp=2), sharding=Sharding(fsdp="full"),
                batch=Batch(seq_length=8192, global_batch_size=64))]
    for job in jobs:
        for stage in estimate(load_model("llama-3.1-8b"), job).stages:
            assert sum(b for _, b in stage_breakdown(stage)) == stage.peak_allocated_bytes, job.framework
    out = invoke("estimate", "llama-3.1-8b", "--framework", "hf", "--gpus", "8").stdout
    assert "gradients: those alive at the peak (the step makes 29.92 GiB)" in " ".join(out.split())


def test_config_json_path(tmp_path: Path) -> None:
    from memplan.model.presets import preset_config

    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(preset_config("llama-3.2-1b")))
    data = estimate_json(str(path))
    assert data["model"] == "tiny"
    assert data["total_parameters"] == estimate_json("llama-3.2-1b")["total_parameters"]


def test_megatron_args(tmp_path: Path) -> None:
    pytest.importorskip("memplan.frameworks.megatron_args")
    args = tmp_path / "train.sh"
    args.write_text(
        "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
        "--max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 16 --bf16 "
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --vocab-size 32000\n"
    )
    data = estimate_json("--megatron-args", str(args), "--gpus", "8")
    assert len(data["stages"]) == 2
    assert data["job"]["parallel"]["tp"] == 2 and data["job"]["parallel"]["dp"] == 2
    assert data["job"]["batch"]["global_batch_size"] == 16
    # Flags given explicitly win over the file.
    data = estimate_json("--megatron-args", str(args), "--gpus", "8", "--tp", "1")
    assert data["job"]["parallel"]["tp"] == 1 and data["job"]["parallel"]["dp"] == 4


def test_deepspeed_config(tmp_path: Path) -> None:
    pytest.importorskip("memplan.frameworks.deepspeed_config")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                                  "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    data = estimate_json("mistral-7b", "--gpus", "8", "--deepspeed-config", str(config))
    assert data["framework"] == "deepspeed"
    assert data["job"]["sharding"]["zero"] == 2
    assert data["job"]["batch"]["micro_batch_size"] == 2


# ---------------------------------------------------------------------------- models, gpus, help


def test_models_json() -> None:
    result = invoke("models", "--json")
    assert result.exit_code == 0
    presets = {p["name"]: p for p in json.loads(result.stdout)}
    assert presets["llama-3.1-8b"]["num_layers"] == 32
    assert presets["deepseek-v3"]["is_moe"] is True
    assert all(_is_int(p["total_params"]) for p in presets.values())


def test_models_table() -> None:
    out = invoke("models").stdout
    assert "llama-3.1-8b" in out and "params (B)" in out


def test_gpus_json_and_table() -> None:
    result = invoke("gpus", "--json")
    assert result.exit_code == 0
    gpus = {g["name"]: g for g in json.loads(result.stdout)}
    assert gpus["h100-80gb"]["usable_bytes"] < gpus["h100-80gb"]["total_bytes"]
    assert all(_is_int(g["usable_bytes"]) for g in gpus.values())
    assert "h100-80gb" in invoke("gpus").stdout


@pytest.mark.parametrize("command", ["estimate", "models", "gpus"])
def test_help_has_examples(command: str) -> None:
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Examples" in result.stdout and f"memplan {command}" in result.stdout


def test_estimate_help_lists_every_flag() -> None:
    out = invoke("estimate", "--help").stdout
    flags = ["--gpus", "--dp", "--tp", "--pp", "--vpp", "--cp", "--ep", "--etp", "--sequence-parallel",
             "--first-stage-layers", "--last-stage-layers", "--zero", "--fsdp", "--fsdp-shard-size",
             "--distributed-optimizer", "--mbs", "--gbs", "--seq", "--precision", "--grad-dtype",
             "--optimizer-state-dtype", "--master-dtype", "--optimizer", "--momentum", "--optimizer-impl",
             "--recompute", "--recompute-method", "--recompute-layers", "--attention", "--dropout", "--loss",
             "--framework", "--make-vocab-size-divisible-by", "--gpu", "--fragmentation", "--megatron-args",
             "--deepspeed-config", "--explain", "--json"]
    for flag in flags:
        assert flag in out, flag


# ---------------------------------------------------------------------------- errors

BAD_INPUT = [
    (["no-such-model"], "model"),
    (["llama-3.1-8b", "--tp", "3", "--gpus", "3"], "--tp"),
    (["llama-3.1-8b", "--pp", "12", "--gpus", "12"], "--pp"),
    (["llama-3.1-8b", "--gpus", "6", "--tp", "4"], "--gpus"),
    (["llama-3.1-8b", "--gpus", "8", "--tp", "2", "--pp", "2", "--cp", "4"], "--gpus"),
    (["llama-3.1-8b", "--gpus", "8", "--dp", "3"], "--dp"),
    (["llama-3.1-8b", "--vpp", "2"], "--vpp"),
    (["mixtral-8x7b", "--gpus", "6", "--ep", "3"], "--ep"),
    (["llama-3.1-8b", "--gpus", "8", "--gbs", "12"], "--gbs"),
    (["llama-3.1-8b", "--gpus", "8", "--mbs", "2", "--gbs", "24"], "--gbs"),
    (["llama-3.1-8b", "--mbs", "0"], "--mbs"),
    (["llama-3.1-8b", "--seq", "-5"], "--seq"),
    (["llama-3.1-8b", "--gpus", "100000000"], "--gpus"),
    (["llama-3.1-8b", "--gpus", "-1"], "--gpus"),
    (["llama-3.1-8b", "--gpu", "h300"], "--gpu"),
    (["llama-3.1-8b", "--precision", "fp8"], "--precision"),
    (["llama-3.1-8b", "--optimizer", "lamb"], "--optimizer"),
    (["llama-3.1-8b", "--recompute", "some"], "--recompute"),
    (["llama-3.1-8b", "--framework", "jax"], "--framework"),
    (["llama-3.1-8b", "--fsdp", "partial"], "--fsdp"),
    (["llama-3.1-8b", "--zero", "4"], "--zero"),
    (["llama-3.1-8b", "--dropout", "1.5"], "--dropout"),
    (["llama-3.1-8b", "--fragmentation", "1"], "--fragmentation"),
    (["llama-3.1-8b", "--grad-dtype", "fp12"], "--grad-dtype"),
    ([], "MODEL"),
]


def _assert_one_line_error(result, field: str) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert field in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(("args", "field"), BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(args: list[str], field: str) -> None:
    _assert_one_line_error(invoke("estimate", *args), field)


@pytest.mark.parametrize(("args", "field"), BAD_INPUT[:4])
def test_bad_input_with_json_prints_no_json(args: list[str], field: str) -> None:
    _assert_one_line_error(invoke("estimate", *args, "--json"), field)


def test_truncated_config_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 4096, "num_attention_')
    result = invoke("estimate", str(path))
    _assert_one_line_error(result, str(path))
    assert "JSON" in result.stderr


def test_config_json_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    _assert_one_line_error(invoke("estimate", str(path)), str(path))


def test_unknown_model_type(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "not-a-transformer", "hidden_size": 64}))
    _assert_one_line_error(invoke("estimate", str(path)), "model_type")


def test_missing_config_field(tmp_path: Path) -> None:
    from memplan.model.presets import preset_config

    config = preset_config("llama-3.2-1b")
    del config["hidden_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _assert_one_line_error(invoke("estimate", str(path)), "hidden_size")


def test_missing_megatron_args_file(tmp_path: Path) -> None:
    pytest.importorskip("memplan.frameworks.megatron_args")
    _assert_one_line_error(invoke("estimate", "--megatron-args", str(tmp_path / "nope.sh")), "--megatron-args")


def test_usage_errors_exit_2() -> None:
    assert invoke("estimate", "llama-3.1-8b", "--no-such-flag").exit_code == 2
    assert invoke("estimate", "llama-3.1-8b", "--gpus", "eight").exit_code == 2
    assert invoke("no-such-command").exit_code == 2


# ---------------------------------------------------------------------------- option parsing


def test_build_job_keeps_defaults_and_overrides_given_flags() -> None:
    assert build_job({}) == Job()
    base = Job(parallel=Parallelism(world_size=16, tp=2))
    job = build_job({"pp": 2, "seq": 1024, "precision": "bf16", "tp": None}, base)
    assert (job.parallel.world_size, job.parallel.tp, job.parallel.pp, job.parallel.dp) == (16, 2, 2, 4)
    assert job.batch.seq_length == 1024 and job.precision.name == "bf16"
    assert base.parallel.pp == 1  # the base is not mutated


def test_every_job_flag_is_an_option_of_the_job_commands() -> None:
    """The job options are generated from the Job's declarations: every flag, once, in each command."""
    import typer.main

    names = {f.flag for f in job_flags()}
    assert len(names) == len(job_flags()) >= 45
    click_app = typer.main.get_command(app)
    for command in ("estimate", "report", "trace"):
        declared = [o for p in click_app.commands[command].params for o in p.opts]  # type: ignore[attr-defined]
        assert names <= set(declared), command
        assert len(declared) == len(set(declared)), command


def test_fsdp_integer_means_shard_group() -> None:
    assert build_job({"fsdp": "8"}).sharding.fsdp == "full"
    assert build_job({"fsdp": "8"}).parallel.world_size == 8
    job = build_job({"fsdp": 8, "gpus": 32})
    assert (job.sharding.fsdp, job.sharding.fsdp_shard_size) == ("hybrid", 8)
    assert build_job({"fsdp": "1"}).sharding.fsdp == "none"


# ---------------------------------------------------------------------------- real process


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("memplan")
    return [str(script)] if script.exists() else [sys.executable, "-m", "memplan"]


def test_console_script_runs() -> None:
    done = subprocess.run(
        [*_console_script(), "estimate", "llama-3.1-8b", "--gpus", "8", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == "llama-3.1-8b"
    bad = subprocess.run([*_console_script(), "estimate", "llama-3.1-8b", "--tp", "3", "--gpus", "3"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: --tp") and "Traceback" not in bad.stderr


def test_python_dash_m() -> None:
    done = subprocess.run([sys.executable, "-m", "memplan", "gpus", "--json"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert any(g["name"] == "h200" for g in json.loads(done.stdout))


def test_estimate_process_imports_nothing_heavy() -> None:
    """Start-up: no torch/transformers/numpy/matplotlib, and (typer >= 0.2x) no pydantic."""
    code = (
        "import sys\n"
        "sys.argv = ['memplan', 'estimate', 'llama-3.1-8b', '--gpus', '8', '--tp', '2']\n"
        "from memplan.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'matplotlib', 'pydantic') if m in sys.modules]\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr


def test_job_file_round_trip_and_flags_win(tmp_path):
    saved = tmp_path / "job.yaml"
    first = runner.invoke(app, ["estimate", "mixtral-8x7b", "--gpus", "16", "--tp", "2", "--ep", "8",
                                "--fp8", "hybrid", "--moe-imbalance", "1.5", "--save-job", str(saved), "--json"])
    assert first.exit_code == 0, first.output
    text = saved.read_text()
    assert "model: mixtral-8x7b" in text and "moe-imbalance: 1.5" in text and "fp8: hybrid" in text
    again = runner.invoke(app, ["estimate", "--job", str(saved), "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["stages"] == json.loads(first.stdout)["stages"]
    longer = runner.invoke(app, ["estimate", "--job", str(saved), "--seq", "8192", "--json"])
    assert json.loads(longer.stdout)["job"]["batch"]["seq_length"] == 8192


def test_job_file_with_an_unknown_field_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: gpt2\ngpus: 8\ntensor_parallel: 2\n")
    result = runner.invoke(app, ["estimate", "--job", str(bad)])
    assert result.exit_code == 2 and "tensor_parallel" in result.stderr and "Traceback" not in result.output


def test_docs_list_every_job_flag_with_its_default() -> None:
    """docs/job.md's table of defaults is the Job's declarations (one table, kept in step)."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "job.md").read_text(encoding="utf-8")
    for flag in job_flags():
        default = ("—" if flag.default in (None, "") else "off" if flag.default is False
                   else "on" if flag.default is True else str(flag.default))
        assert f"| `{flag.flag}` | " in text and f"| {default} | {flag.help} |" in text, flag.flag


@pytest.mark.parametrize("command", ["estimate", "trace", "fit", "report", "alloc simulate", "alloc plan",
                                     "ckpt bench", "ckpt profile", "diff"])
def test_help_at_80_columns_shows_every_flag_whole(command: str) -> None:
    import typer.main

    click_command: Any = typer.main.get_command(app)
    for word in command.split():
        click_command = click_command.commands[word]
    result = runner.invoke(app, [*command.split(), "--help"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0
    assert "…" not in result.stdout
    words = set(re.findall(r"--[a-z0-9-]+", result.stdout))
    for param in click_command.params:
        for name in (*param.opts, *param.secondary_opts):
            assert not name.startswith("--") or name in words, (command, name)


@pytest.mark.parametrize(("args", "flag"), [
    (["estimate", "gpt2", "--save-job", "{tmp}"], "--save-job"),
    (["estimate", "gpt2", "--save-job", "{tmp}/missing/job.yaml"], "--save-job"),
    (["report", "gpt2", "-o", "{tmp}"], "-o"),
    (["fit", "gpt2", "--gpus", "8", "--max-mbs", "--plot", "{tmp}/no/such/mbs.png"], "--plot"),
    (["alloc", "plan", "{tmp}/x.csv", "-o", "{tmp}"], "--output"),
    (["ckpt", "bench", "--quick", "--output", "{tmp}/none/out.json"], "--output"),
    (["diff", "{tmp}/a.pickle", "{tmp}/b.pickle", "--html", "{tmp}"], "--html"),
])
def test_output_paths_are_checked_before_the_work(tmp_path: Path, args: list[str], flag: str) -> None:
    result = invoke(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code == 2, result.output
    assert f"error: {flag}: must be" in result.output and "Traceback" not in result.output


def test_a_job_file_and_a_flag_that_contradict_name_both(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("model: gpt2\ngpus: 8\nfsdp: full\n")
    result = invoke("estimate", "--job", str(job), "--zero", "2")
    assert result.exit_code == 2
    assert f"{job}: fsdp: cannot be combined with --zero 2" in result.output


def test_uneven_virtual_stages_from_flags() -> None:
    """126 layers on pp 8 x vpp 2: torchtitan's split from flags, an explicit list for Megatron,
    and one line naming the rule where the split is impossible."""
    titan = estimate_json("llama-3.1-405b", "--framework", "torchtitan", "--gpus", "8", "--pp", "8", "--vpp", "2")
    assert [s["layers"] for s in titan["stages"]] == [15] + [16] * 6 + [15]
    _assert_one_line_error(invoke("estimate", "llama-3.1-405b", "--framework", "megatron", "--gpus", "8", "--pp", "8",
                                  "--vpp", "2"), "--stage-layers")
    listed = estimate_json("llama-3.1-405b", "--framework", "megatron", "--gpus", "8", "--pp", "8",
                           "--stage-layers", ",".join(["7"] + ["8"] * 14 + ["7"]))
    assert [s["layers"] for s in listed["stages"]] == [15] + [16] * 6 + [15]
    _assert_one_line_error(invoke("estimate", "llama-3.1-405b", "--framework", "torchtitan", "--gpus", "64",
                                  "--pp", "64", "--vpp", "4"), "torchtitan's split")
    _assert_one_line_error(invoke("estimate", "llama-3.1-405b", "--gpus", "8", "--pp", "8", "--stage-layers",
                                  "60,60,6"), "--stage-layers")
