"""Peak allocated: trace (fake tensors, --device cuda, sdpa, AdamW, 2 iterations) vs `memplan estimate --framework hf`.

Usage: python benchmarks/trace_peaks.py [--json OUT]
(prints one line per case; results in benchmarks/results/trace_peaks.json)
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate

MiB = 2**20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "trace_peaks.json"
#: (model, sequence length, precision): dense presets whose peak falls at the loss or the optimizer step.
CASES = (
    ("gpt2", 4096, "bf16-mixed"),
    ("llama-3.2-1b", 4096, "bf16-mixed"),
    ("gpt2", 512, "bf16-mixed"),
    ("llama-3.2-1b", 4096, "fp32"),
    ("qwen2.5-7b", 2048, "bf16-mixed"),
)
ITERATIONS = 2


def measure(model: str, seq: int, precision: str) -> dict[str, object]:
    result = trace(model, seq=seq, mbs=1, precision=precision, optimizer="adamw", attention="sdpa",
                   device="cuda", iterations=ITERATIONS)
    rows = {row.category: row for row in compare_with_estimate(model, result.options, result.summary).rows}
    peak, logits = rows["peak allocated"], rows["logits"]
    print(f"{model:13} {precision:10} seq {seq:5}: peak traced {peak.traced_bytes / MiB:9.1f} MiB, estimated "
          f"{peak.estimated_bytes / MiB:9.1f} MiB ({100 * (peak.relative or 0):+.1f}%); logits "
          f"{logits.traced_bytes / MiB:.0f} / {logits.estimated_bytes / MiB:.0f} MiB", flush=True)
    return {"model": model, "seq": seq, "precision": precision, "iterations": ITERATIONS,
            "traced_peak_bytes": peak.traced_bytes, "estimated_peak_bytes": peak.estimated_bytes,
            "traced_logits_bytes": logits.traced_bytes, "estimated_logits_bytes": logits.estimated_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(DEFAULT_OUT), help="where to write the results")
    ns = parser.parse_args()
    rows = [measure(*case) for case in CASES]
    measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    Path(ns.json).write_text(json.dumps({"measured": measured, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
