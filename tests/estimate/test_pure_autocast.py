"""accelerate's autocast over a 16-bit model (:mod:`memplan.estimate.pure_autocast`): the HF Trainer's ``--bf16`` /
``--fp16`` with the model loaded in that dtype still runs the forward under ``torch.autocast``; CUDA autocast's fp32
ops (GPT-2's LayerNorms, ``gelu_new``'s ``pow`` chain) return fp32. Peaks against ``memplan trace`` on the agreement
grid's gpt2 toy (benchmarks/tracefid18_witness.py, cells A5 and A7: trace peaks measured with the autocast)."""

from __future__ import annotations

import json

import pytest

from memplan.estimate import estimate, pure_autocast
from memplan.jobflags import build_job
from memplan.model import load_model
from memplan.profiles import get_profile

_GPT2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 8, "vocab_size": 256, "n_positions": 1024,
         "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6}
#: the witness's A5 (eager) and A7 (sdpa): hf, bf16, seq 256, mbs 2, no recompute, AdamW foreach; the trace's peak
TRACED = {"eager": 53_287_424, "sdpa": 40_739_328}


@pytest.mark.parametrize(("framework", "precision", "flags", "expected"), [
    ("hf", "bf16", {}, True), ("hf", "fp16", {}, True), ("hf", "bf16-mixed", {}, False), ("hf", "fp32", {}, False),
    ("torchtitan", "bf16", {}, False), ("deepspeed", "bf16", {}, False)])
def test_applies_where_accelerate_autocasts_16_bit_weights(framework: str, precision: str, flags: dict,
                                                           expected: bool) -> None:
    job = build_job({"framework": framework, "precision": precision, **flags})
    assert pure_autocast.applies(job, get_profile(framework)) is expected


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_gpt2_pure_bf16_peak_agrees_with_the_autocast_trace(tmp_path, attention: str) -> None:
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(_GPT2), encoding="utf-8")
    job = build_job({"framework": "hf", "precision": "bf16", "seq": 256, "mbs": 2, "attention": attention,
                     "optimizer": "adamw", "optimizer_impl": "foreach", "gpus": 1})
    result = estimate(load_model(str(path)), job)
    peak = result.peak_allocated_bytes - result.stages[0].workspace_bytes
    assert abs(peak - TRACED[attention]) / TRACED[attention] <= 0.03, peak
    assert any("accelerate's native_amp" in a for a in result.assumptions)


def test_zero_runs_deepspeeds_engine_without_autocast(tmp_path) -> None:
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(_GPT2), encoding="utf-8")
    job = build_job({"framework": "hf", "precision": "bf16", "seq": 256, "mbs": 2, "attention": "eager", "zero": 2,
                     "gpus": 2})
    result = estimate(load_model(str(path)), job)
    assert not any("accelerate's native_amp" in a for a in result.assumptions)
