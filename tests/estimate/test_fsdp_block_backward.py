"""FSDP2's own tensors at a block's backward (memplan.estimate.fsdp_block_backward, helper rcmlp18): the block's
unsharded gradients in the compute dtype, the previous unit's reduce-scatter input, the first layer's prefetch.

The traced figures are ``memplan trace``'s (benchmarks/fsdp_block_witness.py, docs/benchmarks.md): the agreement
grid's ``llama`` toy (vocabulary 2,048, or 256), 2 ranks ``--fsdp full``, bf16-mixed, seq 256, mbs 2, sdpa, AdamW
foreach, 2 iterations, ``--device cuda``; the estimate's peak is compared less its cuBLAS workspace, as
:func:`memplan.trace.compare.compare_with_estimate` does. tests/trace/test_fsdp_block_backward_trace.py runs the trace.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.estimate.engine import estimate
from memplan.inputs import JobRequest, load_job
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY

FLAGS = {"seq": 256, "mbs": 2, "precision": "bf16-mixed", "attention": "sdpa", "optimizer": "adamw",
         "optimizer_impl": "foreach", "gpus": 2, "fsdp": "full"}
#: (vocabulary, framework, recompute) -> the trace's peak allocated and its communication there. C2: layer 0's
#: recomputed MLP backward (layer 1's fp32 reduce-scatter input, 3,016,704 B, and the embedding's unit prefetched);
#: C4/H4: layer 1's MLP backward (the head unit's reduce-scatter input in fp32 / bf16); each beside the output
#: projection's unsharded bf16 weight gradient (393,216 B).
TRACED = {(2048, "torchtitan", "full"): (31_929_344, 1_508_352 + 1_048_576),
          (256, "torchtitan", "none"): (27_360_256, 2 * 1_508_352),
          (256, "hf", "none"): (27_228_672, 2 * 1_508_352)}
#: Before (f30d0e2): -4.19%, -2.41%, -1.94%.


def _stage(tmp_path: Path, vocab: int, **flags: object):  # type: ignore[no-untyped-def]
    path = tmp_path / f"v{vocab}.json"
    path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": vocab}), encoding="utf-8")
    loaded = load_job(JobRequest(model=str(path), flags={**FLAGS, **flags}))
    return estimate(loaded.model, loaded.job)


@pytest.mark.parametrize(("vocab", "framework", "recompute"), list(TRACED))
def test_block_backward_agrees_with_the_trace(tmp_path: Path, vocab: int, framework: str, recompute: str) -> None:
    result = _stage(tmp_path, vocab, framework=framework, recompute=recompute)
    stage = result.stages[0]
    peak, communication = TRACED[(vocab, framework, recompute)]
    assert stage.peak_phase == "backward"
    assert abs(stage.peak_allocated_bytes - stage.workspace_bytes - peak) / peak < 0.001
    assert stage.communication_bytes == communication
    assert any(a.startswith("FSDP2 at a block's backward") for a in result.assumptions)


def test_the_root_unit_prefetches_nothing_at_the_first_layer(tmp_path: Path) -> None:
    """A tied head keeps one root unit (unsharded throughout): at layer 0's backward only that block is gathered."""
    from memplan.estimate.engine import _stage_parts
    from memplan.estimate.fsdp_block_backward import block_backward
    from memplan.estimate.memo import Same
    from memplan.estimate.stage_states import model_states

    path = tmp_path / "tied.json"
    path.write_text(json.dumps({**LLAMA_TOY, "tie_word_embeddings": True}), encoding="utf-8")
    loaded = load_job(JobRequest(model=str(path), flags={**FLAGS, "framework": "torchtitan", "recompute": "full"}))
    parts = _stage_parts(Same(loaded.model), loaded.job, 0.1)[1][0][2]
    terms = block_backward(parts.ctx, model_states(parts.ctx), parts.walk)
    assert terms is not None
    block = 754_176  # one decoder layer's parameters
    assert terms.prefetch == -block * 2  # the prefetched block that communication_by_phase prices, in bf16
    # layer 1 (the first block of the backward): nothing held before it (the root's post-backward is last);
    # layer 0: layer 1's reduce-scatter input in fp32, beside its own output projection's bf16 gradient
    assert terms.by_layer[1] == 393_216
    assert terms.by_layer[0] == block * 4 + 393_216 - block * 2


def test_outside_fsdp2_nothing(tmp_path: Path) -> None:
    result = _stage(tmp_path, 2048, framework="torchtitan", recompute="full", gpus=1, fsdp="none")
    assert not any(a.startswith("FSDP2 at a block's backward") for a in result.assumptions)


def test_fine_tuning_is_said_not_priced(tmp_path: Path) -> None:
    result = _stage(tmp_path, 256, framework="torchtitan", recompute="none", peft="lora", lora_targets="all-linear")
    assert any(a.startswith("FSDP2 under fine-tuning") for a in result.assumptions)


#: helper moefsdp18: the agreement grid's ``qwen3_moe_wide`` toy (32 experts, vocabulary 256), the same flags:
#: (framework, recompute) -> the trace's peak allocated (benchmarks/moe_fsdp_witness.py W1-W3). W2: layer 0's
#: recomputed gate-up grouped GEMM's backward, its experts' unsharded bf16 gradients (down 8,388,608 B, gate-up
#: 16,777,216 B) beside layer 1's fp32 reduce-scatter input; W1/W3: layer 0's pre-backward copy-out (its all-gather
#: output beside its unsharded block, before its working set). Before (5fd824c): W1 -8.10%, W2 -7.35%, W3 -3.41%.
MOE_TRACED = {("torchtitan", "none"): (290_980_864, 0.002), ("torchtitan", "full"): (288_925_184, 0.001),
              ("hf", "none"): (265_469_952, 0.002)}


@pytest.mark.parametrize(("framework", "recompute"), list(MOE_TRACED))
def test_grouped_experts_unsharded_gradients(tmp_path: Path, framework: str, recompute: str) -> None:
    from tests.trace.test_agreement_grid import _COMMON, CONFIGS

    path = tmp_path / "moe.json"
    path.write_text(json.dumps({**_COMMON, **CONFIGS["qwen3_moe_wide"]}), encoding="utf-8")
    loaded = load_job(JobRequest(model=str(path), flags={**FLAGS, "framework": framework, "recompute": recompute}))
    stage = estimate(loaded.model, loaded.job).stages[0]
    peak, bound = MOE_TRACED[(framework, recompute)]
    assert stage.peak_phase == "backward"
    assert abs(stage.peak_allocated_bytes - stage.workspace_bytes - peak) / peak < bound
