"""A checkpoint stored quantized (config.json ``quantization_config``) is never priced silently: the estimate says
how its weights are priced, whatever the format (MXFP4's own sentence is tests/estimate/test_gpt_oss.py's)."""

from __future__ import annotations

from memplan.estimate import estimate
from memplan.estimate.run_notes import DEQUANTIZED_AT_LOAD, checkpoint_quantization_note
from memplan.jobflags import build_job
from memplan.model import load_model, model_from_hf_config

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024}


def test_an_fp8_checkpoint_is_said_and_priced_in_the_jobs_dtypes():
    job = build_job({"framework": "hf", "seq": 512})
    fp8 = model_from_hf_config({**LLAMA, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, name="t")
    plain = model_from_hf_config(LLAMA, name="t")
    said, unsaid = estimate(fp8, job), estimate(plain, job)
    note = checkpoint_quantization_note("fp8")
    assert note in said.assumptions and note not in unsaid.assumptions
    assert "quant_method: fp8" in note and "not modelled" in note
    assert said.peak_allocated_bytes == unsaid.peak_allocated_bytes


def test_the_deepseek_v3_preset_says_its_fp8_checkpoint():
    spec = load_model("deepseek-v3")
    assert spec.checkpoint_quantization == "fp8"
    job = build_job({"gpus": 1024, "tp": 2, "pp": 16, "ep": 8})
    assert checkpoint_quantization_note("fp8") in estimate(spec, job).assumptions


def test_a_format_loaded_dequantized_keeps_its_own_sentence():
    assert checkpoint_quantization_note("mxfp4") == DEQUANTIZED_AT_LOAD["mxfp4"]
