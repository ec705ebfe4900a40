"""Witness cells of helper tracefid18 (session 18): ``memplan trace`` running what the frameworks run at the loss
and under autocast. Estimate vs trace (as :func:`memplan.trace.compare.compare_with_estimate`), both on the same Job.

* ``L`` cells (item 1, the loss torchtitan computes): tt17's cells (benchmarks/tt17_witness.py): G1 (the agreement
  grid's ``qwen2.5-7b s2048 b1 bf16 sdpa selective fsdp 8`` under ``--framework torchtitan``), C1-C5 (its toy twins,
  2 ranks ``--fsdp full``) and T1-T7 (every ``--framework torchtitan`` cell of tests/trace/test_agreement_grid.py).
* ``A`` cells (item 2, accelerate's autocast over 16-bit weights): the agreement grid's ``llama`` and ``gpt2_v256``
  toys, ``--framework hf``, ``--precision bf16``, seq 256, mbs 2, eager and sdpa, recompute none and full (A1-A8),
  and one ``fp16`` cell (A9: llama eager none).

Figures (bytes; allocated, library workspaces left out): the peak, its phase and op; the loss window's highest live
total in the trace (the last iteration, from the first allocation at the root module after the head's forward ran
to the first backward event of another module: the loss's forward and backward) against the estimate's ledger
``loss`` moment; the highest bytes of the logits, activation and temporary categories; the forward's highest.
The cells were fixed by the brief before any result was looked at. Usage::

    PYTHONPATH=src python benchmarks/tracefid18_witness.py OUT.json [NAME ...]
    python benchmarks/tracefid18_witness.py --table BEFORE.json AFTER.json
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from tests.trace.test_agreement_grid import _COMMON, CONFIGS  # noqa: E402

_A = {"mbs": 2, "seq": 256, "framework": "hf"}
#: name -> (config, precision, attention, recompute)
A_CELLS: dict[str, tuple[str, str, str, str]] = {
    "A1": ("llama", "bf16", "eager", "none"), "A2": ("llama", "bf16", "eager", "full"),
    "A3": ("llama", "bf16", "sdpa", "none"), "A4": ("llama", "bf16", "sdpa", "full"),
    "A5": ("gpt2_v256", "bf16", "eager", "none"), "A6": ("gpt2_v256", "bf16", "eager", "full"),
    "A7": ("gpt2_v256", "bf16", "sdpa", "none"), "A8": ("gpt2_v256", "bf16", "sdpa", "full"),
    "A9": ("llama", "fp16", "eager", "none"),
}
L_CELLS = ("G1", "C1", "C2", "C3", "C4", "C5", "T1", "T2", "T3", "T4", "T5", "T6", "T7")


def _estimate_loss_moment(model: Any, options: Any) -> int | None:
    """The estimate's loss moment (allocated, workspaces left out) of the single stage, None where absent."""
    from memplan.estimate import engine
    from memplan.estimate.memo import Same
    from memplan.model import load_model

    spec = load_model(model) if isinstance(model, str) else model
    runs, runs_on, _ = engine._on_engine(options.job)
    _, parts = engine._stage_parts(Same(spec), runs, engine.DEFAULT_FRAGMENTATION, runs_on)
    figures, _, stage = parts[0]
    if "loss" not in stage.ledger.phases:
        return None
    return stage.ledger.allocated_at("loss") - figures.workspace_bytes


def _loss_window(result: Any) -> int | None:
    """The highest live total of the last iteration's loss: from the first allocation at the root module after
    the head's forward allocated, to the first backward event of a module other than the root."""
    last = result.options.iterations - 1
    head_seen, inside, best, total = False, False, None, 0
    for event in result.trace.events:
        total += event.size if event.kind == "alloc" else -event.size
        if event.iteration != last:
            continue
        if event.phase == "forward" and event.kind == "alloc" and event.module.endswith("lm_head"):
            head_seen = True
        if head_seen and not inside and event.phase == "forward" and event.kind == "alloc" and event.module == "":
            inside = True
        if inside and event.phase == "backward" and event.module != "":
            break
        if inside:
            best = total if best is None else max(best, total)
    return best


def _figures(model: Any, result: Any) -> dict[str, Any]:
    from memplan.trace.compare import compare_with_estimate

    summary = result.summary
    rows = {r.category: r for r in compare_with_estimate(model, result.options, summary).rows}
    out: dict[str, Any] = {"trace_peak_phase": summary.peak_phase, "trace_peak_op": summary.peak_op,
                           "trace_forward": summary.by_phase.get("forward"), "trace_loss": _loss_window(result),
                           "estimate_loss": _estimate_loss_moment(model, result.options)}
    for category in ("peak allocated", "logits", "activation", "temporary", "communication"):
        if category in rows:
            row = rows[category]
            out[category] = {"traced": row.traced_bytes, "estimated": row.estimated_bytes, "relative": row.relative}
    return out


