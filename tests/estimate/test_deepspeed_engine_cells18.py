"""DeepSpeed ZeRO cells Z8-Z11b (docs/benchmarks.md, helper zero18; DeepSpeed 0.19.8's real engine on CPU, gloo, world
size 2, tiny4 Llama, seq 32, reduce_bucket_size 1e5, benchmarks/deepspeed_engine_witness.py, results
benchmarks/results/deepspeed_engine_witness_f30d0e2.json and deepspeed_engine_witness.json): the engine's most live
bytes on the rank holding the most against memplan's moments less the CUDA workspaces."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.estimate.test_deepspeed_engine_moments import _at, _ledger

LORA = {"peft": "lora", "lora_rank": 8, "lora_targets": "q_proj,v_proj"}

#: (cell, ZeRO stage, zero_optimization keys, memplan flags, the engine's census at the entry of the backward's
#: reduction epilogue, ``overlapping_partition_gradients_reduce_epilogue``)
EPILOGUE = [
    ("Z8 ZeRO-3 prefetch 2e6", 3, {"stage3_prefetch_bucket_size": 2_000_000}, {}, 32_737_625),
    ("Z10 ZeRO-3 LoRA threshold 1e3", 3, {"stage3_param_persistence_threshold": 1_000}, LORA, 4_192_873),
]


@pytest.mark.parametrize("cell, stage, keys, flags, engine", EPILOGUE, ids=[c[0] for c in EPILOGUE])
def test_zero3_end_of_backward_holds_no_gathered_parameter(tmp_path: Path, cell: str, stage: int, keys: dict,
                                                           flags: dict, engine: int) -> None:
    """Each module is released after its own backward: at the epilogue's last reduction only the persistent
    parameters are gathered (memplan held the whole backward's gathered set there: Z8 +14.5%, Z10 +150.6%)."""
    ledger = _ledger(tmp_path, stage, 2, flags, **keys)
    assert _at(ledger, "end of backward") == pytest.approx(engine, rel=0.02)
    assert _at(ledger, "backward") > _at(ledger, "end of backward")  # the layer's backward keeps its set


#: (cell, stage, keys, flags, the engine's forward (with loss), the most live in the backward (after a layer, at a
#: reduction or at a layer's backward entry), after backward, step)
MOMENTS = [
    ("Z8 ZeRO-3 prefetch 2e6", 3, {"stage3_prefetch_bucket_size": 2_000_000}, {},
     42_177_357, 38_499_805, 31_713_613, 40_641_125),
    ("Z10 ZeRO-3 LoRA threshold 1e3", 3, {"stage3_param_persistence_threshold": 1_000}, LORA,
     19_871_453, 11_847_149, 4_176_477, 4_237_429),
]


@pytest.mark.parametrize("cell, stage, keys, flags, forward, backward, after, step", MOMENTS,
                         ids=[c[0] for c in MOMENTS])
def test_zero17_moments_within_two_percent(tmp_path: Path, cell: str, stage: int, keys: dict, flags: dict,
                                           forward: int, backward: int, after: int, step: int) -> None:
    ledger = _ledger(tmp_path, stage, 2, flags, **keys)
    assert max(_at(ledger, "forward"), _at(ledger, "loss")) == pytest.approx(forward, rel=0.02)
    assert _at(ledger, "backward") == pytest.approx(backward, rel=0.02)
    assert _at(ledger, "optimizer step") == pytest.approx(step, rel=0.02)
    states = sum(ledger.total(c, "end of backward") for c in ("parameters", "gradients", "master", "optimizer"))
    assert states < after  # the kept buffers (bucket, persistent parameters) are the rest


def test_modules_to_save_copy_keeps_an_fp32_master_and_moments(tmp_path: Path) -> None:
    """Z11b (ZeRO-3, zero.Init, bf16 LoRA adapters, peft modules_to_save lm_head): DeepSpeed's engine keeps the bf16
    head copy's partition with an fp32 master (``fp32_partitioned_groups_flat``) and fp32 moments, 16 B per element
    with its bf16 gradient partition; the engine holds 8,354,397 B after the backward and after the step (memplan
    priced the copy's moments in bf16 and no master: 7,329,856 B, -12.3%)."""
    flags = {**LORA, "modules_to_save": "lm_head", "adapter_dtype": "bf16"}
    ledger = _ledger(tmp_path, 3, 2, flags)
    kept = ledger.total("communication") + sum(  # as the witness: the buffers kept between steps
        c.nbytes for c in ledger.entries if c.category == "communication" and c.live
               and ("ZeRO-3 reduce bucket:" in c.note or "persistent parameters:" in c.note))
    for phase in ("end of backward", "forward"):
        states = sum(ledger.total(c, phase) for c in ("parameters", "gradients", "master", "optimizer"))
        assert states - ledger.total("absent", phase) + kept == pytest.approx(8_354_397, rel=0.02)
    assert ledger.total("master", "forward") >= 128_000 * 4  # the copy's partition (256,000 / 2 ranks) in fp32


def test_modules_to_save_head_copy_backward_holds_its_gradient_not_the_root(tmp_path: Path) -> None:
    """Z11b at a layer's backward entry (helper zero18b): the engine holds neither the frozen embedding nor the head
    gathered (the copy replaces the head, its backward runs first and releases it) but the head copy's whole bf16
    gradient, 512,000 B: 14,452,205 B; its reduction epilogue 8,354,409 B. memplan kept the full-training gathered
    set there: 15,414,720 (+6.66%), and the 512,000 B at the epilogue (8,865,856, +6.12%)."""
    flags = {**LORA, "modules_to_save": "lm_head", "adapter_dtype": "bf16"}
    ledger = _ledger(tmp_path, 3, 2, flags)
    assert _at(ledger, "backward") == pytest.approx(14_452_205, rel=0.02)
    assert _at(ledger, "end of backward") == pytest.approx(8_354_409, rel=0.02)
    copy = [c for c in ledger.entries if "modules_to_save copy's whole gradient" in c.note]
    assert [(c.nbytes, c.live) for c in copy] == [(512_000, ("backward",))]
