"""Witness for torchtune's chunked-output loss (``--loss chunked``) under FSDP (helper chunkfsdp18, session 18):
memplan estimate (the cell's framework profile) against ``memplan trace``, AdamW foreach, 2 iterations,
``--device cuda``; rows as :func:`memplan.trace.compare.compare_with_estimate`. A refusal is recorded as its message.

Cells fixed before they were run. Toys: tests/trace/test_agreement_grid.py's CONFIGS ``llama`` (untied head, v2048:
accelerate's [norm, head] unit) and ``llama_heavy`` (tied head: one root unit); seq 256, mbs 2, bf16-mixed, sdpa:
F1 hf ``--fsdp full --gpus 2``; F2 F1 under torchtitan; F3 F1 with full recompute; F4 F1 with LoRA r8 on q_proj,v_proj;
F5 hf ``--fsdp full --gpus 1``. K1 and K3: helper chunk17's cells (benchmarks/compiled_chunked_loss.py: llama_heavy
seq 512, one rank, ``--compile``; K3 with LoRA r8 all-linear and full recompute). Usage::

    PYTHONPATH=src python benchmarks/chunked_fsdp_witness.py OUT.json [NAME ...]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memplan.errors import MemplanError  # noqa: E402
from memplan.trace import trace  # noqa: E402
from memplan.trace.compare import compare_with_estimate  # noqa: E402
from tests.trace.test_agreement_grid import CONFIGS  # noqa: E402

_FSDP2 = {"fsdp": "full", "gpus": 2}
_QV = {"peft": "lora", "lora_rank": 8, "lora_targets": "q_proj,v_proj"}
_LORA_ALL = {"peft": "lora", "lora_rank": 8, "lora_targets": "all-linear"}
#: cell -> (seq, recompute, flags); each F cell runs on both toys (name/llama, name/llama_heavy)
F_CELLS: dict[str, tuple[int, str, dict[str, Any]]] = {
    "F1": (256, "none", {"framework": "hf", **_FSDP2}),
    "F2": (256, "none", {"framework": "torchtitan", **_FSDP2}),
    "F3": (256, "full", {"framework": "hf", **_FSDP2}),
    "F4": (256, "none", {"framework": "hf", **_FSDP2, **_QV}),
    "F5": (256, "none", {"framework": "hf", "fsdp": "full", "gpus": 1}),
}
CELLS: dict[str, tuple[str, int, str, dict[str, Any]]] = {
    f"{name}/{toy}": (toy, seq, recompute, flags) for name, (seq, recompute, flags) in F_CELLS.items()
    for toy in ("llama", "llama_heavy")}
CELLS["K1"] = ("llama_heavy", 512, "none", {"framework": "hf", "compile": True})
CELLS["K3"] = ("llama_heavy", 512, "full", {"framework": "hf", "compile": True, **_LORA_ALL})
ROWS = ("peak allocated", "logits", "activation", "temporary", "communication")


def run_cell(folder: Path, name: str) -> dict[str, Any]:
    toy, seq, recompute, flags = CELLS[name]
    path = folder / f"{toy}.json"
    config = {"max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6,
              **CONFIGS[toy]}
    path.write_text(json.dumps(config), encoding="utf-8")
    start = time.perf_counter()
    try:
        result = trace(str(path), seq=seq, precision="bf16-mixed", attention="sdpa", recompute=recompute,
                       optimizer="adamw", optimizer_impl="foreach", mbs=2, device="cuda", iterations=2,
                       loss="chunked", **flags)
    except (MemplanError, ValueError, TypeError) as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    out: dict[str, Any] = {"seconds": round(time.perf_counter() - start, 1)}
    for key in ROWS:
        if key in rows:
            row = rows[key]
            out[key] = {"trace": row.traced_bytes, "estimate": row.estimated_bytes,
                        "relative": None if row.relative is None else round(row.relative, 5)}
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
