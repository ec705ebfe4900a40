"""Trace witnesses for --offload-activations (save_on_cpu) mixed with fine-tuning, MoE, recompute, fused losses
and the optimizer in the backward: memplan estimate (hf profile) against memplan trace, one rank.

Every witness was fixed before it was run (helper offwit10, 2026-12-07): the mechanism mixes of the golden
record's random jobs whose peaks 134cb13 lowered (their numbers in ``golden``), on the agreement grid's toys
and on published configs cut to a few layers (``cut``). What the tracer refuses (FP8, more than one rank with
offload, --offload-params/--offload-optimizer, memory-budget under hf, groups of recomputed layers) is recorded
with its refusal. Usage::

    PYTHONPATH=src python benchmarks/offload_witness.py OUT.json [NAME ...]

Run it against another tree by pointing PYTHONPATH at that tree's ``src`` (the before/after columns of
docs/benchmarks.md). Results: benchmarks/results/offload_witness.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.trace import TraceResult, trace
from memplan.trace.compare import compare_with_estimate

PRESETS = Path(__file__).resolve().parents[1] / "src" / "memplan" / "model" / "presets"
_COMMON = {"max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6}
_LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
          "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 2048, "tie_word_embeddings": False}
_QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
              "vocab_size": 2048, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}
#: The grid's toys (tests/trace/test_agreement_grid.py) and two made so that a layer's backward sets the peak.
TOYS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, **_LLAMA},
    "llama_4l": {**_COMMON, **_LLAMA, "num_hidden_layers": 4, "tie_word_embeddings": True},
    "llama_v256": {**_COMMON, **_LLAMA, "vocab_size": 256},
    "qwen3_moe": {**_COMMON, **_QWEN3_MOE},
    "qwen3_moe_wide": {**_COMMON, **_QWEN3_MOE, "moe_intermediate_size": 512, "vocab_size": 256, "num_experts": 32},
    "gemma2": {**_COMMON, "model_type": "gemma2", "hidden_size": 256, "intermediate_size": 768,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2,
               "vocab_size": 2048, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window": 128, "query_pre_attn_scalar": 64, "hidden_activation": "gelu_pytorch_tanh"},
    "gpt2": {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 8, "vocab_size": 2048, "n_positions": 1024,
             "bos_token_id": 0, "eos_token_id": 0},
    "gpt2_v256": {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 8, "vocab_size": 256,
                  "n_positions": 1024, "bos_token_id": 0, "eos_token_id": 0},
    "llama_v256_wide": {**_COMMON, **_LLAMA, "vocab_size": 256, "intermediate_size": 2048},
}
#: Published configs cut to fewer layers: (preset, layers).
CUT = {"mistral-7b-2l": ("mistral-7b", 2), "gpt2-xl-4l": ("gpt2-xl", 4), "llama-3.1-8b-2l": ("llama-3.1-8b", 2),
       "gemma-2-9b-2l": ("gemma-2-9b", 2), "qwen2.5-7b-2l": ("qwen2.5-7b", 2), "mixtral-8x7b-2l": ("mixtral-8x7b", 2)}
_QV = {"peft": "lora", "lora_targets": "q_proj,v_proj"}
_DORA = {"peft": "dora", "lora_targets": "all-linear"}
#: name: (config, seq, precision, attention, recompute, job flags beside --offload-activations, golden jobs)
WITNESSES: dict[str, tuple[str, int, str, str, str, dict[str, Any], str]] = {
    "int8_lora_full": ("llama", 256, "bf16-mixed", "sdpa", "full", {**_QV, "quantize_base": "int8"}, "695,2651"),
    "int8_lora_full_oib": ("llama", 256, "bf16-mixed", "sdpa", "full", {**_QV, "quantize_base": "int8", "optimizer": "adam",
                                                                          "optimizer_in_backward": True}, "2651"),
    "fp4_lora_full": ("llama", 256, "bf16-mixed", "sdpa", "full", {"peft": "lora", "lora_targets": "all-linear",
                                                                     "quantize_base": "fp4"}, "831"),
    "nf4_lora_none": ("llama", 256, "bf16-mixed", "sdpa", "none", {"peft": "lora", "lora_targets": "all-linear",
                                                                     "quantize_base": "nf4"}, "1829,1369"),
    "dora_full": ("llama", 256, "bf16-mixed", "sdpa", "full", _DORA, "1066"),
    "dora_none": ("llama", 256, "bf16-mixed", "sdpa", "none", _DORA, "1449"),
    "lora_qv_none": ("llama", 256, "bf16-mixed", "sdpa", "none", {**_QV, "lora_rank": 64}, "1457,2594"),
    "lora_qv_full4l_oib_fp32logits": ("llama_4l", 256, "bf16-mixed", "sdpa", "full", {
        **_QV, "recompute_layers": 2, "optimizer_in_backward": True, "loss": "fp32-logits"}, "2743"),
    "oib_none": ("llama", 256, "bf16-mixed", "sdpa", "none", {"optimizer": "adam", "optimizer_in_backward": True},
                 "2651,2743"),
    "fused_linear_dora_full": ("llama", 256, "bf16-mixed", "sdpa", "full", {**_DORA, "loss": "fused-linear"}, "1066"),
    "fused_linear_none": ("llama", 256, "bf16-mixed", "sdpa", "none", {"loss": "fused-linear"}, "1066,2796"),
    "gpt2_none": ("gpt2", 256, "bf16-mixed", "sdpa", "none", {}, "1676"),
    "moe_full": ("qwen3_moe", 256, "bf16-mixed", "sdpa", "full", {}, "494"),
    "moe_lora_full": ("qwen3_moe", 256, "bf16-mixed", "sdpa", "full", _QV, "695,1684"),
    "moe_lora_none": ("qwen3_moe", 256, "bf16-mixed", "sdpa", "none", {**_QV, "lora_rank": 16}, "1684"),
    "moe_membudget_lora": ("qwen3_moe", 256, "bf16-mixed", "sdpa", "memory-budget", {
        "memory_budget": 0.5, "peft": "lora", "lora_targets": "all-linear"}, "1369"),
    "gemma2_dora_full": ("gemma2", 256, "bf16-mixed", "eager", "full", _DORA, "1066"),
    "fsdp_offload_params_1rank": ("llama", 256, "bf16-mixed", "sdpa", "none", {"fsdp": "full", "offload_params": True},
                                  "1676,1449"),
    "fsdp2_refusal": ("llama", 256, "bf16-mixed", "sdpa", "none", {"fsdp": 2}, "multi-rank"),
    "fp8_refusal": ("llama", 256, "bf16-mixed", "sdpa", "none", {"fp8": "hybrid"}, "957,1332,2594,2796"),
    "R_mistral_lora_qv": ("mistral-7b-2l", 2048, "bf16-mixed", "sdpa", "none", {"mbs": 1, **_QV}, "2594,1457"),
    "R_mistral_int8_full": ("mistral-7b-2l", 2048, "bf16-mixed", "sdpa", "full", {"mbs": 1, **_QV,
                                                                                    "quantize_base": "int8"}, "2651,695"),
    "R_gpt2xl_none": ("gpt2-xl-4l", 512, "bf16-mixed", "sdpa", "none", {"mbs": 1}, "1676"),
    "R_llama8b_oib_fp32": ("llama-3.1-8b-2l", 2048, "bf16-mixed", "sdpa", "full", {
        "mbs": 1, **_QV, "optimizer_in_backward": True, "loss": "fp32-logits"}, "2743"),
    "R_gemma9b_dora_full": ("gemma-2-9b-2l", 1024, "bf16-mixed", "eager", "full", {"mbs": 1, **_DORA}, "1066"),
    "R_llama8b_eager": ("llama-3.1-8b-2l", 2048, "bf16-mixed", "eager", "none", {"mbs": 1}, "eager"),
    "R_qwen7b_fp4_full": ("qwen2.5-7b-2l", 2048, "bf16-mixed", "sdpa", "full", {
        "mbs": 1, "peft": "lora", "lora_targets": "all-linear", "quantize_base": "fp4"}, "831"),
    "R_mixtral_lora": ("mixtral-8x7b-2l", 1024, "bf16-mixed", "sdpa", "none", {"mbs": 1, **_QV, "lora_rank": 16}, "1684"),
    "R_mixtral_none": ("mixtral-8x7b-2l", 1024, "bf16-mixed", "sdpa", "none", {"mbs": 1}, "494"),
    "R_mixtral_full": ("mixtral-8x7b-2l", 1024, "bf16-mixed", "sdpa", "full", {"mbs": 1}, "494"),
    "R_mixtral_lora_int8_full": ("mixtral-8x7b-2l", 1024, "bf16-mixed", "sdpa", "full", {
        "mbs": 1, **_QV, "quantize_base": "int8"}, "695"),
    "C_moe_wide_lora": ("qwen3_moe_wide", 256, "bf16-mixed", "sdpa", "none", _QV, "grid cell"),
    "C_eager_lora": ("llama_v256", 512, "bf16-mixed", "eager", "none", _QV, "grid cell"),
    "C_eager_full": ("llama_v256", 512, "bf16-mixed", "eager", "none", {}, "eager"),
    "C_sdpa_full": ("llama_v256", 512, "bf16-mixed", "sdpa", "none", {}, "sdpa"),
    "C_gemma2_lora": ("gemma2", 256, "bf16-mixed", "eager", "none", _QV, "eager"),
    # helper offtoy11 (session 11): toys where a layer's MLP, not the loss, sets the peak
    "N_gpt2_v256_mbs4": ("gpt2_v256", 512, "bf16-mixed", "sdpa", "none", {"mbs": 4}, "1676"),
    "N_llama_wide_sdpa": ("llama_v256_wide", 512, "bf16-mixed", "sdpa", "none", {}, "sdpa"),
}
CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "logits", "peak allocated")


def config_paths(folder: Path) -> dict[str, str]:
    """The toys' and the cut presets' config.json paths in ``folder``."""
    paths = {}
    for name, config in TOYS.items():
        paths[name] = str(folder / f"{name}.json")
        Path(paths[name]).write_text(json.dumps(config), encoding="utf-8")
    for name, (preset, layers) in CUT.items():
        config = json.loads((PRESETS / f"{preset}.json").read_text(encoding="utf-8"))
        config.pop("_memplan", None)
        config["n_layer" if "n_layer" in config else "num_hidden_layers"] = layers
        paths[name] = str(folder / f"{name}.json")
        Path(paths[name]).write_text(json.dumps(config), encoding="utf-8")
    return paths


def run_cell(paths: dict[str, str], cell: tuple[str, int, str, str, str, dict[str, Any], str],
             also: Callable[[str, TraceResult], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Trace one cell (``--offload-activations`` unless its flags say otherwise) and compare it with the
    estimate; ``also``: more figures from the config's path and the trace, added to the row."""
    config, seq, precision, attention, recompute, extra, golden = cell
    flags = {"offload_activations": True, **extra}
    job = {"optimizer_impl": "foreach", "mbs": 2, "optimizer": "adamw", **flags}
    start = time.time()
    try:
        result = trace(paths[config], seq=seq, precision=precision, attention=attention, recompute=recompute,
                       device="cuda", iterations=2, **job)
        rows = {r.category: r for r in compare_with_estimate(paths[config], result.options, result.summary).rows}
        out: dict[str, Any] = {c: {"traced": rows[c].traced_bytes, "estimated": rows[c].estimated_bytes,
                                   "rel": rows[c].relative} for c in CATEGORIES if c in rows}
        out.update(also(paths[config], result) if also is not None else {})
    except MemplanError as error:  # a refusal (ConfigError, UnsupportedError) is a result here
        out = {"error": f"{type(error).__name__}: {error}"[:400]}
    out.update(seconds=round(time.time() - start, 1), cell=[config, seq, precision, attention, recompute, flags],
               golden_jobs=golden)
    return out


def run_all(argv: list[str], cells: dict[str, tuple[str, int, str, str, str, dict[str, Any], str]],
            also: Callable[[str, TraceResult], dict[str, Any]] | None = None) -> None:
    """Run ``cells`` (``argv``: the output file, then the names to run, all by default), writing the results
    as they come and printing each compared moment (the peak, and what ``also`` adds)."""
    out, names = Path(argv[0]), argv[1:] or list(cells)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        paths = config_paths(Path(folder))
        for name in names:
            results[name] = res = run_cell(paths, cells[name], also)
            moments = [f"{key} {row['traced']} est {row['estimated']} {row['rel']:+.4f}"
                       for key, row in res.items() if key in ("peak allocated", "layer backward")]
            print(name, res.get("error") or "; ".join(moments), flush=True)
            out.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    run_all(sys.argv[1:], WITNESSES)
