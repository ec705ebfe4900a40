"""GaLore AdamW: projected low-rank states priced from shapes, traced with galore-torch, refused where it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optimizer_helpers import TINY_LLAMA, assert_refused
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import ConfigError
from memplan.estimate.engine import estimate
from memplan.job import Job, Optimizer, Precision
from memplan.jobflags import check_conflicts
from memplan.model import load_model
from memplan.model.hf import model_from_hf_config

#: (rows, cols) = (out_features, in_features) of each projected weight of one layer: q, k, v, o, gate, up, down.
LAYER_WEIGHTS = ((128, 128), (64, 128), (64, 128), (128, 128), (384, 128), (384, 128), (128, 384))
runner = CliRunner()


def _job(precision: str = "bf16", rank: int = 16, **kw: object) -> Job:
    return Job(framework="hf", precision=Precision(name=precision),  # type: ignore[arg-type]
               optimizer=Optimizer(name="galore-adamw", galore_rank=rank), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("precision", "element"), [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("rank", [16, 64, 500])
def test_states_are_the_projected_moments_and_projections_by_hand(precision: str, element: int, rank: int) -> None:
    model = model_from_hf_config(TINY_LLAMA, name="tiny-llama")
    stage = estimate(model, _job(precision, rank)).stages[0]
    projected = kept = 0
    for rows, cols in LAYER_WEIGHTS * 2:
        r = min(rank, rows, cols)
        # P: a compact r x min copy from 16 bits; from fp32 a view keeping the SVD's min x min factor
        p = min(rows, cols) ** 2 if element == 4 else r * min(rows, cols)
        kept += p + 2 * r * max(rows, cols)
        projected += rows * cols
    total = stage.parameters_numel
    assert total == 2 * 1024 * 128 + 2 * (sum(r * c for r, c in LAYER_WEIGHTS) + 2 * 128) + 128
    assert stage.optimizer_moments_bytes == element * (2 * (total - projected) + kept)


def test_a_higher_rank_costs_more_and_adamw_bounds_it() -> None:
    model = load_model("llama-3.2-1b")
    adamw = estimate(model, Job(framework="hf", optimizer=Optimizer(name="adamw"))).stages[0].optimizer_moments_bytes
    low, high = (estimate(model, _job("bf16-mixed", r)).stages[0].optimizer_moments_bytes for r in (128, 512))
    assert low < high < adamw


def test_the_estimate_says_what_it_priced() -> None:
    result = estimate(model_from_hf_config(TINY_LLAMA, name="tiny-llama"), _job())
    assert any("rank-16 GaLore projection" in line for line in result.assumptions)


@pytest.mark.parametrize(("flags", "words"), [
    (["--framework", "megatron"], "cannot run under --framework megatron"),
    (["--framework", "deepspeed"], "cannot run under --framework deepspeed"),
    (["--framework", "torchtitan"], "cannot run under --framework torchtitan"),
    (["--framework", "hf", "--gpus", "2", "--zero", "2"], "ZeRO, FSDP and tensor parallelism split them"),
    (["--framework", "hf", "--gpus", "2", "--fsdp", "full"], "ZeRO, FSDP and tensor parallelism split them"),
    (["--framework", "hf", "--gpus", "2", "--tp", "2"], "ZeRO, FSDP and tensor parallelism split them"),
    (["--framework", "hf", "--peft", "lora"], "adapters, frozen or quantized weights"),
    (["--framework", "hf", "--optimizer-impl", "fused"], "has the for-loop implementation"),
])
def test_refused_where_it_cannot_run_with_one_line(flags: list[str], words: str) -> None:
    assert_refused("galore-adamw", flags, words)


def test_galore_rank_only_with_galore() -> None:
    with pytest.raises(ConfigError, match="galore-rank: only applies with --optimizer galore-adamw"):
        check_conflicts({"optimizer": "adamw", "galore_rank": 64})
    result = runner.invoke(app, ["estimate", "llama-3.2-1b", "--galore-rank", "64"])
    assert result.exit_code == 2 and "only applies with --optimizer galore-adamw" in " ".join(result.output.split())
    with pytest.raises(ConfigError, match="galore-rank"):
        Optimizer(name="galore-adamw", galore_rank=0)


def test_a_model_without_linear_projections_is_refused() -> None:
    with pytest.raises(ConfigError, match="Conv1D"):
        estimate(load_model("gpt2"), _job())


def test_hugging_face_optim_names_it_and_its_rank(tmp_path: Path) -> None:
    from memplan.inputs import JobRequest, load_job

    args = tmp_path / "args.json"
    args.write_text(json.dumps({"model_name_or_path": "meta-llama/Llama-3.2-1B", "optim": "galore_adamw",
                                "optim_args": "rank=64, update_proj_gap=100, scale=0.25",
                                "optim_target_modules": ["attn", "mlp"], "per_device_train_batch_size": 1}))
    loaded = load_job(JobRequest(model="llama-3.2-1b", hf_args=str(args)))
    assert loaded.job.optimizer.name == "galore-adamw" and loaded.job.optimizer.galore_rank == 64
    settings = {s.key: s for s in loaded.settings}
    assert settings["optim_args"].effect == "modelled" and "rank → --galore-rank 64" in settings["optim_args"].note


def test_the_server_refuses_it_as_the_command_line_does() -> None:
    from starlette.testclient import TestClient

    from memplan.serve import create_app

    with TestClient(create_app()) as client:
        response = client.post("/v1/estimate", json={"model": "llama-3.2-1b", "framework": "megatron",
                                                     "optimizer": "galore-adamw"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["field"] == "optimizer" and "cannot run under --framework megatron" in error["message"]


@pytest.mark.parametrize(("precision", "rank"), [("fp32", 16), ("bf16", 16), ("bf16", 64), ("bf16-mixed", 16)])
def test_tracer_and_estimator_agree(tiny_llama: str, precision: str, rank: int) -> None:
    """The real GaLoreAdamW on fake tensors (torch.linalg.svd runs on them) against the estimate: the states
    within 2.5% (a refresh keeps the previous projection one moment longer), the peak within 1%."""
    pytest.importorskip("galore_torch")
    from memplan.trace.api import trace
    from memplan.trace.compare import compare_with_estimate

    result = trace(tiny_llama, seq=8, mbs=1, precision=precision, optimizer="galore-adamw", galore_rank=rank,
                   framework="hf", device="cuda")
    rows = {row.category: row for row in compare_with_estimate(tiny_llama, result.options, result.summary).rows}
    states, peak = rows["optimizer_state"], rows["peak allocated"]
    assert states.estimated_bytes <= states.traced_bytes <= states.estimated_bytes * 1.025
    assert abs(peak.estimated_bytes - peak.traced_bytes) <= 0.01 * peak.traced_bytes
    assert result.summary.peak_phase == "optimizer"
