"""``memplan fit`` and ``memplan report`` on the command line: output, JSON, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app

runner = CliRunner()
WIDE = {"COLUMNS": "300", "NO_COLOR": "1"}


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), env=WIDE)


def test_fit_table() -> None:
    result = invoke("fit", "llama-3.1-8b", "--gpus", "8", "--top", "3")
    assert result.exit_code == 0, result.output
    assert "fitting configurations" in result.stdout and "tokens/s" in result.stdout


def test_fit_json() -> None:
    result = invoke("fit", "llama-3.1-70b", "--gpus", "64", "--gbs", "512", "--seq", "8192", "--top", "4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["gpus"] == 64 and data["global_batch_size"] == 512 and data["seq_length"] == 8192
    assert len(data["candidates"]) == 4 and data["fitting"] >= 4
    first = data["candidates"][0]
    for key in ("tp", "pp", "dp", "micro_batch_size", "recompute", "reserved_bytes", "headroom_bytes", "tokens_per_s"):
        assert key in first
    assert isinstance(first["reserved_bytes"], int) and first["reserved_bytes"] <= data["limit_bytes"]
    everything = json.loads(invoke("fit", "llama-3.1-70b", "--gpus", "64", "--gbs", "512", "--seq", "8192",
                                   "--all", "--json").stdout)
    assert len(everything["candidates"]) == everything["fitting"]


def test_max_mbs_and_max_seq() -> None:
    result = invoke("fit", "llama-3.1-8b", "--gpus", "8", "--max-mbs", "--tp", "2", "--sequence-parallel",
                    "--distributed-optimizer", "--recompute", "selective", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["quantity"] == "micro_batch_size" and data["best"] >= 1
    text = invoke("fit", "llama-3.1-8b", "--gpus", "8", "--max-seq", "--tp", "2", "--distributed-optimizer")
    assert text.exit_code == 0, text.output
    assert "largest seq length that fits" in text.stdout


def test_layout_flags_mean_what_estimate_says() -> None:
    """Same flags, same job: --tp 2 alone is plain data parallelism (no implicit distributed optimizer),
    which does not hold llama-3.1-8b's fp32 Adam states — a result (exit 1), printed, not bad input."""
    result = invoke("fit", "llama-3.1-8b", "--gpus", "8", "--max-mbs", "--tp", "2", "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["best"] == 0 and data["job"]["sharding"]["distributed_optimizer"] is False
    assert "no micro batch size fits" in result.output


def test_search_refuses_flags_it_chooses_and_keeps_the_others() -> None:
    refused = invoke("fit", "llama-3.1-8b", "--gpus", "8", "--tp", "2")
    assert refused.exit_code == 2 and "--tp: is chosen by the layout search" in refused.output
    sgd = json.loads(invoke("fit", "llama-3.1-8b", "--gpus", "8", "--optimizer", "sgd", "--json").stdout)
    adam = json.loads(invoke("fit", "llama-3.1-8b", "--gpus", "8", "--json").stdout)
    assert sgd["candidates"][0]["job"]["optimizer"]["name"] == "sgd"
    assert sgd["candidates"][0]["reserved_bytes"] < adam["candidates"][0]["reserved_bytes"]


def test_max_mbs_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "mbs.png"
    result = invoke("fit", "llama-3.1-8b", "--gpus", "8", "--max-mbs", "--tp", "2", "--distributed-optimizer",
                    "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG"


def _job(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_colocate(tmp_path: Path) -> None:
    a = _job(tmp_path, "a.yaml", "model: gpt2\nmbs: 4\nseq: 1024\n")
    b = _job(tmp_path, "b.yaml", "model: gpt2\nseq: 1024\nrecompute: full\n")
    result = invoke("fit", "--colocate", a, b, "--gpu", "h100-80gb:3g.40gb", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] is True and len(data["processes"]) == 2
    assert data["demand_bytes"] == sum(p["total_bytes"] for p in data["processes"])


@pytest.mark.parametrize("args, words", [
    (("fit", "llama-3.1-70b", "--gpus", "12"), "no parallel layout"),
    (("fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-81gb"), "--gpu"),
    (("fit", "llama-3.1-8b", "--gpus", "8", "--margin", "2"), "--margin"),
    (("fit", "llama-3.1-8b"), "--gpus: is required"),
])
def test_bad_input_exits_2(args: tuple[str, ...], words: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert words in result.output
    assert "Traceback" not in result.output


def test_nothing_fits_exits_1_and_still_prints_the_result() -> None:
    result = invoke("fit", "deepseek-v3", "--gpus", "8", "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert data["fitting"] == 0 and data["candidates"] == []
    assert data["rejected"] and all(r["reason"] for r in data["rejected"])
    assert all(r["min_reserved_bytes"] > data["limit_bytes"] for r in data["rejected"] if r["min_reserved_bytes"])
    assert "fits no layout" in result.stderr and "try --gpus" in result.stderr
    text = invoke("fit", "deepseek-v3", "--gpus", "8")
    assert text.exit_code == 1, text.output
    assert "Rejected families" in text.stdout and "fits no layout" in text.stderr
    assert "Traceback" not in text.output


def test_colocate_bad_inputs_exit_2(tmp_path: Path) -> None:
    good = _job(tmp_path, "a.yaml", "model: gpt2\n")
    unknown = _job(tmp_path, "u.yaml", "model: gpt2\nmicro-batch: 2\n")
    conflict = _job(tmp_path, "c.yaml", "model: gpt2\ngpus: 8\nfsdp: full\nzero: 1\n")
    for args, words in (
        ((good, "--gpu", "h100-80gb:5g.50gb"), "MIG profile"),
        ((unknown, "--gpu", "h100-80gb"), "micro-batch: is not a job-file field"),
        ((conflict, "--gpu", "h100-80gb"), "cannot be combined"),
    ):
        result = invoke("fit", "--colocate", *args)
        assert result.exit_code == 2, result.output
        assert words in result.output


def test_report_writes_html(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    job = _job(tmp_path, "j.yaml", "model: llama-3.1-8b\ngpus: 8\npp: 2\ndistributed-optimizer: true\ngbs: 64\n")
    timeline = tmp_path / "t.json"
    timeline.write_text(json.dumps([[0, {"parameter": 1000}], [1, {"parameter": 1000, "activation": 500}]]))
    result = invoke("report", "--job", job, "--fit", "--timeline", str(timeline), "-o", str(out))
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert "Configurations that fit" in page and "Memory timeline" in page and "Per-stage memory" in page


def test_report_json_says_what_was_written(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    timeline = tmp_path / "t.json"
    timeline.write_text(json.dumps([[0, {"parameter": 1000}], [1, {"parameter": 1000, "activation": 500}]]))
    result = invoke("report", "llama-3.1-8b", "--gpus", "8", "--timeline", str(timeline), "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # nothing else on stdout
    assert doc["output"] == str(out.resolve()) and doc["bytes"] == out.stat().st_size > 0
    assert doc["model"] == "llama-3.1-8b" and doc["stages"] == 1 and doc["timeline_points"] == 2
    assert doc["peak_allocated_bytes"] > 0 and doc["fit_candidates"] is None and doc["unmodelled_settings"] == []


def test_report_bad_timeline_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text('{"not": "a list"}')
    result = invoke("report", "gpt2", "--timeline", str(bad), "-o", str(tmp_path / "r.html"))
    assert result.exit_code == 2 and "--timeline" in result.output


def test_help_has_examples() -> None:
    for command in ("fit", "report"):
        result = invoke(command, "--help")
        assert result.exit_code == 0 and "Examples" in result.stdout


def test_command_modules_import_nothing_heavy() -> None:
    code = ("import sys, memplan.cli, memplan.commands.fit, memplan.commands.report; "
            "print([m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_progress_bar_appears_only_after_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    import memplan.commands.fit as fit_cmd

    clock = [100.0]
    monkeypatch.setattr(fit_cmd.time, "perf_counter", lambda: clock[0])
    update, stop = fit_cmd._progress(True)
    assert update is not None
    update(1, 10)  # before a second: nothing started
    clock[0] += 1.5
    update(5, 10)
    update(10, 10)
    stop()
    assert fit_cmd._progress(False)[0] is None


def test_max_mbs_from_a_job_file(tmp_path: Path) -> None:
    job = _job(tmp_path, "j.yaml", "model: llama-3.1-8b\ntp: 2\nsequence-parallel: true\ndistributed-optimizer: true\n"
                                   "recompute: selective\n")
    result = invoke("fit", "llama-3.1-8b", "--gpus", "8", "--max-mbs", "--job", job, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["job"]["parallel"]["tp"] == 2 and data["job"]["recompute"]["mode"] == "selective"
    assert data["best"] >= 1


def test_gbs_is_kept_by_the_search() -> None:
    """--gbs is the job's global batch: every layout keeps it, and layouts it does not divide are rejected."""
    result = runner.invoke(app, ["fit", "llama-3.1-8b", "--gpus", "8", "--gbs", "100", "--json", "--all"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["global_batch_size"] == 100 and doc["candidates"]
    for row in doc["candidates"]:
        assert row["global_batch_size"] == 100 and 100 % (row["dp"] * row["micro_batch_size"]) == 0
    assert any("not a multiple of dp=8" in r["reason"] for r in doc["rejected"])


@pytest.mark.parametrize("extra, flag", [
    (("--top", "3"), "--top"), (("--all",), "--all"), (("--gpus-per-node", "4"), "--gpus-per-node"),
    (("--max-seq",), "--max-seq"), (("--methods",), "--methods"), (("--plot", "p.png"), "--plot"),
    (("--seq", "8192"), "--seq"), (("--zero", "3"), "--zero"), (("--text-field", "x"), "--text-field"),
])
def test_colocate_refuses_what_it_does_not_read(tmp_path: Path, extra: tuple[str, ...], flag: str) -> None:
    """--colocate reads every job from its file; each of these was accepted and changed nothing."""
    a = _job(tmp_path, "a.yaml", "model: llama-3.2-1b\ngpus: 1\n")
    b = _job(tmp_path, "b.yaml", "model: gpt2\ngpus: 1\n")
    out = invoke("fit", "--colocate", a, b, *extra)
    assert out.exit_code == 2, out.output
    assert out.output.startswith(f"error: {flag}: ") and len(out.output.strip().splitlines()) == 1
    assert invoke("fit", "--colocate", a, b, "--margin", "0.2").exit_code in (0, 1)


@pytest.mark.parametrize("mode", ["--methods", "--max-seq", "--max-mbs"])
@pytest.mark.parametrize("extra, flag", [(("--top", "3"), "--top"), (("--all",), "--all"),
                                         (("--gpus-per-node", "4"), "--gpus-per-node")])
def test_search_options_are_refused_where_no_layout_is_searched(mode: str, extra: tuple[str, ...], flag: str) -> None:
    out = invoke("fit", "llama-3.2-1b", mode, *extra)
    assert out.exit_code == 2, out.output
    assert f"error: {flag}: applies to the layout search only; {mode} searches no layouts" in out.output
