"""``--fsdp hybrid`` (FSDP2 HSDP) against ``memplan trace`` of the same jobs (helper hsdp17, docs/benchmarks.md;
tests/trace/test_hsdp_trace.py runs them): the agreement grid's ``llama`` toy, bf16-mixed, sdpa, AdamW foreach,
2 iterations, ``--device cuda``; the estimate's peak less its cuBLAS workspace, as
:func:`memplan.trace.compare.compare_with_estimate`. ``fsdp: N`` with ``gpus``: hybrid groups of N."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.estimate.engine import estimate
from memplan.inputs import JobRequest, load_job
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY

BASE = {"precision": "bf16-mixed", "attention": "sdpa", "optimizer": "adamw", "optimizer_impl": "foreach"}
#: name -> (job flags, the trace's peak allocated in bytes).
CELLS: dict[str, tuple[dict[str, object], int]] = {
    # the witness's Y1 and Y3: 2 replicas x 2 shards, the peak in the backward's first block
    "Y1": ({"seq": 256, "mbs": 2, "framework": "torchtitan", "recompute": "none", "gpus": 4, "fsdp": 2}, 41_908_224),
    # (hf under accelerate's FSDP units since fsdphead17: the embedding and [norm, head] units of their own; 44,465,152
    # under one root unit)
    "Y3": ({"seq": 256, "mbs": 2, "framework": "hf", "recompute": "none", "gpus": 4, "fsdp": 2}, 41_908_224),
    # hf, full recompute, a short sequence: under one root unit the end of the backward set the peak (26,164,224),
    # where every unit holds its all-reduced bf16 shards beside the fp32 gradients; under accelerate's units the
    # root holds less there and the optimizer step sets it
    "hf_end": ({"seq": 32, "mbs": 1, "framework": "hf", "recompute": "full", "gpus": 4, "fsdp": 2}, 25_573_888),
}
#: One block's parameters of the toy (q, k, v, o, gate/up/down, two norms), numel.
BLOCK = 256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 768 + 2 * 256


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("hsdp17")) / "llama.json"
    path.write_text(json.dumps(LLAMA_TOY), encoding="utf-8")
    return str(path)


def _stage(model: str, **flags: object):  # type: ignore[no-untyped-def]
    loaded = load_job(JobRequest(model=model, flags={**BASE, **flags}))
    result = estimate(loaded.model, loaded.job)
    return result.stages[0], result.assumptions


@pytest.mark.parametrize("name", list(CELLS))
def test_peak_agrees_with_trace(config: str, name: str) -> None:
    """Before: hf_end -2.26% (the held all-reduce buffers not priced); Y1 and Y3 held already."""
    flags, traced = CELLS[name]
    stage, _ = _stage(config, **flags)
    assert abs(stage.peak_allocated_bytes - stage.workspace_bytes - traced) / traced < 0.002


def test_held_all_reduce_buffers(config: str) -> None:
    """At the end of the backward the hybrid job holds the sharded gradients of every unit but the last in bf16 (the
    all-reduce's buffers)."""
    _, notes = _stage(config, **CELLS["hf_end"][0])
    # the units before the backward's last (the embedding's, under accelerate's units): the two blocks and the
    # [final norm, head] unit, each over 2 shards
    held = 2 * BLOCK // 2 + (256 + 2048 * 256) // 2
    assert any("all-reduced across the replicas" in note and f"{held:,} elements" in note for note in notes)


@pytest.mark.parametrize("flags", [
    {"framework": "torchtitan"},  # reduce in fp32, the gradients' dtype: the buffer is the gradient
    {"framework": "hf", "gpus": 2},  # one replica: full sharding over the group
    {"framework": "hf", "precision": "bf16"},  # no mixed precision: one dtype
])
def test_nothing_held_beside_the_gradients(config: str, flags: dict[str, object]) -> None:
    cell = {**CELLS["hf_end"][0], **flags}
    hybrid, notes = _stage(config, **cell)
    full, _ = _stage(config, **{**cell, "gpus": 2})
    assert hybrid == full
    assert not any("all-reduced across the replicas" in note for note in notes)


def test_fine_tuning_says_it_is_not_priced(config: str) -> None:
    _, notes = _stage(config, **{**CELLS["hf_end"][0], "peft": "lora", "lora_targets": "q_proj,v_proj"})
    assert any("not priced under fine-tuning" in note for note in notes)
