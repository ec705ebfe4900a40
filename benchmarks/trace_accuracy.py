"""Accuracy of `memplan trace` against two references.

1. **Independent measurement.** The same training iterations (forward, loss, backward, AdamW step,
   ``zero_grad``; fp32) run on real CPU tensors under ``torch.profiler`` (profile_memory); the peak
   of its memory timeline (``MemoryProfileTimeline``: pre-existing tensors plus every allocation
   and free) is compared with the peak memplan traces on fake tensors with ``--device cpu``.
   Models: the ``gpt2`` preset (124M) and a ~96M-parameter Llama-style config
   (``benchmarks/configs/llama-100m.json``). Target: within 2%.
2. **The analytical estimator** (``hf`` profile, sdpa attention): activations saved for the
   backward (the trace's highest live ``activation`` bytes against the estimator's
   ``activations_bytes`` at the loss), parameters, gradients, optimizer states, for dense presets
   at several sequence lengths. Target: states identical, activations within 5%.

Usage: python benchmarks/trace_accuracy.py [--quick] [--json OUT.json] [--markdown]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from memplan.trace.setup import trace_setup
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trace"))
from profiler_reference import measure_hf_reference  # noqa: E402  (test-only: tests/trace)

HERE = Path(__file__).resolve().parent
LLAMA_100M = str(HERE / "configs" / "llama-100m.json")
DEFAULT_OUT = HERE / "results" / "trace_accuracy.json"
MiB = 2**20

PROFILER_CASES = [("gpt2", 128, 2), ("gpt2", 512, 1), (LLAMA_100M, 128, 2), (LLAMA_100M, 512, 4)]
#: Dense presets whose transformers implementation supports SDPA (Gemma 2 does not: eager only).
ESTIMATOR_PRESETS = ["gpt2", "llama-3.2-1b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b", "qwen3-8b"]
ESTIMATOR_SEQS = [512, 2048, 4096]
ESTIMATOR_PRECISIONS = ["fp32", "bf16-mixed"]


def _name(model: str) -> str:
    return "llama-100m" if model == LLAMA_100M else model


def profiler_rows(cases: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """Traced (fake, --device cpu) peak against the profiler's peak on real CPU tensors."""
    rows = []
    for model, seq, mbs in cases:
        options = trace_setup(seq=seq, mbs=mbs, precision="fp32", optimizer="adamw", device="cpu")
        started = time.perf_counter()
        measured = measure_hf_reference(model, options)
        real_s = time.perf_counter() - started
        gc.collect()
        traced = trace(model, seq=seq, mbs=mbs, precision="fp32", optimizer="adamw", device="cpu")
        peak = traced.summary.peak_allocated_bytes
        rows.append({"model": _name(model), "seq": seq, "mbs": mbs, "traced_peak_bytes": peak,
                     "profiler_peak_bytes": measured, "error": (peak - measured) / measured,
                     "real_run_s": round(real_s, 1), "trace_s": round(sum(traced.timings.values()), 1)})
        print(f"profiler  {_name(model):12} seq {seq:5} mbs {mbs}: traced {peak / MiB:9.1f} MiB  "
              f"profiler {measured / MiB:9.1f} MiB  error {100 * rows[-1]['error']:+.3f}%", flush=True)
    return rows


def estimator_rows(presets: list[str], seqs: list[int], precisions: list[str]) -> list[dict[str, Any]]:
    """Trace (fake, --device cuda, sdpa) against ``memplan estimate --framework hf``."""
    rows = []
    for precision in precisions:
        for model in presets:
            for seq in seqs:
                result = trace(model, seq=seq, mbs=1, precision=precision, optimizer="adamw", attention="sdpa",
                               device="cuda", iterations=1 if precision == "fp32" else 2)
                comparison = compare_with_estimate(model, result.options, result.summary)
                row: dict[str, Any] = {"model": model, "seq": seq, "precision": precision}
                for item in comparison.rows:
                    row[item.category] = {"traced": item.traced_bytes, "estimated": item.estimated_bytes,
                                          "relative": item.relative}
                rows.append(row)
                act = row["activation"]
                equal = all(row[c]["relative"] == 0 for c in ("parameter", "gradient", "optimizer_state"))
                print(f"estimator {model:13} {precision:10} seq {seq:5}: activations traced "
                      f"{act['traced'] / MiB:9.1f} MiB estimated {act['estimated'] / MiB:9.1f} MiB "
                      f"({100 * (act['relative'] or 0):+.1f}%)  states identical: {equal}", flush=True)
                gc.collect()
    return rows


def markdown(data: dict[str, Any]) -> str:
    lines = ["| model | seq | mbs | traced peak (MiB) | profiler peak (MiB) | error |", "|---|---|---|---|---|---|"]
    for r in data["profiler"]:
        lines.append(f"| {r['model']} | {r['seq']} | {r['mbs']} | {r['traced_peak_bytes'] / MiB:.1f} | "
                     f"{r['profiler_peak_bytes'] / MiB:.1f} | {100 * r['error']:+.3f}% |")
    lines += ["", ("| model | precision | seq | params | grads | optimizer | activations traced (MiB) | "
                   "estimated (MiB) | difference |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in data["estimator"]:
        same = ["=" if r[c]["relative"] == 0 else f"{100 * r[c]['relative']:+.2f}%"
                for c in ("parameter", "gradient", "optimizer_state")]
        act = r["activation"]
        lines.append(f"| {r['model']} | {r['precision']} | {r['seq']} | {' | '.join(same)} | "
                     f"{act['traced'] / MiB:.1f} | {act['estimated'] / MiB:.1f} | {100 * (act['relative'] or 0):+.1f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one profiler case and two presets")
    parser.add_argument("--skip-profiler", action="store_true")
    parser.add_argument("--json", default=str(DEFAULT_OUT), help="where to write the results")
    parser.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    args = parser.parse_args()
    cases = PROFILER_CASES[:1] if args.quick else PROFILER_CASES
    presets = ESTIMATOR_PRESETS[:2] if args.quick else ESTIMATOR_PRESETS
    data = {"profiler": [] if args.skip_profiler else profiler_rows(cases),
            "estimator": estimator_rows(presets, ESTIMATOR_SEQS, ESTIMATOR_PRECISIONS)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    if args.markdown:
        print(markdown(data))


if __name__ == "__main__":
    main()
