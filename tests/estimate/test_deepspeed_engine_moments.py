"""DeepSpeed ZeRO-1/2/3 at world size 1 and 2 as the engine allocates (docs/benchmarks.md, helper zero17; DeepSpeed
0.19.8's real engine on CPU, gloo, tiny4 Llama, seq 32, reduce_bucket_size 1e5, benchmarks/deepspeed_engine_witness.py,
benchmarks/results/deepspeed_engine_witness.json): the most live bytes of the second step's backward and optimizer
step on the rank holding the most, against memplan's ``backward`` and ``optimizer step`` moments less the CUDA
workspaces the CPU engine does not have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.estimate.engine import _stage_parts
from memplan.estimate.memo import Same
from memplan.inputs import JobRequest, load_job
from tests.estimate.test_zero3_dtypes import TINY4


def _ledger(tmp_path: Path, stage: int, gpus: int, flags: dict | None = None,  # type: ignore[no-untyped-def]
            **keys: object):
    (tmp_path / "config.json").write_text(json.dumps(TINY4))
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000, **keys}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    loaded = load_job(JobRequest(model=str(tmp_path / "config.json"), flags={
        "gpus": gpus, "seq": 32, "deepspeed_config": str(tmp_path / "ds.json"), **(flags or {})}))
    _, parts = _stage_parts(Same(loaded.model), loaded.job, 0.0)
    return parts[0][2].ledger


def _at(ledger, phase: str) -> int:  # type: ignore[no-untyped-def]
    return ledger.allocated_at(phase) - ledger.total("workspace", phase)


#: (cell, ZeRO stage, world size, the engine's most live bytes in the backward, in the optimizer step).
ENGINE = [
    ("Z1 ZeRO-2 world 1", 2, 1, 61_114_200, 80_881_680),
    ("Z2 ZeRO-2 world 2", 2, 2, 35_379_544, 44_248_336),
    ("Z3 ZeRO-3 world 1", 3, 1, 61_070_301, 81_081_701),
    ("Z4 ZeRO-3 world 2", 3, 2, 38_499_805, 40_641_125),
    ("Z6 ZeRO-1 world 2", 1, 2, 36_618_580, 44_248_336),
]


@pytest.mark.parametrize("cell, stage, gpus, backward, step", ENGINE, ids=[c[0] for c in ENGINE])
def test_backward_and_step_match_the_engine(tmp_path: Path, cell: str, stage: int, gpus: int, backward: int,
                                            step: int) -> None:
    ledger = _ledger(tmp_path, stage, gpus)
    assert _at(ledger, "backward") == pytest.approx(backward, rel=0.02)
    assert _at(ledger, "optimizer step") == pytest.approx(step, rel=0.02)


def test_zero3_at_one_rank_gathers_nothing(tmp_path: Path) -> None:
    """Z3: at world size 1 the partition is the whole parameter (``_no_gather_coalesced``): no gathered or persistent
    copy; the reduce bucket (200,000 B) stays."""
    one, two = _ledger(tmp_path, 3, 1), _ledger(tmp_path, 3, 2)
    assert one.total("communication", "loss") == 200_000
    assert two.total("communication", "loss") > 200_000
    assert any("one data-parallel rank" in n for n in one.notes())


def test_zero2_holds_its_whole_partition_from_the_first_reduction(tmp_path: Path) -> None:
    """Z1: the head's 256,000 gradients fill the 1e5 bucket before any layer's backward: the partition (every
    gradient at world size 1, 7,352,832 B) is allocated whole beside the layers' activations."""
    ledger = _ledger(tmp_path, 2, 1)
    walked = ledger.total("temporary", "backward")
    assert walked >= 7_352_832
    assert any("whole gradient partition" in n for n in ledger.notes())


def test_zero1_step_holds_only_the_partition(tmp_path: Path) -> None:
    """Z6: at the step ZeRO-1 holds its partition (3,676,416 B at world size 2), not the full gradients."""
    ledger = _ledger(tmp_path, 1, 2)
    assert ledger.total("gradients", "optimizer step") - ledger.total("absent", "optimizer step") == 3_676_416


def test_zero2_offload_keeps_a_device_staging_buffer(tmp_path: Path) -> None:
    """Z7 (world size 1, offload_optimizer cpu): the device holds the bf16 weights and a buffer of the largest
    parameter (the 256,000-element head, 512,000 B) after the step (7,865,352 B); in the backward the head's gradient
    waits beside it for the first reduction (10,156,392 B)."""
    ledger = _ledger(tmp_path, 2, 1, offload_optimizer={"device": "cpu"})
    after_step = sum(ledger.total(c, "forward") for c in ("parameters", "gradients", "master", "optimizer")) \
        + ledger.total("communication", "forward")
    assert after_step == pytest.approx(7_865_352, rel=0.001)
    assert _at(ledger, "backward") == pytest.approx(10_156_392, rel=0.02)


#: Z4 (ZeRO-3 world 2) and Z5 (the same, zero.Init + LoRA r8 q_proj,v_proj): the most live in the forward, at the last
#: layer's forward, holds the prefetch's flat all-gather buffer (the 2,625,536 non-persistent parameters, 5,251,072 B)
#: beside every parameter's own gathered copy.
FORWARD = [("Z4", None, 43_767_373), ("Z5 LoRA", {"peft": "lora", "lora_rank": 8, "lora_targets": "q_proj,v_proj"},
                                      18_036_445)]


@pytest.mark.parametrize("cell, flags, engine", FORWARD, ids=[c[0] for c in FORWARD])
def test_zero3_forward_holds_the_prefetch_buffer(tmp_path: Path, cell: str, flags: dict | None, engine: int) -> None:
    ledger = _ledger(tmp_path, 3, 2, flags)
    assert max(_at(ledger, "forward"), _at(ledger, "loss")) == pytest.approx(engine, rel=0.02)
    assert any("flat buffer of its last coalesced all-gather (2,625,536" in n for n in ledger.notes())


def test_zero3_one_rank_with_offloaded_parameters_gathers_copies(tmp_path: Path) -> None:
    """At one data-parallel rank the engine points a parameter at its partition, unless the partitions are in host
    memory (``offload_param``): then ``NoGatherHandle`` copies each fetched one to the GPU, a gathered copy as on more
    ranks (review of session 17's merges: the one-rank rule had dropped them for offloaded parameters too)."""
    on_gpu = _ledger(tmp_path, 3, 1)
    offloaded = _ledger(tmp_path, 3, 1, {"offload_params": True})
    assert on_gpu.total("communication", "backward") < offloaded.total("communication", "backward")
    assert not any("points the parameter at its partition" in note for note in offloaded.notes())
    assert any("points the parameter at its partition" in note for note in on_gpu.notes())


def test_zero2_offload_waits_for_one_gradient_not_a_bucket(tmp_path: Path) -> None:
    """With contiguous gradients each gradient is copied into the reduce bucket and becomes a view of it: one raw
    gradient waits at a time (at most the largest parameter: tiny4's head, 256,000 elements), however large the
    bucket (review of session 17's merges: a 1e6-element bucket had priced 1e6 waiting elements)."""
    ledger = _ledger(tmp_path, 2, 1, {"offload_optimizer": True}, reduce_bucket_size=1_000_000)
    assert any("at most the largest parameter, 256,000 elements" in note for note in ledger.notes())
