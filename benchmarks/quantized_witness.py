"""Trace witnesses for a fine-tuned layer on a bitsandbytes-quantized base (``--quantize-base int8``,
``nf4``) under full recompute, with and without ``--offload-activations``: memplan estimate (hf profile)
against memplan trace, one rank.

The cells were fixed before they were run (helper int8rc11, 2026-12-07): offwit10's two int8 witnesses that
peaked in a recomputed layer's backward (``R_mistral_int8_full``, ``R_mixtral_lora_int8_full``), each also
without the offload, mistral's int8 LoRA without recompute, a 4-bit NF4 full-recompute cell and a new int8
cell (qwen2.5-7b cut to 2 layers, s1024). Configs: :data:`offload_witness.CUT`. Usage::

    PYTHONPATH=src python benchmarks/quantized_witness.py OUT.json [NAME ...]

Results: benchmarks/results/quantized_witness.json.
"""

from __future__ import annotations

import sys
from typing import Any

from offload_witness import WITNESSES as OFFLOAD_WITNESSES
from offload_witness import run_all

from memplan.estimate.engine import DEFAULT_FRAGMENTATION, _stage_parts
from memplan.estimate.ledger import WORKSPACE
from memplan.estimate.memo import Same
from memplan.model import load_model
from memplan.trace import TraceResult
from memplan.trace.compare import estimate_job
from memplan.trace.cuda.rounding import cuda_allocated_size

_QV = {"peft": "lora", "lora_targets": "q_proj,v_proj"}
_NO_OFFLOAD = {"offload_activations": False}
#: name: (config, seq, precision, attention, recompute, job flags, where the cell comes from)
WITNESSES: dict[str, tuple[str, int, str, str, str, dict[str, Any], str]] = {
    "R_mistral_int8_full": OFFLOAD_WITNESSES["R_mistral_int8_full"][:6] + ("offload_witness",),
    "R_mistral_int8_full_nooff": ("mistral-7b-2l", 2048, "bf16-mixed", "sdpa", "full", {
        "mbs": 1, **_QV, "quantize_base": "int8", **_NO_OFFLOAD}, "offload_witness, no offload"),
    "R_mixtral_lora_int8_full": OFFLOAD_WITNESSES["R_mixtral_lora_int8_full"][:6] + ("offload_witness",),
    "R_mixtral_lora_int8_full_nooff": ("mixtral-8x7b-2l", 1024, "bf16-mixed", "sdpa", "full", {
        "mbs": 1, **_QV, "quantize_base": "int8", **_NO_OFFLOAD}, "offload_witness, no offload"),
    "R_mistral_int8_none_nooff": ("mistral-7b-2l", 2048, "bf16-mixed", "sdpa", "none", {
        "mbs": 1, **_QV, "quantize_base": "int8", **_NO_OFFLOAD}, "no recompute"),
    "R_qwen7b_nf4_full_nooff": ("qwen2.5-7b-2l", 2048, "bf16-mixed", "sdpa", "full", {
        "mbs": 1, "peft": "lora", "lora_targets": "all-linear", "quantize_base": "nf4", **_NO_OFFLOAD},
        "4-bit"),
    "R_qwen7b_int8_full_nooff": ("qwen2.5-7b-2l", 1024, "bf16-mixed", "sdpa", "full", {
        "mbs": 1, **_QV, "quantize_base": "int8", **_NO_OFFLOAD}, "new int8 cell"),
}


def layer_backward(config: str, result: TraceResult) -> dict[str, Any]:
    """The worst moment of a decoder layer's backward (its recompute included) in the trace's last iteration
    against the estimate's "backward" moment (workspaces aside): the moment the peak hides when the loss sets
    it."""
    events = result.trace.events
    last = events[-1].iteration
    live = traced = 0
    for event in events:
        live += cuda_allocated_size(event.size) * (1 if event.is_alloc else -1)
        if event.iteration == last and event.phase == "backward" and ".layers." in event.module:
            traced = max(traced, live)
    job = estimate_job(result.options)
    _, parts = _stage_parts(Same(load_model(config)), job, DEFAULT_FRAGMENTATION)
    ledger = parts[0][2].ledger
    estimated = ledger.allocated_at("backward") - ledger.total(WORKSPACE)
    return {"layer backward": {"traced": traced, "estimated": estimated, "rel": estimated / traced - 1}}


if __name__ == "__main__":
    run_all(sys.argv[1:], WITNESSES, layer_backward)
