"""``memplan ckpt``: help, profile of a tiny config.json, a tiny benchmark, bad input, fast import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app

runner = CliRunner()


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    from ckpt_helpers import tiny_gpt2

    path = tmp_path / "config.json"
    path.write_text(tiny_gpt2().config.to_json_string(), encoding="utf-8")
    return path


def test_help_lists_both_commands_with_examples() -> None:
    result = runner.invoke(app, ["ckpt", "--help"])
    assert result.exit_code == 0
    assert "bench" in result.output and "profile" in result.output
    for command in ("bench", "profile"):
        sub = runner.invoke(app, ["ckpt", command, "--help"])
        assert sub.exit_code == 0 and "Examples" in sub.output


def test_profile_prints_accepted_per_block_predictors_as_json(tiny_config: Path) -> None:
    result = runner.invoke(app, ["ckpt", "profile", str(tiny_config), "--sizes", "8,16,32", "--batch", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    series = {s["name"]: s for s in data["series"]}
    assert data["n_layers_profiled"] == 2 and data["n_layers_model"] == 4
    act = series["block0.act_bytes"]
    assert [p[0] for p in act["points"]] == [16, 32, 64]
    assert act["fit"]["accepted"] and act["points"][2][1] > act["points"][0][1] > 0


def test_profile_table_renders(tiny_config: Path) -> None:
    result = runner.invoke(app, ["ckpt", "profile", str(tiny_config), "--sizes", "8,16,24", "--layers", "0"],
                           env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "block3.act_bytes" in result.output


@pytest.mark.parametrize("args", [
    ["ckpt", "profile", "no-such-model-anywhere"],
    ["ckpt", "profile", "gpt2", "--sizes", "abc"],
    ["ckpt", "profile", "gpt2", "--sizes", "64,-1"],
    ["ckpt", "bench", "--steps", "0"],
    ["ckpt", "bench", "--repeats", "-2"],
    ["ckpt", "bench", "--seed", "-1"],  # numpy's generator raised a traceback
    ["ckpt", "bench", "--seed", str(2**64)],
])
def test_bad_input_exits_2_with_one_line(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "error" in result.output.lower() or "invalid" in result.output.lower()


def test_quick_bench_is_a_labelled_smoke_test_of_every_variant() -> None:
    pytest.importorskip("accelerate")
    result = runner.invoke(app, ["ckpt", "bench", "--quick", "--steps", "2", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {r["variant"] for r in data["runs"]} == {"none", "full", "plain", "step", "trainer", "trainer-full",
                                                   "half", "sac"}
    summary = data["summary"]
    assert summary["smoke_test"] is True
    assert summary["targets"]["plain"]["losses equal to none"]["met"]


def test_the_command_module_imports_no_torch() -> None:
    code = "import sys, memplan.cli; assert 'ckpt' in memplan.cli.COMMAND_MODULES; memplan.cli.app; " \
           "bad = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
