"""torchtitan's own model code (a job read from a torchtitan TOML) against transformers' modules.

The same shapes and the same loop (``--framework torchtitan``) keep different tensors: torchtitan's
fused ``nn.RMSNorm``, its ``freqs_cis`` buffer, its SDPA wrapper (no memory-efficient kernel) and its
DTensor sequence parallelism. Checked term by term here; against ``memplan trace --torchtitan`` in
tests/trace/test_torchtitan_trace.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from memplan.estimate.activations import divided, layer_terms
from memplan.estimate.context import activation_shape as _activation_shape
from memplan.estimate.engine import estimate
from memplan.estimate.extras import rope_table_bytes
from memplan.estimate.precision import resolve_precision
from memplan.frameworks.model_code import HF_MODEL_CODE, TORCHTITAN_MODEL_CODE, model_code, sdpa_attention
from memplan.profiles.framework import TORCHTITAN
from memplan.inputs import JobRequest, load_job
from memplan.job import Job
from memplan.model.spec import ModelSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "torchtitan"
MODEL = str(DATA / "llama3_debugmodel_config.json")
TOKENS, HIDDEN = 2 * 256, 256  # the debug TOML: two sequences of 256 per rank, dim 256


def _toml(tmp_path: Path, tp: int = 1, ac: str = "none") -> str:
    body = (DATA / "llama3_debug.toml").read_text(encoding="utf-8")
    body = body.replace('mode = "full"', f'mode = "{ac}"').replace("tensor_parallel_degree = 1",
                                                                    f"tensor_parallel_degree = {tp}")
    path = tmp_path / f"debug_tp{tp}_{ac}.toml"
    path.write_text(body, encoding="utf-8")
    return str(path)


def _jobs(tmp_path: Path, gpus: int, tp: int = 1) -> tuple[ModelSpec, Job, Job]:
    """(model, the TOML's job, the same job as transformers' modules would run it)."""
    loaded = load_job(JobRequest(model=MODEL, torchtitan_config=_toml(tmp_path, tp), flags={"gpus": gpus}))
    assert loaded.job.torchtitan_model and model_code(loaded.job) is TORCHTITAN_MODEL_CODE
    return loaded.model, loaded.job, replace(loaded.job, torchtitan_model=False)


def _terms(model: ModelSpec, job: Job) -> dict[str, int]:
    shape = _activation_shape(model, job, TORCHTITAN, resolve_precision(job, TORCHTITAN))
    return {t.name: divided(t, shape) for t in layer_terms(model.layers[0], shape)}


def test_sdpa_wrapper_has_only_math_for_fp32() -> None:
    assert sdpa_attention(TORCHTITAN_MODEL_CODE, "flash", 4) == "math"
    assert sdpa_attention(TORCHTITAN_MODEL_CODE, "sdpa", 2) == "sdpa"
    assert sdpa_attention(TORCHTITAN_MODEL_CODE, "eager", 4) == "eager"
    assert sdpa_attention(HF_MODEL_CODE, "flash", 4) == "flash"  # the efficient kernel takes fp32


def test_fused_rms_norm_keeps_its_input_and_fp32_rstd_only(tmp_path: Path) -> None:
    model, titan, hf = _jobs(tmp_path, gpus=4)  # FSDP: bf16 activations
    ours, theirs = _terms(model, titan), _terms(model, hf)
    rstd = 4 * TOKENS
    assert ours["attention norm 1/rms (fp32, per token)"] == rstd
    assert "attention norm fp32 input" not in ours and theirs["attention norm fp32 input"] == 4 * TOKENS * HIDDEN
    assert sum(theirs.values()) - sum(ours.values()) == 2 * 4 * TOKENS * HIDDEN  # two norms per layer
    # no cos/sin tables: torchtitan reads its freqs_cis buffer
    shape = _activation_shape(model, titan, TORCHTITAN, resolve_precision(titan, TORCHTITAN))
    assert rope_table_bytes(model, shape) == 0
    hf_shape = _activation_shape(model, hf, TORCHTITAN, resolve_precision(hf, TORCHTITAN))
    assert rope_table_bytes(model, hf_shape) > 0
    assert any("fused one" in a for a in estimate(model, titan).assumptions)
    assert not any("fused one" in a for a in estimate(model, hf).assumptions)


def test_tp_without_fsdp_is_fp32_math_attention_with_gathered_gemm_inputs(tmp_path: Path) -> None:
    model, titan, _hf = _jobs(tmp_path, gpus=2, tp=2)
    assert resolve_precision(titan, TORCHTITAN).compute == "fp32"
    terms = _terms(model, titan)
    heads = 16 // 2
    assert terms["softmax output (fp32)"] == heads * 2 * 256 * 256 * 4
    assert "flash log-sum-exp" not in terms
    # the q/k/v input is the all-gathered sequence (whole, fp32), the norm input its shard
    assert terms["attention norm output (GEMM input)"] == 4 * TOKENS * HIDDEN
    assert terms["attention norm input"] == 4 * TOKENS * HIDDEN // 2


def test_a_typed_framework_prices_its_own_code(tmp_path: Path) -> None:
    """``--torchtitan-config FILE --framework hf``: the typed framework wins, with transformers' modules."""
    loaded = load_job(JobRequest(model=MODEL, torchtitan_config=_toml(tmp_path), flags={"gpus": 2, "framework": "hf"}))
    assert loaded.job.framework == "hf" and model_code(loaded.job) is HF_MODEL_CODE
    assert model_code(Job(framework="torchtitan", torchtitan_model=True)) is TORCHTITAN_MODEL_CODE
    assert model_code(Job(framework="torchtitan")) is HF_MODEL_CODE
