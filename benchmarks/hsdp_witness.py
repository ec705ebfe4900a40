"""Trace witnesses for ``--fsdp hybrid`` (FSDP2 HSDP: ``fully_shard`` on a 2-D (replicate, shard) mesh):
memplan estimate against memplan trace, with the same jobs under ``--fsdp full`` as controls.

The cells were fixed before they were run (helper hsdp17, session 17, brief hsdp17): the agreement grid's toy
llama (tests/trace/test_agreement_grid.py ``CONFIGS["llama"]``), seq 256, mbs 2, bf16-mixed, sdpa, AdamW
(foreach, as the grid), ``--framework torchtitan`` unless the cell says otherwise:

* Y1 4 ranks: 2 replicas x 2 shards; Y2 Y1 with full recompute; Y3 Y1 under ``--framework hf``;
* Y4 8 ranks: 2 replicas x 4 shards; Y5 8 ranks: 4 replicas x 2 shards;
* controls ``<cell>_full<N>``: the same job with ``--fsdp full`` over N ranks (the shard group's size, and all ranks).

Fine-tuning cells (helper hybridft18, session 18, fixed before they were run): the same toy, seq, mbs, precision,
attention and optimizer, ``--framework hf`` unless said, peft adapters r 8 on a bf16-mixed FSDP2 job:

* V1 LoRA q,v, 2 replicas x 2 shards (4 ranks); V2 V1 with full recompute; V3 LoRA all-linear 2 x 2;
* V4 DoRA q,v 2 x 2; V5 V1 under ``--framework torchtitan``; V6 V1 at 2 replicas x 4 shards (8 ranks);
* controls ``<cell>_full<N>``: the same job with ``--fsdp full`` over the shard group's N ranks.

A refusal (the trace before hybrid was traced) is a result here. Usage::

    PYTHONPATH=src python benchmarks/hsdp_witness.py OUT.json [NAME ...]

Run it against another tree by pointing PYTHONPATH at that tree's ``src`` (the before/after columns of
docs/benchmarks.md). Results: benchmarks/results/hsdp_witness.json (the Y cells),
benchmarks/results/hsdp_finetune_witness.json (the V cells).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.estimate.engine import estimate
from memplan.jobflags import build_job
from memplan.model import load_model
from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate

LLAMA = {"max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6,
         "model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 2048, "tie_word_embeddings": False}
_BASE = {"framework": "torchtitan", "recompute": "none"}
#: name: job flags beside the common ones (``fsdp: N`` with ``gpus``: hybrid groups of N, or full when N = gpus)
HYBRID: dict[str, dict[str, Any]] = {
    "Y1": {**_BASE, "gpus": 4, "fsdp": 2},
    "Y2": {**_BASE, "gpus": 4, "fsdp": 2, "recompute": "full"},
    "Y3": {**_BASE, "gpus": 4, "fsdp": 2, "framework": "hf"},
    "Y4": {**_BASE, "gpus": 8, "fsdp": 4},
    "Y5": {**_BASE, "gpus": 8, "fsdp": 2},
}
_LORA = {"framework": "hf", "recompute": "none", "gpus": 4, "fsdp": 2, "peft": "lora", "lora_rank": 8,
         "lora_targets": "q_proj,v_proj"}
#: the fine-tuning cells (hybridft18): peft adapters under hybrid sharding
FINETUNE: dict[str, dict[str, Any]] = {
    "V1": _LORA,
    "V2": {**_LORA, "recompute": "full"},
    "V3": {**_LORA, "lora_targets": "all-linear"},
    "V4": {**_LORA, "peft": "dora"},
    "V5": {**_LORA, "framework": "torchtitan"},
    "V6": {**_LORA, "gpus": 8, "fsdp": 4},
}


def _controls() -> dict[str, dict[str, Any]]:
    out = {}
    for name, flags in HYBRID.items():
        for ranks in (flags["fsdp"], flags["gpus"]):
            out[f"{name}_full{ranks}"] = {**flags, "gpus": ranks, "fsdp": ranks}
    for name, flags in FINETUNE.items():
        out[f"{name}_full{flags['fsdp']}"] = {**flags, "gpus": flags["fsdp"]}
    return out


CELLS = {**HYBRID, **FINETUNE, **_controls()}
CATEGORIES = ("parameter", "gradient", "optimizer_state", "communication", "activation", "logits", "peak allocated")


def run_cell(path: str, flags: dict[str, Any]) -> dict[str, Any]:
    """Estimate the cell, then trace it and compare category by category (a refusal is recorded)."""
    flags = dict(flags)
    recompute = flags.pop("recompute")
    job = {"optimizer_impl": "foreach", "mbs": 2, "optimizer": "adamw", **flags}
    start = time.time()
    est = estimate(load_model(path), build_job({"seq": 256, "precision": "bf16-mixed", "attention": "sdpa",
                                                "recompute": recompute, **job}))
    # the peak the comparison reads: less the library workspaces a fake-tensor trace never allocates
    out: dict[str, Any] = {"estimate": est.peak_allocated_bytes, "estimate_reserved": est.peak_reserved_bytes,
                           "estimate_compared": est.peak_allocated_bytes - est.stages[0].workspace_bytes}
    try:
        result = trace(path, seq=256, precision="bf16-mixed", attention="sdpa", recompute=recompute,
                       device="cuda", iterations=2, **job)
        rows = {r.category: r for r in compare_with_estimate(path, result.options, result.summary).rows}
        out.update({c: {"traced": rows[c].traced_bytes, "estimated": rows[c].estimated_bytes,
                        "rel": rows[c].relative} for c in CATEGORIES if c in rows})
        reserved = result.summary.reserved
        out["trace_reserved"] = reserved.peak_reserved_bytes if reserved is not None else None
    except MemplanError as error:
        out["error"] = f"{type(error).__name__}: {error}"[:400]
    out.update(seconds=round(time.time() - start, 1), flags={**job, "recompute": recompute})
    return out


def main(argv: list[str]) -> None:
    out, names = Path(argv[0]), argv[1:] or list(CELLS)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "llama.json")
        Path(path).write_text(json.dumps(LLAMA), encoding="utf-8")
        for name in names:
            results[name] = res = run_cell(path, CELLS[name])
            shown = [f"{c} {res[c]['traced']} est {res[c]['estimated']} {res[c]['rel'] or 0:+.4f}"
                     for c in CATEGORIES if c in res]
            print(name, f"estimate {res['estimate_compared']}", res.get("error") or "; ".join(shown), flush=True)
            out.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
