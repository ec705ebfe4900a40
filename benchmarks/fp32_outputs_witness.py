"""Witness cells for accelerate's ``convert_outputs_to_fp32`` in the HF Trainer's step (helper fp32out17, session 17).

accelerate's ``Accelerator.prepare_model`` wraps ``model.forward`` in ``convert_outputs_to_fp32`` under
``native_amp``: the model's 16-bit logits get an fp32 copy after the forward, while the 16-bit ones are still
referenced, and the Trainer's ``compute_loss`` keeps only the loss. Each cell traces 2 iterations (AdamW foreach,
mbs 2, ``--device cuda``) on the agreement grid's toy configs (tests/trace/test_agreement_grid.py) and runs the
estimate on the very same Job. The cells were fixed by the brief before any result was looked at. Usage::

    PYTHONPATH=src python benchmarks/fp32_outputs_witness.py OUT.json [NAME ...]
    python benchmarks/fp32_outputs_witness.py --table BEFORE.json AFTER.json

Run it against another tree by pointing PYTHONPATH at that tree's ``src`` (the before column: d19a4ba, no
wrapper in the trace). Results: benchmarks/results/fp32_outputs_witness.json. Figures are bytes; the trace's
``forward`` is the highest live total while the forward phase (the loss and the wrapper included) ran, its
``last_copy`` the live total right after the last fp32 logits-sized copy at the root module in the last forward
(the wrapper's copy after, the loss's own upcast before), the estimate's ``loss`` is its ledger's loss moment
(both without library workspaces).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_COMMON = {"max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6}
TOYS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
              "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 2048,
              "tie_word_embeddings": False},
    "llama_heavy": {**_COMMON, "model_type": "llama", "hidden_size": 512, "intermediate_size": 2048,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4,
                    "vocab_size": 16384, "tie_word_embeddings": True},
}
_W1 = ("llama_heavy", 512, "bf16-mixed", "sdpa", "none")
#: name: (config, seq, precision, attention, recompute, further job flags)
CELLS: dict[str, tuple[str, int, str, str, str, dict[str, Any]]] = {
    "W1": (*_W1, {}),
    "W2": ("llama_heavy", 512, "bf16-mixed", "sdpa", "full", {}),
    "W3": (*_W1, {"peft": "lora", "lora_rank": 16, "lora_targets": "q_proj,v_proj"}),
    "W4": ("llama", 512, "bf16-mixed", "eager", "none", {}),
    "W5": ("llama", 256, "bf16-mixed", "sdpa", "none", {"fsdp": 4}),
    "W6": ("llama_heavy", 512, "fp16-mixed", "sdpa", "none", {}),
    "C1-torchtitan": (*_W1, {"framework": "torchtitan"}),
    "C2-zero2": (*_W1, {"zero": 2}),
    "C3-bf16": ("llama_heavy", 512, "bf16", "sdpa", "none", {}),
    # added after the fixed cells' results (none moved: the wrapper's fp32 copy takes the place of the eager loss's
    # own upcast, the same size, freed by then): a compiled cross-entropy keeps no logits-sized fp32 buffer, so there
    # the wrapper's moment can stand above the loss's
    "X1-compile": (*_W1, {"compile": True}),
    "X2-compile-full": ("llama_heavy", 512, "bf16-mixed", "sdpa", "full", {"compile": True}),
}


def _estimate_loss_moment(config: str, options: Any) -> int | None:
    """The estimate's loss moment (allocated, workspaces left out) of the single stage, None where absent."""
    from memplan.estimate import engine
    from memplan.estimate.memo import Same
    from memplan.model import load_model

    spec = load_model(config)
    runs, runs_on, _ = engine._on_engine(options.job)
    _, parts = engine._stage_parts(Same(spec), runs, engine.DEFAULT_FRAGMENTATION, runs_on)
    figures, _, stage = parts[0]
    ledger = stage.ledger
    if "loss" not in ledger.phases:
        return None
    return ledger.allocated_at("loss") - figures.workspace_bytes


