"""Schedule-free AdamW: z and exp_avg_sq priced, traced with the schedulefree package, refused where it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optimizer_helpers import TINY_LLAMA, assert_refused
from typer.testing import CliRunner

from memplan.cli import app
from memplan.estimate.engine import estimate
from memplan.job import Batch, Job, Optimizer, Precision
from memplan.model.hf import model_from_hf_config

runner = CliRunner()


def _job(precision: str = "bf16", impl: str = "auto") -> Job:
    return Job(framework="hf", precision=Precision(name=precision),  # type: ignore[arg-type]
               optimizer=Optimizer(name="schedulefree-adamw", implementation=impl),  # type: ignore[arg-type]
               batch=Batch(micro_batch_size=1, seq_length=8))


@pytest.mark.parametrize(("precision", "element"), [("bf16", 2), ("fp32", 4), ("bf16-mixed", 4)])
def test_states_are_z_and_exp_avg_sq_like_the_parameter(precision: str, element: int) -> None:
    stage = estimate(model_from_hf_config(TINY_LLAMA, name="tiny"), _job(precision)).stages[0]
    assert stage.optimizer_moments_bytes == 2 * stage.parameters_numel * element


def test_the_step_is_foreach_unless_asked_for_the_for_loop() -> None:
    model = model_from_hf_config(TINY_LLAMA, name="tiny")
    foreach, loop = (estimate(model, _job("fp32", impl)).stages[0] for impl in ("auto", "for-loop"))
    numel = foreach.parameters_numel
    # foreach: denom for every parameter at once; for-loop: one of the largest (the 1024 x 128 embedding)
    assert foreach.peak_allocated_bytes - loop.peak_allocated_bytes == 4 * (numel - 1024 * 128)


@pytest.mark.parametrize(("flags", "words"), [
    (["--framework", "megatron"], "cannot run under --framework megatron"),
    (["--framework", "deepspeed"], "cannot run under --framework deepspeed"),
    (["--framework", "torchtitan"], "cannot run under --framework torchtitan"),
    (["--framework", "hf", "--optimizer-impl", "fused"], "has the foreach and for-loop implementations"),
])
def test_refused_where_it_cannot_run_with_one_line(flags: list[str], words: str) -> None:
    assert_refused("schedulefree-adamw", flags, words)


def test_it_shards_like_adamw() -> None:
    result = runner.invoke(app, ["estimate", "llama-3.2-1b", "--optimizer", "schedulefree-adamw", "--framework",
                                 "hf", "--gpus", "4", "--fsdp", "full", "--json"])
    assert result.exit_code == 0, result.output


def test_dialects_name_it_or_refuse_it(tmp_path: Path) -> None:
    from memplan.inputs import JobRequest, load_job

    args = tmp_path / "args.json"
    args.write_text(json.dumps({"optim": "schedule_free_adamw", "per_device_train_batch_size": 1}))
    assert load_job(JobRequest(model="llama-3.2-1b", hf_args=str(args))).job.optimizer.name == "schedulefree-adamw"
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "AdamWScheduleFree"}, "zero_optimization": {"stage": 1}}))
    result = runner.invoke(app, ["estimate", "llama-3.2-1b", "--deepspeed-config", str(ds)])
    assert result.exit_code != 0 and "optimizer.type" in result.output


def test_the_server_refuses_it_as_the_command_line_does() -> None:
    from starlette.testclient import TestClient

    from memplan.serve import create_app

    with TestClient(create_app()) as client:
        response = client.post("/v1/estimate", json={"model": "llama-3.2-1b", "framework": "torchtitan",
                                                     "optimizer": "schedulefree-adamw"})
    assert response.status_code == 400
    assert "cannot run under --framework torchtitan" in response.json()["error"]["message"]


@pytest.mark.parametrize(("precision", "impl"), [("fp32", "auto"), ("bf16", "auto"), ("bf16-mixed", "for-loop")])
def test_tracer_and_estimator_agree(tiny_llama: str, precision: str, impl: str) -> None:
    """The real AdamWScheduleFree (in train mode) on fake tensors against the estimate: states exact, peak
    within 0.5% (foreach) or 1% (for-loop: the previous parameter's ``denom`` is still referenced while the next
    one is made, which the one-largest-tensor price leaves out)."""
    pytest.importorskip("schedulefree")
    from memplan.trace.api import trace
    from memplan.trace.compare import compare_with_estimate

    result = trace(tiny_llama, seq=8, mbs=1, precision=precision, optimizer="schedulefree-adamw",
                   optimizer_impl=impl, framework="hf", device="cuda")
    rows = {row.category: row for row in compare_with_estimate(tiny_llama, result.options, result.summary).rows}
    assert rows["optimizer_state"].estimated_bytes == rows["optimizer_state"].traced_bytes
    peak = rows["peak allocated"]
    tolerance = 0.01 if impl == "for-loop" else 0.005
    assert abs(peak.estimated_bytes - peak.traced_bytes) <= tolerance * peak.traced_bytes
