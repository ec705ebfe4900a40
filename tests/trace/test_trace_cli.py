"""``memplan trace`` on the command line: JSON contract, outputs, bad input (exit codes, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.events import read_trace

runner = CliRunner()
WIDE = {"COLUMNS": "300", "NO_COLOR": "1"}


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), env=WIDE)


def _no_traceback(result) -> None:  # type: ignore[no-untyped-def]
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_json_contract_and_output_files(tiny_llama: str, tmp_path: Path) -> None:
    out, png, snap = tmp_path / "t.mptrace", tmp_path / "t.png", tmp_path / "t.pickle"
    result = invoke("trace", tiny_llama, "--seq", "32", "--mbs", "2", "--precision", "bf16", "--json",
                    "-o", str(out), "--plot", str(png), "--snapshot", str(snap), "--compare-estimate")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert isinstance(data["peak_allocated_bytes"], int) and data["peak_allocated_bytes"] > 0
    assert set(data["by_category"]) >= {"parameter", "gradient", "optimizer_state", "activation", "temporary",
                                        "input", "buffer"}
    assert sum(data["by_category"].values()) == data["peak_allocated_bytes"]
    assert data["events"] == len(read_trace(out).events)
    rows = {r["category"]: r for r in data["compare_estimate"]["rows"]}
    assert rows["parameter"]["difference_bytes"] == 0
    assert png.stat().st_size > 1000 and snap.stat().st_size > 1000


def test_text_report_names_the_peak_and_the_modules(tiny_gpt2: str) -> None:
    result = invoke("trace", tiny_gpt2, "--seq", "32", "--device", "cpu", "--top", "3", "--precision", "fp32")
    assert result.exit_code == 0, result.output
    assert "peak allocated" in result.stdout and "optimizer_state" in result.stdout
    assert "transformer.h." in result.stdout


SCRIPT = '''
import torch

def make_job():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8))
    batch = torch.randn(64, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, batch, optimizer, lambda out, batch: out.square().mean()

def broken():
    raise KeyError("no such dataset")


def make_job_ctx(ctx):
    blocks = [torch.nn.Linear(256, 256, dtype=ctx.param_dtype) for _ in range(4)]
    model = torch.nn.Sequential(*blocks)
    ctx.parallelize(model, blocks=blocks)
    batch = torch.randn(ctx.job.batch.micro_batch_size, ctx.job.batch.seq_length, 256)
    return model, batch, ctx.make_optimizer(model.parameters()), lambda out, batch: out.float().square().mean()
'''


def test_script_job(tmp_path: Path) -> None:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT, encoding="utf-8")
    result = invoke("trace", "--script", f"{path}:make_job", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    params = 4 * (256 * 1024 + 1024 + 1024 * 8 + 8)
    assert data["max_by_category"]["parameter"] == params
    assert data["max_by_category"]["optimizer_state"] == params  # SGD momentum buffers
    assert data["by_category"]["input"] == 64 * 256 * 4


def test_script_without_context_refuses_job_flags(tmp_path: Path) -> None:
    """A job function that takes no ctx builds its own job: --seq/--fsdp cannot reach it (exit 2)."""
    path = tmp_path / "job.py"
    path.write_text(SCRIPT, encoding="utf-8")
    for flags, flag in ((["--seq", "512"], "--seq"), (["--fsdp", "2"], "--fsdp"), (["--precision", "fp32"], "--precision")):
        result = invoke("trace", "--script", f"{path}:make_job", *flags)
        assert result.exit_code == 2, result.output
        assert f"{flag}: cannot apply" in result.output and "ctx" in result.output
        _no_traceback(result)
    data = json.loads(invoke("trace", "--script", f"{path}:make_job", "--device", "cpu", "--json").stdout)
    assert data["options"]["job"] is None  # the flags' job was not used: not recorded as if it were


def test_script_with_context_receives_the_job_and_the_mesh(tmp_path: Path) -> None:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT, encoding="utf-8")
    one = json.loads(invoke("trace", "--script", f"{path}:make_job_ctx", "--seq", "16", "--mbs", "2",
                            "--precision", "fp32", "--optimizer-impl", "foreach", "--json").stdout)
    two = json.loads(invoke("trace", "--script", f"{path}:make_job_ctx", "--seq", "16", "--mbs", "2",
                            "--precision", "fp32", "--optimizer-impl", "foreach", "--fsdp", "2", "--json").stdout)
    params = 4 * 4 * (256 * 256 + 256)
    assert one["max_requested_by_category"]["parameter"] == params
    assert two["max_requested_by_category"]["parameter"] == params // 2  # FSDP2 shards over ctx.mesh
    assert one["by_category"]["input"] == 2 * 16 * 256 * 4  # --mbs x --seq reached the script
    assert two["options"]["job"]["sharding"]["fsdp"] == "full"


@pytest.mark.parametrize(("args", "code", "words"), [
    (["gpt3"], 2, "did you mean 'gpt2'"),
    (["gpt2", "--precision", "fp33"], 2, "--precision"),
    (["gpt2", "--seq", "0"], 2, "--seq"),
    (["gpt2", "--loss", "vocab-parallel"], 2, "--loss: memplan trace runs the model's own loss"),
    (["gpt2", "--seq", "32", "--optimizer", "adafactor"], 2, ".item()"),
    (["gpt2", "--tp", "5"], 2, "--tp: must divide the number of attention heads"),
    ([], 2, "exactly one of MODEL, --script FILE.py:FUNCTION or --torchtitan"),
    (["--script", "nofile.py:make_job"], 2, "does not exist"),
    (["--script", "job.py"], 2, "FILE.py:FUNCTION"),
    (["gpt2", "--pp", "2", "--gpus", "2"], 2, "--pp: is not something memplan trace can run"),
    (["gpt2", "--framework", "megatron"], 2, "estimated only"),
    (["gpt2", "-o", "/no/such/folder/t.mptrace"], 2, "existing folder"),
    (["gpt2", "--snapshot", "."], 2, "not a folder"),
])
def test_bad_input_is_one_line(args: list[str], code: int, words: str) -> None:
    result = invoke("trace", *args)
    assert result.exit_code == code, result.output
    assert words in result.output
    _no_traceback(result)


def test_script_that_raises_names_the_file_and_exception(tmp_path: Path) -> None:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT, encoding="utf-8")
    result = invoke("trace", "--script", f"{path}:broken")
    assert result.exit_code == 1
    assert str(path) in result.output and "KeyError" in result.output and "no such dataset" in result.output
    _no_traceback(result)


def test_config_transformers_cannot_build(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no-such-architecture", "hidden_size": 8}), encoding="utf-8")
    result = invoke("trace", str(path))
    assert result.exit_code == 2
    assert "transformers" in result.output and "no-such-architecture" in result.output
    _no_traceback(result)


def test_command_module_imports_no_torch() -> None:
    code = ("import sys, memplan.cli, memplan.commands.trace, memplan.trace; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
