"""Estimate (`--framework hf`) vs trace on a fixed grid of presets, precisions, attention and recompute modes.

Usage: PYTHONPATH=src python benchmarks/agreement_grid.py [--json OUT] [--only SUBSTRING] [--policies]
(prints a markdown table; results in benchmarks/results/agreement_grid.json)

Every cell traces 2 iterations on fake tensors (``--device cuda``, AdamW, foreach unless the cell
says otherwise; one rank, or simulated FSDP2 / TP ranks) and runs the estimator on the very same
Job. Targets: parameters, gradients and optimizer states equal;
activations, logits and peak within :data:`TOLERANCE`. The cells were fixed before any result was
looked at; :data:`EXCEPTIONS` lists the cells allowed to miss, each explained in docs/trace.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "agreement_grid.json"
CONFIGS = HERE / "configs"
#: Relative tolerance of activations, logits and peak.
TOLERANCE = 0.03
#: Categories that must be equal (model states).
EXACT = ("parameter", "gradient", "optimizer_state")
#: Categories within TOLERANCE.
CLOSE = ("activation", "logits", "peak allocated")


@dataclass(frozen=True, slots=True)
class Cell:
    """One job of the grid (AdamW, ``--device cuda``)."""

    model: str
    seq: int
    mbs: int
    precision: str
    attention: str
    recompute: str
    #: Simulated FSDP2 and tensor-parallel ranks.
    fsdp: int = 1
    tp: int = 1
    #: ``auto`` is the framework profile's (fused).
    optimizer_impl: str = "foreach"
    framework: str = "hf"
    #: Further job flags (activation-policy parameters: recompute_modules, recompute_method...).
    flags: tuple[tuple[str, object], ...] = ()

    @property
    def key(self) -> str:
        extra = "".join(f" {name}={value}" for name, value, default in (
            ("fsdp", self.fsdp, 1), ("tp", self.tp, 1), ("impl", self.optimizer_impl, "foreach"),
            ("fw", self.framework, "hf")) if value != default)
        extra += "".join(f" {name}={value}" for name, value in self.flags)
        return f"{self.model} s{self.seq} b{self.mbs} {self.precision} {self.attention} rc={self.recompute}{extra}"

    @property
    def model_ref(self) -> str:
        local = CONFIGS / f"{self.model}.json"
        return str(local) if local.exists() else self.model


GRID: tuple[Cell, ...] = (
    Cell("gpt2", 1024, 1, "fp32", "sdpa", "none"),
    Cell("gpt2", 1024, 1, "bf16-mixed", "eager", "none"),
    Cell("gpt2", 1024, 1, "fp32", "sdpa", "full"),
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "none"),
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "eager", "none"),
    Cell("llama-3.2-1b", 2048, 1, "bf16", "sdpa", "none"),
    Cell("llama-3.2-1b", 2048, 1, "fp32", "eager", "none"),
    Cell("llama-3.2-1b", 1024, 1, "bf16-mixed", "sdpa", "selective"),
    Cell("llama-3.2-1b", 1024, 1, "bf16-mixed", "eager", "selective"),
    Cell("llama-3.2-1b", 1024, 1, "bf16-mixed", "sdpa", "full"),
    Cell("llama-3.2-1b", 8192, 2, "bf16-mixed", "sdpa", "full"),
    Cell("llama-3.2-1b", 1024, 1, "fp32", "sdpa", "full"),
    Cell("qwen2.5-7b", 1024, 1, "bf16-mixed", "sdpa", "none"),
    Cell("qwen3-8b", 1024, 1, "bf16-mixed", "sdpa", "selective"),
    Cell("qwen3-8b", 1024, 1, "bf16", "eager", "none"),
    Cell("gemma-2-2b", 1024, 1, "bf16-mixed", "eager", "none"),
    Cell("gemma-2-2b", 1024, 1, "bf16", "eager", "full"),
    Cell("gemma-2-9b", 1024, 1, "bf16-mixed", "eager", "none"),
    Cell("phi-3-mini", 1024, 1, "bf16-mixed", "sdpa", "none"),
    Cell("phi-3-mini", 1024, 1, "fp32", "eager", "none"),
    Cell("mistral-7b", 1024, 1, "bf16-mixed", "sdpa", "none"),
    Cell("mistral-7b", 4096, 1, "bf16-mixed", "sdpa", "none"),
    Cell("qwen3-30b-a3b", 1024, 1, "bf16-mixed", "sdpa", "none"),
    Cell("qwen3-30b-a3b", 1024, 1, "bf16", "sdpa", "full"),
    # gpt-oss (attention sinks, clamped SwiGLU experts; eager only: transformers has no SDPA path for it)
    Cell("gpt-oss-20b", 1024, 1, "bf16-mixed", "eager", "none"),
    Cell("gpt-oss-20b", 2048, 1, "bf16", "eager", "full"),
    Cell("gpt-oss-20b", 4096, 1, "bf16-mixed", "eager", "none"),
    Cell("gpt-oss-20b", 8192, 4, "bf16", "eager", "full"),  # peak in the recomputed layer's backward
    Cell("gpt-oss-20b", 8192, 2, "bf16-mixed", "eager", "full"),  # ... in its recomputed forward
    Cell("gpt-oss-20b", 8192, 1, "bf16", "eager", "none"),
    # Added after the first run, whose peaks nearly all fell at the optimizer step (foreach AdamW's
    # state-sized temporary): longer sequences / bigger micro-batches whose peak is in the forward,
    # the loss or the backward, so that the peak row tests the activation and transient terms.
    Cell("gpt2", 1024, 8, "bf16-mixed", "eager", "none"),
    Cell("llama-3.2-1b", 8192, 2, "bf16-mixed", "sdpa", "none"),
    Cell("llama-3.2-1b", 4096, 2, "bf16-mixed", "eager", "full"),
    Cell("qwen3-8b", 8192, 2, "bf16-mixed", "sdpa", "selective"),
    Cell("gemma-2-2b", 4096, 2, "bf16-mixed", "eager", "full"),
    Cell("phi-3-mini", 4096, 4, "bf16", "sdpa", "none"),
    # Added with the one-Job refactor (fixed before they were run): simulated FSDP2 and TP ranks,
    # the framework's own optimizer implementation (fused), torchtitan's profile.
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "none", fsdp=8),
    Cell("llama-3.1-8b", 4096, 1, "bf16-mixed", "sdpa", "full", fsdp=8),
    # This cell first ran as framework="torchtitan": activations +7.8%, peak +3.9% — the tracer ran
    # memplan's attention-module checkpointing while the estimator priced torchtitan's selective as
    # Megatron's attention core; neither is torchtitan's per-op SAC, so trace now refuses
    # torchtitan + selective and the cell runs the hf meaning (docs/trace.md).
    Cell("qwen2.5-7b", 2048, 1, "bf16", "sdpa", "selective", fsdp=8),
    Cell("gemma-2-2b", 1024, 1, "bf16-mixed", "eager", "none", fsdp=8),
    Cell("qwen3-30b-a3b", 1024, 1, "bf16-mixed", "sdpa", "none", fsdp=8),
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "none", tp=2),
    Cell("qwen2.5-7b", 1024, 1, "bf16-mixed", "sdpa", "none", tp=2),
    Cell("qwen3-8b", 1024, 1, "bf16-mixed", "eager", "selective", tp=2),
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "full", fsdp=4, tp=2),
    Cell("gpt2", 1024, 1, "fp32", "sdpa", "none", optimizer_impl="auto"),
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "none", optimizer_impl="auto"),
    Cell("qwen3-8b", 1024, 1, "bf16-mixed", "sdpa", "full", optimizer_impl="auto", framework="torchtitan"),
    # Added with the activation policies (memplan.policies; fixed before they were run): every policy the
    # tracer runs — each framework's selective, Megatron's --recompute-modules kinds on a dense and an MoE
    # preset (on the models' own sub-modules), full recompute of N layers.
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "selective", framework="torchtitan"),
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "megatron-selective", flags=(("recompute_modules", "core_attn"),)),
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "megatron-selective", flags=(("recompute_modules", "mlp"),)),
    Cell("llama-3.2-1b", 1024, 1, "bf16-mixed", "eager", "megatron-selective",
         flags=(("recompute_modules", "core_attn,mlp"),)),
    Cell("qwen3-8b", 2048, 1, "bf16", "sdpa", "megatron-selective", flags=(("recompute_modules", "core_attn,mlp"),)),
    Cell("qwen3-30b-a3b", 1024, 1, "bf16-mixed", "sdpa", "megatron-selective", flags=(("recompute_modules", "moe"),)),
    Cell("qwen3-30b-a3b", 1024, 1, "bf16-mixed", "sdpa", "megatron-selective",
         flags=(("recompute_modules", "core_attn"),)),
    Cell("deepseek-v2-lite", 1024, 1, "bf16-mixed", "sdpa", "megatron-selective",
         flags=(("recompute_modules", "shared_experts"),)),
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "full", flags=(("recompute_method", "block"),
                                                                    ("recompute_layers", 4))),
    Cell("qwen3-8b", 1024, 1, "bf16-mixed", "sdpa", "full", flags=(("recompute_method", "uniform"),
                                                                ("recompute_layers", 1))),
    # Activation offloading (per-tensor save_on_cpu under the hf profile), added after the estimator was
    # aligned with it; these cells were fixed before they were run (three others, llama-3.2-1b 8192x2,
    # gpt2 1024x8, qwen3-8b 4096 bf16, were run while aligning it and are not in the grid).
    Cell("qwen2.5-7b", 2048, 1, "bf16-mixed", "sdpa", "none", flags=(("offload_activations", True),)),
    Cell("gemma-2-2b", 1024, 2, "bf16-mixed", "eager", "none", flags=(("offload_activations", True),)),
    Cell("llama-3.2-1b", 4096, 2, "bf16-mixed", "sdpa", "full", flags=(("offload_activations", True),)),
    # Megatron's output-discarding checkpoints (layernorm, moe_act; memplan.trace.runners.discard), fixed before they
    # were run: with autocast (the norm output reaches the GEMMs as copies) and without, alone and combined.
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "megatron-selective", flags=(("recompute_modules", "layernorm"),)),
    Cell("llama-3.2-1b", 1024, 1, "bf16", "eager", "megatron-selective",
         flags=(("recompute_modules", "core_attn,layernorm,mlp"),)),
    Cell("qwen3-30b-a3b", 1024, 1, "bf16-mixed", "sdpa", "megatron-selective", flags=(("recompute_modules", "moe_act"),)),
    Cell("qwen3-30b-a3b", 1024, 1, "bf16", "sdpa", "megatron-selective",
         flags=(("recompute_modules", "layernorm,moe_act"),)),
    # mla_up_proj on transformers' MLA (memplan.trace.runners.mla_up), fixed before they were run.
    Cell("deepseek-v2-lite", 1024, 1, "bf16-mixed", "sdpa", "megatron-selective",
         flags=(("recompute_modules", "mla_up_proj"),)),
    Cell("deepseek-v2-lite", 1024, 1, "bf16", "sdpa", "megatron-selective",
         flags=(("recompute_modules", "core_attn,layernorm,mla_up_proj"),)),
    # DeepSpeed activation checkpointing run for real (memplan.trace.runners.ds_checkpoint), fixed before they were run.
    Cell("llama-3.2-1b", 1024, 1, "bf16", "sdpa", "full", framework="deepspeed",
         flags=(("partition_activations", True),)),
    Cell("llama-3.2-1b", 1024, 1, "bf16", "sdpa", "full", framework="deepspeed",
         flags=(("partition_activations", True), ("cpu_checkpointing", True), ("contiguous_checkpoints", 16))),
    Cell("llama-3.2-1b", 1024, 1, "bf16", "sdpa", "full", tp=2, framework="deepspeed",
         flags=(("partition_activations", True),)),
    # --compile (issue 25), fixed before they were run: each decoder layer traced as inductor's partitioned
    # graphs (memplan.trace.runners.partitioner) against the estimator's per-family rules
    # (memplan.estimate.compiled); one cell per family of the grid and per attention kind. Judged on
    # activations within COMPILE_TOLERANCE (states equal); logits and peak are reported, not judged (the
    # trace runs the partitioned graphs op by op, not inductor's fused kernels).
    Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "none", flags=(("compile", True),)),
    Cell("llama-3.2-1b", 1024, 1, "bf16", "eager", "none", flags=(("compile", True),)),
    Cell("qwen2.5-7b", 1024, 1, "bf16-mixed", "sdpa", "none", flags=(("compile", True),)),
    Cell("qwen3-8b", 1024, 1, "bf16", "sdpa", "none", flags=(("compile", True),)),
    Cell("mistral-7b", 1024, 1, "bf16-mixed", "sdpa", "none", flags=(("compile", True),)),
    Cell("phi-3-mini", 1024, 1, "fp32", "eager", "none", flags=(("compile", True),)),
    # added 2026-12-07 (helper phi3c10) before they were run: the fused q/k/v output is held by the saved v
    # under SDPA with autocast, not by unfused attention's copied v at micro-batch 2
    Cell("phi-3-mini", 1024, 1, "bf16-mixed", "sdpa", "none", flags=(("compile", True),)),
    Cell("phi-3-mini", 1024, 2, "fp32", "eager", "none", flags=(("compile", True),)),
    Cell("gemma-2-2b", 1024, 1, "bf16-mixed", "eager", "none", flags=(("compile", True),)),
    Cell("gpt2", 1024, 1, "bf16-mixed", "sdpa", "none", flags=(("compile", True),)),
    Cell("qwen3-30b-a3b", 1024, 1, "bf16-mixed", "sdpa", "none", flags=(("compile", True),)),
    Cell("deepseek-v2-lite", 1024, 1, "bf16-mixed", "sdpa", "none", flags=(("compile", True),)),
    # families added in session 8 (published configs in configs/; ``--only "gemma-3|olmo-2|granite|smollm3|gemma-7b"``)
    Cell("gemma-3-1b", 2048, 1, "bf16-mixed", "eager", "none"),
    Cell("gemma-3-1b", 2048, 1, "bf16-mixed", "sdpa", "full"),
    Cell("gemma-3-1b", 1024, 1, "fp32", "eager", "none"),
    Cell("gemma-7b", 1024, 1, "bf16-mixed", "eager", "none"),
    Cell("olmo-2-1124-7b", 1024, 1, "bf16-mixed", "sdpa", "none"),
    Cell("olmo-2-1124-7b", 1024, 1, "bf16", "eager", "full"),
    Cell("granite-3.3-8b-base", 1024, 1, "bf16-mixed", "sdpa", "none"),
    Cell("smollm3-3b", 2048, 1, "bf16-mixed", "sdpa", "none"),
)

#: Relative tolerance of activations in the ``--compile`` cells (issue 25's target).
COMPILE_TOLERANCE = 0.05

#: Cells allowed outside the tolerance, with the reason (docs/trace.md explains each).
#: (Empty since 2026-12-03 13:00: DeepSeek-V2-Lite's ``shared_experts`` cell, listed until then at -5.0%,
#: is at -1.1% once the estimator prices transformers' MLA and MoE as the trace runs them.)
EXCEPTIONS: dict[str, str] = {
    # activations -0.0%; the states and logits are not the policy's (docs/trace.md, DeepSpeed activation
    # checkpointing): the deepspeed profile prices Megatron-DeepSpeed's vocabulary-parallel embedding and head,
    # the tracer runs Hugging Face's TP plan on a transformers model (embedding whole, logits gathered).
    "llama-3.2-1b s1024 b1 bf16 sdpa rc=full tp=2 fw=deepspeed partition_activations=True": (
        "states and logits: Megatron-DeepSpeed's vocabulary-parallel embedding and head (estimate) vs Hugging "
        "Face's TP plan (trace); activations -0.0%"),
}


def measure(cell: Cell) -> dict[str, object]:
    """Trace ``cell`` and estimate it; bytes and relative error per category."""
    start = time.perf_counter()
    result = trace(cell.model_ref, seq=cell.seq, mbs=cell.mbs, precision=cell.precision, attention=cell.attention,
                   recompute=cell.recompute, optimizer="adamw", optimizer_impl=cell.optimizer_impl, device="cuda",
                   iterations=2, fsdp=cell.fsdp, tp=cell.tp, framework=cell.framework, **dict(cell.flags))
    comparison = compare_with_estimate(cell.model_ref, result.options, result.summary)
    rows = {r.category: {"traced_bytes": r.traced_bytes, "estimated_bytes": r.estimated_bytes,
                         "relative": r.relative} for r in comparison.rows if r.category in EXACT + CLOSE}
    compiled = dict(cell.flags).get("compile", False)
    judged = {"activation": COMPILE_TOLERANCE} if compiled else dict.fromkeys(CLOSE, TOLERANCE)
    ok = all(rows[c]["traced_bytes"] == rows[c]["estimated_bytes"] for c in EXACT) and all(
        abs(rows[c]["relative"] or 0.0) <= tolerance for c, tolerance in judged.items())
    return {**asdict(cell), "flags": dict(cell.flags), "key": cell.key, "rows": rows, "within_tolerance": ok,
            "reserved": _reserved(cell, result), "exception": EXCEPTIONS.get(cell.key),
            "seconds": round(time.perf_counter() - start, 1)}


def _reserved(cell: Cell, result: object) -> dict[str, object] | None:
    """Recorded, not judged (issue 25, item 8): the trace's simulated reserved peak (its events replayed
    through memplan's caching-allocator simulator) against the estimate's reserved figure."""
    from memplan.estimate.engine import estimate
    from memplan.model import load_model
    from memplan.trace.compare import estimate_job

    simulated = result.summary.reserved  # type: ignore[attr-defined]
    if simulated is None:
        return None
    est = estimate(load_model(cell.model_ref), estimate_job(result.options))  # type: ignore[attr-defined]
    traced, estimated = simulated.peak_reserved_bytes, est.peak_reserved_bytes
    return {"traced_simulated_bytes": traced, "traced_allocated_bytes": result.summary.peak_allocated_bytes,  # type: ignore[attr-defined]
            "estimated_bytes": estimated, "estimated_allocated_bytes": est.peak_allocated_bytes,
            "relative": (estimated - traced) / traced if traced else None}


def _pct(row: dict[str, object]) -> str:
    rel = row["relative"]
    return "—" if rel is None else f"{100 * float(rel):+.1f}%"  # type: ignore[arg-type]


def table(results: list[dict[str, object]]) -> str:
    """The markdown table: states, then activations / logits / peak as traced → estimated (error)."""
    MiB = 2**20
    lines = [("| model | seq×mbs | precision | attention | recompute | ranks, optimizer, framework | states | "
              "activations MiB (err) | logits MiB (err) | peak MiB (err) | ok |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows = r["rows"]  # type: ignore[index]
        states = "equal" if all(rows[c]["traced_bytes"] == rows[c]["estimated_bytes"] for c in EXACT) else "DIFFER"
        cols = [f"{rows[c]['traced_bytes'] / MiB:,.0f} / {rows[c]['estimated_bytes'] / MiB:,.0f} ({_pct(rows[c])})"
                for c in CLOSE]
        ok = "yes" if r["within_tolerance"] else ("exception" if r["exception"] else "**no**")
        setup = f"fsdp {r.get('fsdp', 1)} × tp {r.get('tp', 1)}, {r.get('optimizer_impl', 'foreach')}, " \
                f"{r.get('framework', 'hf')}"
        policy = " ".join([str(r["recompute"]), *(f"{k}={v}" for k, v in dict(r.get("flags") or {}).items())])
        lines.append(f"| {r['model']} | {r['seq']}×{r['mbs']} | {r['precision']} | {r['attention']} | "
                     f"{policy} | {setup} | {states} | " + " | ".join(cols) + f" | {ok} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(DEFAULT_OUT), help="where to write the results")
    parser.add_argument("--only", default="", help="run only the cells whose key contains this text (or one of "
                        "several separated by |)")
    parser.add_argument("--policies", action="store_true", help="run only the activation-policy cells "
                        "(recompute other than none)")
    parser.add_argument("--compile", action="store_true", help="run only the --compile cells")
    ns = parser.parse_args()
    results = []
    for cell in GRID:
        if (ns.only and not any(part in cell.key for part in ns.only.split("|"))) or (ns.policies and cell.recompute == "none") or (
                ns.compile and not dict(cell.flags).get("compile")):
            continue
        results.append(measure(cell))
        print(f"{cell.key}: {'ok' if results[-1]['within_tolerance'] else 'MISS'} "
              f"({results[-1]['seconds']} s)", flush=True)
    print(table(results))
    measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    Path(ns.json).write_text(json.dumps({"measured": measured, "tolerance": TOLERANCE, "cells": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
