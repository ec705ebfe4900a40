"""Fine-tuning moments: estimate vs trace on the agreement grid's fine-tuning cells (helper peftmom18, session 18).

Usage: PYTHONPATH=src:. python benchmarks/peft_moments18.py [--only NAME,...] [--json OUT]

Cells fixed before the estimator was changed (toy configs of tests/trace/test_agreement_grid.py, ``--framework hf``,
AdamW foreach, mbs 2, 2 traced iterations; figure: peak allocated, estimate vs ``memplan trace``; bound 0.15%):

- W1: every fine-tuning cell of tests/trace/test_agreement_grid.py (``peft`` or ``trainable`` set) and its gpt_oss
  cells, named ``G<index in CELLS>``; beyond 0.15% at f30d0e2 makes a W1 witness, the rest are controls.
- W2: bw16's leftovers on the toy llama (eager attention, bf16-mixed, seq 256, mbs 2, recompute none):
  W2a a trained eager core's forward moment (the q/k/v projections of every layer trained, the rest frozen),
  W2b the same for layer 1's q/k/v only, W2c DoRA on k_proj,v_proj (the weight-norm step at a later q/k/v
  projection), W2d DoRA on q_proj,o_proj (a q/o tie).
- W3 (added after the first look): the gate and up projections trained, down_proj frozen.
- W4-W6 (added after the first look, W2's cells peaking at the loss): W2a at 1,024 tokens; W2c and W2d on the
  llama_1k_v256 toy (hidden 1,024, 256 tokens), where bw16 judged DoRA's forward moment.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.trace.test_agreement_grid import _COMMON, CELLS as GRID, CONFIGS

_W2 = ("llama", 256, "bf16-mixed", "eager", "none")
#: name -> (toy config, seq, precision, attention, recompute, extra flags)
CELLS: dict[str, tuple[str, int, str, str, str, dict[str, Any]]] = {
    f"G{i}": (c[0], c[1], c[2], c[3], c[4], c[5] if len(c) > 5 else {})  # type: ignore[index,misc]
    for i, c in enumerate(GRID)
    if c[0] == "gpt_oss" or "peft" in (c[5] if len(c) > 5 else {}) or "trainable" in (c[5] if len(c) > 5 else {})  # type: ignore[index,operator,arg-type]
}
CELLS.update({
    "W2a trainable q_proj,k_proj,v_proj": (*_W2, {"trainable": "q_proj,k_proj,v_proj"}),
    "W2b trainable layer 1's q/k/v": (*_W2, {"trainable": "layers.1.self_attn.q_proj,layers.1.self_attn.k_proj,"
                                                          "layers.1.self_attn.v_proj"}),
    "W2c DoRA k_proj,v_proj": (*_W2, {"peft": "dora", "lora_targets": "k_proj,v_proj"}),
    "W2d DoRA q_proj,o_proj": (*_W2, {"peft": "dora", "lora_targets": "q_proj,o_proj"}),
    # added after the first look (W2a's cause, a frozen output projection beside trained linears, in the MLP block)
    "W3 trainable gate_proj,up_proj": (*_W2, {"trainable": "gate_proj,up_proj"}),
    # added after the first look: W2's cells peak at the loss, so none judges the moment it names; where the
    # moments are the peak (bw16's shapes): 1,024 tokens on the toy llama, and the llama_1k_v256 toy (hidden 1,024)
    "W4 trainable q_proj,k_proj,v_proj s1024": ("llama", 1024, "bf16-mixed", "eager", "none",
                                                {"trainable": "q_proj,k_proj,v_proj"}),
    "W5 DoRA k_proj,v_proj llama_1k_v256": ("llama_1k_v256", 256, "bf16-mixed", "eager", "none",
                                            {"peft": "dora", "lora_targets": "k_proj,v_proj"}),
    "W6 DoRA q_proj,o_proj llama_1k_v256": ("llama_1k_v256", 256, "bf16-mixed", "eager", "none",
                                            {"peft": "dora", "lora_targets": "q_proj,o_proj"}),
})


def compare(config: Path, cell: tuple[str, int, str, str, str, dict[str, Any]]) -> dict[str, Any]:
    from memplan.trace import trace
    from memplan.trace.compare import compare_with_estimate

    _toy, seq, precision, attention, recompute, extra = cell
    start = time.perf_counter()
    job = {"optimizer": "adamw", "optimizer_impl": "foreach", "mbs": 2, **extra}
    result = trace(str(config), seq=seq, precision=precision, attention=attention, recompute=recompute,
                   device="cuda", iterations=2, **job)
    rows = {r.category: {"traced_bytes": r.traced_bytes, "estimated_bytes": r.estimated_bytes,
                         "relative": r.relative}
            for r in compare_with_estimate(str(config), result.options, result.summary).rows
            if r.category in ("activation", "peak allocated")}
    return {"cell": [*cell[:5], extra], "rows": rows, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated cell name prefixes (G9,W2)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    wanted = args.only.split(",") if args.only else None
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, cell in CELLS.items():
            if wanted and not any(name.split(" ")[0] == w or name.startswith(w + " ") for w in wanted):
                continue
            config = Path(folder) / f"{cell[0]}.json"
            config.write_text(json.dumps({**_COMMON, **CONFIGS[cell[0]]}), encoding="utf-8")
            out[name] = compare(config, cell)
            peak = out[name]["rows"]["peak allocated"]
            print(f"| {name} {cell[:5]} {cell[5]} | {peak['traced_bytes']:,} | {peak['estimated_bytes']:,} | "
                  f"{100 * peak['relative']:+.3f}% |", flush=True)
            if args.json:
                args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