def _last_copy_moment(result: Any, copy_bytes: int) -> int | None:
    """The live total right after the last fp32 logits-sized copy made at the root module in the last iteration's
    forward: the wrapper's copy where the trace runs it, the loss's own upcast where it does not."""
    total, found = 0, None
    last = result.options.iterations - 1
    for event in result.trace.events:
        total += event.size if event.kind == "alloc" else -event.size
        if (event.kind == "alloc" and event.iteration == last and event.phase == "forward" and event.module == ""
                and event.op == "aten._to_copy.default" and event.size == copy_bytes):
            found = total
    return found


def run_cell(name: str, folder: Path) -> dict[str, Any]:
    from memplan.errors import MemplanError
    from memplan.trace import trace
    from memplan.trace.compare import compare_with_estimate

    toy, seq, precision, attention, recompute, flags = CELLS[name]
    path = folder / f"{toy}.json"
    path.write_text(json.dumps(TOYS[toy]), encoding="utf-8")
    started = time.perf_counter()
    out: dict[str, Any] = {"cell": name, "config": toy, "seq": seq, "precision": precision, "attention": attention,
                           "recompute": recompute, "flags": flags}
    try:
        result = trace(str(path), seq=seq, mbs=2, precision=precision, attention=attention, recompute=recompute,
                       optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, **flags)
    except MemplanError as exc:
        return {**out, "refused": str(exc)}
    summary = result.summary
    comparison = compare_with_estimate(str(path), result.options, summary)
    peak = comparison.row("peak allocated")
    reserved = summary.reserved.peak_reserved_bytes if summary.reserved is not None else None
    out.update({
        "trace_peak": summary.peak_allocated_bytes, "trace_peak_phase": summary.peak_phase,
        "trace_peak_op": summary.peak_op, "trace_forward": summary.by_phase.get("forward"),
        "trace_last_copy": _last_copy_moment(result, 4 * 2 * seq * TOYS[toy]["vocab_size"] // max(1, int(
            flags.get("tp", 1)))),
        "trace_reserved": reserved, "estimate_peak": peak.estimated_bytes,
        "estimate_loss": _estimate_loss_moment(str(path), result.options),
        "relative": peak.relative, "seconds": round(time.perf_counter() - started, 1),
    })
    return out


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.2f}"


def table(before_path: str, after_path: str) -> str:
    before = {c["cell"]: c for c in json.loads(Path(before_path).read_text())["cells"]}
    after = {c["cell"]: c for c in json.loads(Path(after_path).read_text())["cells"]}
    rows = ["| cell | trace peak before -> after (MiB) | trace forward before -> after | trace last fp32 copy "
            "before -> after | trace reserved before -> after | estimate peak before -> after | estimate loss moment "
            "before -> after | estimate vs wrapped trace |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in CELLS:
        b, a = before.get(name, {}), after.get(name, {})
        if "refused" in a or "refused" in b:
            rows.append(f"| {name} | refused: {(a.get('refused') or b.get('refused'))[:90]} | | | | | | |")
            continue
        rel = (a["estimate_peak"] - a["trace_peak"]) / a["trace_peak"] if a.get("trace_peak") else None
        rows.append(f"| {name} | {_mib(b.get('trace_peak'))} -> {_mib(a.get('trace_peak'))} "
                    f"({a.get('trace_peak_phase')}) | {_mib(b.get('trace_forward'))} -> {_mib(a.get('trace_forward'))} "
                    f"| {_mib(b.get('trace_last_copy'))} -> {_mib(a.get('trace_last_copy'))} "
                    f"| {_mib(b.get('trace_reserved'))} -> {_mib(a.get('trace_reserved'))} "
                    f"| {_mib(b.get('estimate_peak'))} -> {_mib(a.get('estimate_peak'))} "
                    f"| {_mib(b.get('estimate_loss'))} -> {_mib(a.get('estimate_loss'))} "
                    f"| {'-' if rel is None else f'{rel:+.2%}'} |")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--table":
        print(table(argv[1], argv[2]))
        return
    out_path, names = Path(argv[0]), argv[1:] or list(CELLS)
    cells = []
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            cell = run_cell(name, Path(folder))
            print(json.dumps(cell), flush=True)
            cells.append(cell)
    out_path.write_text(json.dumps({"cells": cells}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
