"""FSDP2's forward all-gathers (memplan.estimate.fsdp_forward_gather; helper fsdpcomm18, docs/benchmarks.md).

torch 2.13 ``FSDPParamGroup.wait_for_unshard`` parks a unit's all-gather output (``foreach_all_gather``'s flat
buffer) past its copy-out in the forward and drops it at the next unit's ``wait_for_unshard``, whose local
reference keeps it through that unit's copy-out (``foreach_all_gather_copy_out`` allocating the unsharded
parameters): three copies at a later block's copy-out. The traced figures are ``memplan trace``'s communication
category at its highest (benchmarks/fsdpcomm18_witness.py; the tied toys traced by this helper the same way).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.inputs import JobRequest, load_job
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY

TOY = {"seq": 256, "mbs": 2, "precision": "bf16-mixed", "attention": "sdpa", "optimizer": "adamw",
       "optimizer_impl": "foreach", "gpus": 2, "fsdp": "full", "recompute": "none"}
#: One toy block's unsharded bf16 parameters (hsdp17: every FSDP cell traced this much more than the estimate).
BLOCK = 1_508_352


def _estimate(model: str, **flags: object):  # type: ignore[no-untyped-def]
    from memplan.estimate.engine import estimate

    loaded = load_job(JobRequest(model=model, flags={**TOY, **flags}))
    return estimate(loaded.model, loaded.job)


def _config(tmp_path: Path, **fields: object) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_TOY, **fields}), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(("framework", "flags", "traced"), [
    ("hf", {}, 4_525_056),  # H1 (C1 the same): three blocks at layer 1's copy-out
    ("torchtitan", {}, 4_525_056),
    ("hf", {"peft": "lora", "lora_rank": 16, "lora_targets": "all-linear"}, 4_979_712),  # H3: blocks with adapters
])
def test_a_later_blocks_copy_out_holds_three_blocks(tmp_path: Path, framework: str, flags: dict[str, object],
                                                     traced: int) -> None:
    result = _estimate(_config(tmp_path), framework=framework, **flags)
    stage = result.stages[0]
    assert stage.max_communication_bytes == traced
    assert stage.peak_allocated_bytes - stage.workspace_bytes in (41_904_128, 28_157_696)  # the peak did not move
    assert any("a later block's copy-out" in note for note in result.assumptions)


@pytest.mark.parametrize(("vocab", "layers", "traced"), [
    (2048, 2, 5_574_144),  # the root unit (1,049,088 B) and three blocks
    (8192, 2, 11_406_336),  # the root twice (its output parked) and the first block twice
    (8192, 1, 11_406_336),
])
def test_one_root_unit(tmp_path: Path, vocab: int, layers: int, traced: int) -> None:
    """A tied head: one unit holds the embedding, norm and head, kept unsharded after its forward."""
    model = _config(tmp_path, tie_word_embeddings=True, vocab_size=vocab, num_hidden_layers=layers)
    assert _estimate(model, framework="hf").stages[0].max_communication_bytes == traced


def test_the_head_units_copy_out() -> None:
    """G1/G2 (qwen2.5-7b s2048 selective fsdp 8): the last block's output parked beside the head unit's output and
    parameters, as traced under both frameworks; the peak stays the loss's."""
    head, block = (3584 + 152064 * 3584) * 2, 466_115_584
    for framework in ("hf", "torchtitan"):
        result = _estimate("qwen2.5-7b", framework=framework, seq=2048, mbs=1, precision="bf16",
                           recompute="selective", gpus=8, fsdp="full")
        assert result.stages[0].max_communication_bytes == 2_646_119_424 == block + 2 * head
        assert result.stages[0].peak_phase == "loss"


def test_one_rank_makes_no_all_gather_output(tmp_path: Path) -> None:
    """World size 1: FSDP2 copies from the local shard (no flat buffer), so nothing beyond the unsharded units."""
    result = _estimate(_config(tmp_path), framework="hf", gpus=1)
    assert result.stages[0].max_communication_bytes < 3 * BLOCK
    assert not any("copy-out" in note for note in result.assumptions)
