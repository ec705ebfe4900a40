"""Witness for ``--loss chunked --compile`` (torchtune's CEWithChunkedOutputLoss compiled as torchtune compiles it):
memplan estimate (profile of the cell's framework) against memplan trace, one rank, AdamW foreach, mbs 2, 2 iterations.

Cells fixed before they were run (helper chunk17, session 17): K1 llama_heavy seq 512 bf16-mixed sdpa none,
``--loss chunked --compile``, framework hf; K2 K1 under torchtitan; K3 K1 with LoRA r8 all-linear and full
recompute; K4 K1 in bf16; K5 gemma2_heavy (soft-capped) eager; controls C1 K1 without --compile and C2 K1 with
``--loss fp32-logits --compile``. Toys: tests/trace/test_agreement_grid.py's CONFIGS. A refusal is recorded as
its message. Usage::

    PYTHONPATH=src python benchmarks/compiled_chunked_loss.py OUT.json [NAME ...]

Run against another tree by pointing PYTHONPATH at that tree's ``src`` (the before/after columns of
docs/benchmarks.md). Results: benchmarks/results/compiled_chunked_loss.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate

_COMMON = {"max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6}
TOYS: dict[str, dict[str, Any]] = {
    "llama_heavy": {**_COMMON, "model_type": "llama", "hidden_size": 512, "intermediate_size": 2048,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 16384,
                    "tie_word_embeddings": True},
    "gemma2_heavy": {**_COMMON, "model_type": "gemma2", "hidden_size": 512, "intermediate_size": 2048,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 4,
                     "vocab_size": 32768, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                     "sliding_window": 128, "query_pre_attn_scalar": 128, "hidden_activation": "gelu_pytorch_tanh"},
}
_K1: dict[str, Any] = {"loss": "chunked", "compile": True}
_LORA = {"peft": "lora", "lora_rank": 8, "lora_targets": "all-linear"}
#: name: (toy, seq, precision, attention, recompute, flags)
CELLS: dict[str, tuple[str, int, str, str, str, dict[str, Any]]] = {
    "K1": ("llama_heavy", 512, "bf16-mixed", "sdpa", "none", {**_K1, "framework": "hf"}),
    "K2": ("llama_heavy", 512, "bf16-mixed", "sdpa", "none", {**_K1, "framework": "torchtitan"}),
    "K3": ("llama_heavy", 512, "bf16-mixed", "sdpa", "full", {**_K1, "framework": "hf", **_LORA}),
    "K4": ("llama_heavy", 512, "bf16", "sdpa", "none", {**_K1, "framework": "hf"}),
    "K5": ("gemma2_heavy", 512, "bf16-mixed", "eager", "none", {**_K1, "framework": "hf"}),
    "C1": ("llama_heavy", 512, "bf16-mixed", "sdpa", "none", {"loss": "chunked", "framework": "hf"}),
    "C2": ("llama_heavy", 512, "bf16-mixed", "sdpa", "none", {"loss": "fp32-logits", "compile": True,
                                                              "framework": "hf"}),
}
ROWS = ("peak allocated", "logits", "activation", "temporary")


def run_cell(folder: Path, name: str) -> dict[str, Any]:
    toy, seq, precision, attention, recompute, flags = CELLS[name]
    path = folder / f"{toy}.json"
    path.write_text(json.dumps(TOYS[toy]), encoding="utf-8")
    start = time.perf_counter()
    try:
        result = trace(str(path), seq=seq, precision=precision, attention=attention, recompute=recompute,
                       optimizer="adamw", optimizer_impl="foreach", mbs=2, device="cuda", iterations=2, **flags)
    except (MemplanError, ValueError, TypeError) as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    out: dict[str, Any] = {"seconds": round(time.perf_counter() - start, 1)}
    for key in ROWS:
        if key in rows:
            row = rows[key]
            out[key] = {"trace": row.traced_bytes, "estimate": row.estimated_bytes,
                        "relative": None if row.relative is None else round(row.relative, 4)}
    return out


def main(argv: list[str]) -> None:
    names = argv[1:] or list(CELLS)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out[name] = run_cell(Path(tmp), name)
            cell = out[name]
            print(name, json.dumps({k: (v["relative"] if isinstance(v, dict) and "relative" in v else v)
                                    for k, v in cell.items()}), flush=True)
    Path(argv[0]).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
