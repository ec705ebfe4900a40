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


#: The witness's V1 (benchmarks/hsdp_witness.py, helper hybridft18): hf, LoRA r 8 on q and v, 2 replicas x 2 shards.
LORA = {"seq": 256, "mbs": 2, "framework": "hf", "recompute": "none", "gpus": 4, "fsdp": 2, "peft": "lora",
        "lora_rank": 8, "lora_targets": "q_proj,v_proj"}
#: One toy layer's LoRA r 8 on q (256 -> 256) and v (256 -> 64), numel.
LORA_LAYER = 8 * 256 + 256 * 8 + 8 * 256 + 64 * 8


def _held(notes: tuple[str, ...]) -> list[str]:
    return [note for note in notes if "all-reduced across the replicas" in note]


@pytest.mark.parametrize(("flags", "layer"), [
    ({}, LORA_LAYER),
    ({"recompute": "full"}, LORA_LAYER),
    ({"lora_targets": "all-linear"}, 8 * (4 * 256 + 2 * (256 + 64) + 2 * (256 + 768) + (768 + 256))),
    ({"peft": "dora"}, LORA_LAYER + 256 + 64),  # DoRA's magnitude vectors
])
def test_fine_tuning_holds_the_adapters_buffers(config: str, flags: dict[str, object], layer: int) -> None:
    """Before: said, not priced ("not priced under fine-tuning"). FSDP2 reduces only a unit's parameters with a
    gradient: each layer's fp32 adapters, sharded over 2, held in bf16 (the trace all-reduces 3,328 bf16 elements
    per layer in V1, tests/trace/test_hsdp_trace.py); the frozen embedding's unit, last, reduces nothing."""
    _, notes = _stage(config, **{**BASE, **LORA, **flags})
    held = 2 * layer // 2
    assert len(_held(notes)) == 1 and f"{held:,} elements, every decoder layer's" in _held(notes)[0]
    assert not any("not priced under fine-tuning" in note for note in notes)


def test_fine_tuning_held_at_the_end_of_the_backward(config: str) -> None:
    """The held buffers are the end of the backward's communication only: hybrid = full over the group, but there."""
    from memplan.estimate import engine

    ledgers = []
    real = engine.stage_parts

    def spy(ctx):  # type: ignore[no-untyped-def]
        out = real(ctx)
        ledgers.append(out[2].ledger)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "stage_parts", spy)
        _stage(config, **{**LORA, "recompute": "full"})
        _stage(config, **{**LORA, "recompute": "full", "gpus": 2})
    hybrid, full = ledgers
    for phase in hybrid.phases:
        more = hybrid.allocated_at(phase) - full.allocated_at(phase)
        assert more == (2 * LORA_LAYER // 2 * 2 if phase == "end of backward" else 0), phase


@pytest.mark.parametrize("flags", [
    {"framework": "torchtitan"},  # reduce in fp32, the adapters' dtype: the buffer is the gradient
    {"adapter_dtype": "bf16"},  # accelerate's bf16 reduce in the adapters' own dtype
    {"gpus": 2},  # one replica
])
def test_fine_tuning_holds_nothing_beside_the_gradients(config: str, flags: dict[str, object]) -> None:
    hybrid, notes = _stage(config, **{**LORA, **flags})
    full, _ = _stage(config, **{**LORA, **flags, "gpus": 2})
    assert hybrid == full and not _held(notes)


def test_fine_tuning_two_trained_dtypes_is_said(config: str) -> None:
    """Adapters beside a trained base module: FSDP2 wants one dtype per unit; said, not priced."""
    _, notes = _stage(config, **{**LORA, "trainable": "norm"})
    assert any("not priced where a stage trains adapters beside base weights" in note for note in notes)