def _l_cell(name: str, folder: Path) -> tuple[Any, Any]:
    from fsdp_units_witness import TOY_FLAGS, TOYS, _grid_cell
    from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY
    from tt17_witness import _grid_cells

    from memplan.trace import trace

    if name == "G1":
        cell = _grid_cell("torchtitan")
        return cell.model_ref, trace(cell.model_ref, seq=cell.seq, mbs=cell.mbs, precision=cell.precision,
                                     attention=cell.attention, recompute=cell.recompute, optimizer="adamw",
                                     optimizer_impl=cell.optimizer_impl, device="cuda", iterations=2,
                                     fsdp=cell.fsdp, tp=cell.tp, framework=cell.framework, **dict(cell.flags))
    if name.startswith("C"):
        vocab, framework, recompute, extra = TOYS[name]
        path = folder / f"v{vocab}.json"
        path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": vocab}), encoding="utf-8")
        return str(path), trace(str(path), framework=framework, recompute=recompute, **TOY_FLAGS, **extra)
    config, seq, precision, attention, recompute, extra = _grid_cells()[name]
    path = folder / f"{config}.json"
    path.write_text(json.dumps({**_COMMON, **CONFIGS[config]}), encoding="utf-8")
    job = {"optimizer_impl": "foreach", "mbs": 2, **extra}
    return str(path), trace(str(path), seq=seq, precision=precision, attention=attention, recompute=recompute,
                            optimizer="adamw", device="cuda", iterations=2, **job)


def _a_cell(name: str, folder: Path) -> tuple[Any, Any]:
    from memplan.trace import trace

    config, precision, attention, recompute = A_CELLS[name]
    path = folder / f"{config}.json"
    path.write_text(json.dumps({**_COMMON, **CONFIGS[config]}), encoding="utf-8")
    return str(path), trace(str(path), precision=precision, attention=attention, recompute=recompute,
                            optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, **_A)


def run_cell(name: str, folder: Path) -> dict[str, Any]:
    from memplan.errors import MemplanError

    started = time.perf_counter()
    try:
        model, result = (_a_cell if name in A_CELLS else _l_cell)(name, folder)
    except MemplanError as exc:
        return {"cell": name, "refused": str(exc)}
    return {"cell": name, **_figures(model, result), "seconds": round(time.perf_counter() - started, 1)}


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def table(before_path: str, after_path: str) -> str:
    before = {c["cell"]: c for c in json.loads(Path(before_path).read_text())["cells"]}
    after = {c["cell"]: c for c in json.loads(Path(after_path).read_text())["cells"]}
    rows = ["| cell | trace peak before -> after | estimate peak before -> after | trace loss window before -> after "
            "| estimate loss moment before -> after | trace logits before -> after | estimate logits before -> after |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in after:
        b, a = before.get(name, {}), after[name]
        if "refused" in a:
            rows.append(f"| {name} | refused: {a['refused'][:80]} | | | | | |")
            continue
        pb, pa = b.get("peak allocated", {}), a["peak allocated"]
        lb, la = b.get("logits", {}), a.get("logits", {})
        rows.append(f"| {name} | {_mib(pb.get('traced'))} -> {_mib(pa['traced'])} ({a['trace_peak_phase']}) "
                    f"| {_mib(pb.get('estimated'))} -> {_mib(pa['estimated'])} ({pa['relative']:+.3%}) "
                    f"| {_mib(b.get('trace_loss'))} -> {_mib(a.get('trace_loss'))} "
                    f"| {_mib(b.get('estimate_loss'))} -> {_mib(a.get('estimate_loss'))} "
                    f"| {_mib(lb.get('traced'))} -> {_mib(la.get('traced'))} "
                    f"| {_mib(lb.get('estimated'))} -> {_mib(la.get('estimated'))} |")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--table":
        print(table(argv[1], argv[2]))
        return
    out_path, names = Path(argv[0]), argv[1:] or [*L_CELLS, *A_CELLS]
    cells = []
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            cell = run_cell(name, Path(folder))
            print(json.dumps(cell), flush=True)
            cells.append(cell)
            out_path.write_text(json.dumps({"cells": cells}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
