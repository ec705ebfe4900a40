"""What a newcomer reads: a job that does not fit says what would make it fit."""

from __future__ import annotations

from typer.testing import CliRunner

from memplan.cli import app

runner = CliRunner()


def test_estimate_that_does_not_fit_names_the_cheapest_fix() -> None:
    """The README's QLoRA example on a 24 GB card: the doctor's job fixes, verified by the estimator."""
    result = runner.invoke(app, ["estimate", "llama-3.1-8b", "--peft", "lora", "--quantize-base", "nf4",
                                 "--lora-rank", "64", "--lora-targets", "all-linear", "--seq", "4096",
                                 "--gpu", "rtx-4090"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Does not fit" in result.output
    line = next(line for line in result.output.splitlines() if line.startswith("To fit: "))
    assert "reserved within the" in line and "limit" in line


def test_estimate_that_fits_adds_nothing() -> None:
    result = runner.invoke(app, ["estimate", "llama-3.2-1b", "--gpu", "h100-80gb"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "To fit:" not in result.output and "1 GPU =" in result.output
