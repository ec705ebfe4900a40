"""Issue 25, item 8: the trace's simulated reserved memory on more agreement-grid cells (the witness).

``benchmarks/agreement_grid.py`` records the trace's simulated reserved figure (the trace's events
replayed through memplan's caching-allocator simulator) beside every cell it runs; its recorded file
``agreement_reserved.json`` holds 13 llama-3.2-1b cells. This script records the same figure for a
fixed list of further cells of the grid, chosen before any estimate was compared with them to cover
the other architectures (GPT-2, Qwen2.5, Qwen3, Qwen3-MoE, Gemma 2, Phi-3, Mistral, Llama 3.1), FSDP and
TP, plus three fine-tuning jobs (the LoRA runs of ``configs/published_finetune.json``), written to
``results/agreement_reserved_arch.json`` in the same format. ``reserved_sim.py`` compares the
estimate with both files.

    PYTHONPATH=src python benchmarks/reserved_witness.py [--out benchmarks/results/agreement_reserved_arch.json]
    PYTHONPATH=src python benchmarks/reserved_witness.py --set gemma-offload  # agreement_reserved_gemma_offload.json
    PYTHONPATH=src python benchmarks/reserved_witness.py --set offload-check  # agreement_reserved_offload_check.json
    PYTHONPATH=src python benchmarks/reserved_witness.py --set fsdp-hold  # agreement_reserved_fsdp_hold.json
    PYTHONPATH=src python benchmarks/reserved_witness.py --retrace KEY  # one arch cell again, in place
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import agreement_grid as grid  # noqa: I001 - benchmarks/ is on the path when run as a script

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "agreement_reserved_arch.json"

KEYS = (
    "gpt2 s1024 b1 fp32 sdpa rc=none", "gpt2 s1024 b1 bf16-mixed eager rc=none", "gpt2 s1024 b1 fp32 sdpa rc=full",
    "qwen2.5-7b s1024 b1 bf16-mixed sdpa rc=none", "qwen3-8b s1024 b1 bf16-mixed sdpa rc=selective",
    "qwen3-8b s1024 b1 bf16 eager rc=none", "gemma-2-2b s1024 b1 bf16-mixed eager rc=none",
    "gemma-2-2b s1024 b1 bf16 eager rc=full", "phi-3-mini s1024 b1 bf16-mixed sdpa rc=none",
    "phi-3-mini s1024 b1 fp32 eager rc=none", "mistral-7b s1024 b1 bf16-mixed sdpa rc=none",
    "qwen3-30b-a3b s1024 b1 bf16-mixed sdpa rc=none", "llama-3.2-1b s1024 b1 bf16-mixed sdpa rc=selective",
    "llama-3.2-1b s1024 b1 bf16-mixed sdpa rc=full", "gemma-2-2b s1024 b1 bf16-mixed eager rc=none fsdp=8",
    "qwen2.5-7b s1024 b1 bf16-mixed sdpa rc=none tp=2", "llama-3.1-8b s4096 b1 bf16-mixed sdpa rc=full fsdp=8",
)
_LORA = (("peft", "lora"), ("lora_rank", 64), ("lora_alpha", 16.0), ("lora_dropout", 0.05),
         ("lora_targets", "all-linear"), ("checkpoint_reentrant", True))
#: The fine-tuning cells: the Qwen 1 LoRA runs of configs/published_finetune.json (flash is traced as SDPA).
FINETUNE = (
    grid.Cell("qwen1-7b", 1024, 1, "bf16-mixed", "sdpa", "full", flags=_LORA),
    grid.Cell("qwen1-7b", 4096, 1, "bf16-mixed", "sdpa", "full",
              flags=_LORA + (("modules_to_save", "embed_tokens,lm_head"),)),
    grid.Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "none", flags=_LORA[:5]),
)

_OFFLOAD = (("offload_activations", True),)
#: ``--set gemma-offload`` (session 10, written to ``agreement_reserved_gemma_offload.json``): gemma-2-2b at
#: seq 4096 x 2 under ``save_on_cpu`` with and without full recompute, the optimizer the framework profile's
#: (as ``memplan trace`` runs it by default), where the estimate's simulated reserved was +6.6% and +6.2% over
#: the trace's (the first found in session 9's sweeps; both cells named before this file was recorded).
GEMMA_OFFLOAD = (
    grid.Cell("gemma-2-2b", 4096, 2, "bf16-mixed", "eager", "full", optimizer_impl="auto", flags=_OFFLOAD),
    grid.Cell("gemma-2-2b", 4096, 2, "bf16-mixed", "eager", "none", optimizer_impl="auto", flags=_OFFLOAD),
)

#: ``--set offload-check`` (session 10, ``agreement_reserved_offload_check.json``): three more activation-offload
#: cells named after the schedule's offload change and before they were traced (pure bf16 Gemma 2, Llama's eager
#: core, Gemma 2 without recompute at mbs 4), to check the change beyond the cells it was found on.
OFFLOAD_CHECK = (
    grid.Cell("gemma-2-2b", 4096, 2, "bf16", "eager", "full", optimizer_impl="auto", flags=_OFFLOAD),
    grid.Cell("llama-3.2-1b", 4096, 2, "bf16-mixed", "eager", "full", flags=_OFFLOAD),
    grid.Cell("gemma-2-2b", 2048, 4, "bf16-mixed", "eager", "none", flags=_OFFLOAD),
)
#: ``--set fsdp-hold`` (session 11, ``agreement_reserved_fsdp_hold.json``): a dense model under FSDP2 on 2 ranks,
#: without and with full recompute, named before the schedule held each unit's all-gather output until the next
#: unit's copy-out, to check that change beyond the gpt-oss cell it was found on.
FSDP_HOLD = (
    grid.Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "none", fsdp=2),
    grid.Cell("llama-3.2-1b", 2048, 1, "bf16-mixed", "sdpa", "full", fsdp=2),
)
_SETS = {"gemma-offload": (GEMMA_OFFLOAD, "agreement_reserved_gemma_offload.json"),
         "offload-check": (OFFLOAD_CHECK, "agreement_reserved_offload_check.json"),
         "fsdp-hold": (FSDP_HOLD, "agreement_reserved_fsdp_hold.json")}


def retrace(key: str, path: Path) -> None:
    """Trace one recorded cell again with today's ``memplan trace`` and replace its record in ``path`` (the other
    cells kept as recorded); the cell says when (``retraced``)."""
    recorded = json.loads(path.read_text())
    cells = {c.key: c for c in (*grid.GRID, *FINETUNE, *(c for chosen, _ in _SETS.values() for c in chosen))}
    index = next(i for i, c in enumerate(recorded["cells"]) if c["key"] == key)
    result = grid.measure(cells[key])
    result["retraced"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    print(f"{key}: {result['seconds']} s, reserved {result['reserved']}", flush=True)
    recorded["cells"][index] = result
    path.write_text(json.dumps(recorded, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--set", choices=("arch", *_SETS), default="arch")
    parser.add_argument("--retrace", default="", help="re-trace this one cell of the set's file and replace its record")
    args = parser.parse_args()
    if args.retrace:
        retrace(args.retrace, args.out or DEFAULT_OUT)
        return
    if args.out is None:
        args.out = DEFAULT_OUT if args.set == "arch" else DEFAULT_OUT.with_name(_SETS[args.set][1])
    cells = {c.key: c for c in grid.GRID}
    results = []
    chosen = [cells[k] for k in KEYS] + list(FINETUNE) if args.set == "arch" else list(_SETS[args.set][0])
    for cell in chosen:
        results.append(grid.measure(cell))
        print(f"{cell.key}: {results[-1]['seconds']} s, reserved {results[-1]['reserved']}", flush=True)
        measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
        args.out.write_text(json.dumps({"measured": measured, "tolerance": grid.TOLERANCE, "cells": results},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
