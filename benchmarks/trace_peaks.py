"""Peak allocated: trace (fake tensors, --device cuda, sdpa, 2 iterations) vs `memplan estimate --framework hf`.

Usage: python benchmarks/trace_peaks.py   (prints one line per case; results in benchmarks/results/trace_peaks.json)
"""
import json
import datetime
from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
MiB = 2**20
rows = []
for model, seq, prec, it in [("gpt2", 4096, "bf16-mixed", 2), ("llama-3.2-1b", 4096, "bf16-mixed", 2),
                              ("gpt2", 512, "bf16-mixed", 2), ("llama-3.2-1b", 4096, "fp32", 2), ("qwen2.5-7b", 2048, "bf16-mixed", 2)]:
    r = trace(model, seq=seq, mbs=1, precision=prec, optimizer="adamw", attention="sdpa", device="cuda", iterations=it)
    c = compare_with_estimate(model, r.options, r.summary)
    row = {x.category: x for x in c.rows}
    pk, lg = row["peak allocated"], row["logits"]
    print(f"{model:13} {prec:10} seq {seq:5} it {it}: peak traced {pk.traced_bytes/MiB:9.1f} est {pk.estimated_bytes/MiB:9.1f} ({100*(pk.relative or 0):+.1f}%)  logits {lg.traced_bytes/MiB:.0f}/{lg.estimated_bytes/MiB:.0f}", flush=True)
    rows.append({"model": model, "seq": seq, "precision": prec, "iterations": it, "traced_peak_bytes": pk.traced_bytes,
                 "estimated_peak_bytes": pk.estimated_bytes, "traced_logits_bytes": lg.traced_bytes,
                 "estimated_logits_bytes": lg.estimated_bytes})
with open("benchmarks/results/trace_peaks.json", "w") as handle:
    json.dump({"measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "rows": rows}, handle, indent=1)
