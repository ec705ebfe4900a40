"""Partial freezing of MoE layers (session 9, helper moefz9): estimate vs trace at full size.

Usage: PYTHONPATH=src python benchmarks/partial_freeze_moe.py [--only NAME,...] [--json OUT]
(results in benchmarks/results/partial_freeze_moe.json; a markdown table on stdout)

The grid, fixed before it was run: gpt-oss-20b (the published config, benchmarks/configs/gpt-oss-20b.json,
24 layers, 32 experts of which 4 per token, attention sinks; eager attention, the only one transformers runs
for it) and qwen3-30b-a3b (48 layers, 128 experts of which 8 per token; SDPA), seq 1024, mbs 1,
``--framework hf --precision bf16-mixed --optimizer adamw``: a 16-bit base with the trained weights in fp32.
What trains: one middle layer; the last layer; the middle layer under full recompute (gpt-oss); the middle
layer's routed experts alone (qwen3); the middle layer's router alone (both; added after the first run,
before being run). The witness is ``memplan trace`` with the same flags (real transformers code and
autograd on fake tensors, 2 iterations, balanced routing); the target is the fine-tuning grid's:
activations and peak allocated within 3%.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partial_freeze import compare, run_grid  # benchmarks/partial_freeze.py: the same witness and table

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "partial_freeze_moe.json"
GPT_OSS = str(HERE / "configs" / "gpt-oss-20b.json")
QWEN3 = "qwen3-30b-a3b"
BASE: dict[str, Any] = {"seq": 1024, "mbs": 1, "precision": "bf16-mixed", "optimizer": "adamw", "framework": "hf"}
CELLS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-oss-20b layer 12": (GPT_OSS, {"attention": "eager", "trainable": "layers.12"}),
    "gpt-oss-20b layer 23 (last)": (GPT_OSS, {"attention": "eager", "trainable": "layers.23"}),
    "gpt-oss-20b layer 12, full recompute": (GPT_OSS, {"attention": "eager", "trainable": "layers.12",
                                                       "recompute": "full"}),
    "qwen3-30b-a3b layer 24": (QWEN3, {"attention": "sdpa", "trainable": "layers.24"}),
    "qwen3-30b-a3b layer 47 (last)": (QWEN3, {"attention": "sdpa", "trainable": "layers.47"}),
    "qwen3-30b-a3b layer 24's experts": (QWEN3, {"attention": "sdpa", "trainable": "layers.24.mlp.experts"}),
    # added after the first run, before being run: the router alone (router tuning)
    "qwen3-30b-a3b layer 24's router": (QWEN3, {"attention": "sdpa", "trainable": "layers.24.mlp.gate"}),
    "gpt-oss-20b layer 12's router": (GPT_OSS, {"attention": "eager", "trainable": "layers.12.mlp.router"}),
}


def measure(name: str) -> dict[str, Any]:
    model, cell = CELLS[name]
    return {"name": name, "model": Path(model).stem, "flags": cell, **compare(model, {**BASE, **cell})}


def main() -> None:
    run_grid(__doc__, list(CELLS), measure, DEFAULT_OUT, {"base": BASE})


if __name__ == "__main__":
    main()
