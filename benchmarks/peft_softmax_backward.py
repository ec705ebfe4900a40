"""An adapter layer's eager softmax backward: estimate vs trace (lead, session 17).

Usage: PYTHONPATH=src python benchmarks/peft_softmax_backward.py [--only NAME,...] [--json OUT]

Cells fixed before the estimator was changed (agreement-grid toy configs of tests/trace/test_agreement_grid.py,
``--framework hf``, AdamW foreach, mbs 2, eager attention, recompute none, 2 traced iterations): where an adapter
layer's peak is its attention core's softmax backward (two fp32 tensors of batch x heads x seq x seq), does the
estimate hold what the trace holds beside them? Figure: peak allocated (and activations), estimate vs trace.
Bound: within 0.1% each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.trace.test_agreement_grid import _COMMON, CONFIGS

HERE = Path(__file__).resolve().parent
BASE: dict[str, Any] = {"optimizer": "adamw", "optimizer_impl": "foreach", "mbs": 2, "attention": "eager",
                        "recompute": "none"}
#: name -> (toy config, seq, flags)
CELLS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "S1 DoRA q,v bf16-mixed s1024": ("llama", 1024, {"precision": "bf16-mixed", "peft": "dora",
                                                      "lora_targets": "q_proj,v_proj"}),
    "S2 LoRA q,v bf16-mixed s1024": ("llama", 1024, {"precision": "bf16-mixed", "peft": "lora",
                                                      "lora_targets": "q_proj,v_proj"}),
    "S3 LoRA all-linear bf16-mixed s1024": ("llama", 1024, {"precision": "bf16-mixed", "peft": "lora",
                                                             "lora_targets": "all-linear"}),
    "S4 LoRA q,v bf16 s1024": ("llama", 1024, {"precision": "bf16", "peft": "lora", "lora_targets": "q_proj,v_proj"}),
    "S5 LoRA q,v bf16-mixed s512 gemma2": ("gemma2", 512, {"precision": "bf16-mixed", "peft": "lora",
                                                            "lora_targets": "q_proj,v_proj"}),
    "S6 LoRA o_proj bf16-mixed s1024": ("llama", 1024, {"precision": "bf16-mixed", "peft": "lora",
                                                         "lora_targets": "o_proj"}),
}


def compare(config: Path, seq: int, flags: dict[str, Any]) -> dict[str, Any]:
    from memplan.trace import trace
    from memplan.trace.compare import compare_with_estimate

    start = time.perf_counter()
    result = trace(str(config), seq=seq, device="cuda", iterations=2, **BASE, **flags)
    rows = {r.category: {"traced_bytes": r.traced_bytes, "estimated_bytes": r.estimated_bytes,
                         "relative": r.relative}
            for r in compare_with_estimate(str(config), result.options, result.summary).rows
            if r.category in ("activation", "peak allocated")}
    return {"rows": rows, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated cell name prefixes (S1,S3)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    wanted = args.only.split(",") if args.only else None
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, (toy, seq, flags) in CELLS.items():
            if wanted and not any(name.startswith(w) for w in wanted):
                continue
            config = Path(folder) / f"{toy}.json"
            config.write_text(json.dumps({**_COMMON, **CONFIGS[toy]}), encoding="utf-8")
            out[name] = compare(config, seq, flags)
            peak = out[name]["rows"]["peak allocated"]
            print(f"| {name} | {peak['traced_bytes']:,} | {peak['estimated_bytes']:,} | {100 * peak['relative']:+.3f}% |",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
