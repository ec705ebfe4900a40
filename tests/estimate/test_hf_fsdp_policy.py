"""The Hugging Face Trainer's FSDP as accelerate runs it (helper hffsdp16, docs/benchmarks.md): FSDP2 with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` (accelerate's ``FullyShardedDataParallelPlugin.
set_mixed_precision``) and the forward under ``torch.autocast`` (``Accelerator.prepare_model``), against torchtitan's
``reduce_dtype=fp32`` without autocast. The traced figures are ``memplan trace``'s of the same jobs
(tests/trace/test_hf_fsdp_trace.py runs them): the agreement grid's ``llama`` toy, 2 ranks ``--fsdp full``,
bf16-mixed, seq 256, mbs 2, sdpa, AdamW foreach, 2 iterations, ``--device cuda``; the estimate's peak less its
cuBLAS workspace, as :func:`memplan.trace.compare.compare_with_estimate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.estimate.precision import resolve_precision
from memplan.inputs import JobRequest, load_job
from memplan.profiles import get_profile
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY

FLAGS = {"seq": 256, "mbs": 2, "precision": "bf16-mixed", "attention": "sdpa", "optimizer": "adamw",
         "optimizer_impl": "foreach", "gpus": 2, "fsdp": "full"}
#: (vocabulary, framework, recompute) -> the trace's peak allocated, bytes.
TRACED = {(2048, "hf", "full"): 30_595_072, (256, "hf", "none"): 27_228_672}
#: The vocab-256 toy with a tied head, hf, ``none``: one unit holds the embedding, the final norm and the head
#: (accelerate's tail unit with a tied head), kept unsharded to the end of the backward, as the root's.
TRACED_TIED = 26_835_456


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    folder = Path(tmp_path_factory.mktemp("hffsdp16"))
    out = {}
    for vocab in (2048, 256):
        path = folder / f"v{vocab}.json"
        path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": vocab}), encoding="utf-8")
        out[vocab] = str(path)
    path = folder / "v256_tied.json"
    path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": 256, "tie_word_embeddings": True}), encoding="utf-8")
    out[0] = str(path)
    return out


def _loaded(model: str, **flags: object):  # type: ignore[no-untyped-def]
    return load_job(JobRequest(model=model, flags={**FLAGS, **flags}))


@pytest.mark.parametrize(("flags", "reduce_bytes"), [
    ({"framework": "hf"}, 2),  # accelerate: reduce_dtype = the mixed-precision dtype
    ({"framework": "hf", "precision": "fp16-mixed"}, 2),
    ({"framework": "torchtitan"}, 4),  # torchtitan: reduce_dtype fp32
    ({"framework": "hf", "gpus": 1, "fsdp": "none"}, 4),  # no FSDP: the gradients' dtype
])
def test_reduce_dtype(configs: dict[int, str], flags: dict[str, object], reduce_bytes: int) -> None:
    job = _loaded(configs[2048], **flags).job
    assert resolve_precision(job, get_profile(job.framework)).reduce_bytes == reduce_bytes


def test_reduce_scatter_input_in_bf16(configs: dict[int, str]) -> None:
    """Before: hf's block reduce-scatter input priced in fp32, the gradients' dtype (+2.83% on this job)."""
    from memplan.estimate.engine import estimate

    loaded = _loaded(configs[2048], framework="hf", recompute="full")
    stage = estimate(loaded.model, loaded.job).stages[0]
    peak = TRACED[(2048, "hf", "full")]
    assert abs(stage.peak_allocated_bytes - stage.workspace_bytes - peak) / peak < 0.002
    assert any("reduce-scatters the gradients in bf16" in note for note in
               resolve_precision(loaded.job, get_profile("hf")).notes)


def test_first_backward_block_holds_no_reduce_scatter_input(configs: dict[int, str]) -> None:
    """At the first block's backward, which sets the peak here (layer 1 of two, every activation still saved), no
    block's reduce-scatter input is alive in the trace: the root unit's post-backward comes at the end of the
    backward, and a block's input is made only after its own backward. Before: one block's input priced there
    (+1,508,352 B, +4.2%)."""
    from memplan.categories import MemoryCategory as Category
    from memplan.estimate.engine import estimate

    loaded = _loaded(configs[0], framework="hf", recompute="none")
    stage = estimate(loaded.model, loaded.job).stages[0]
    assert stage.peak_phase == "backward"
    assert abs(stage.peak_allocated_bytes - stage.workspace_bytes - TRACED_TIED) / TRACED_TIED < 0.02
    block = (256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 768 + 2 * 256) * 2
    root = (256 * 256 + 256) * 2
    assert stage.by_category()[Category.COMMUNICATION] == 2 * block + root


def test_outer_units_as_accelerate(configs: dict[int, str]) -> None:
    """accelerate's fsdp2_prepare_model: the embedding a unit resharded after its forward, [final norm, head] a
    unit kept unsharded (an untied head); at the first block's backward the two blocks alone are unsharded.
    Before (one root unit): the embedding and head unsharded beside them, the trace's peak -0.5% lower."""
    from memplan.categories import MemoryCategory as Category
    from memplan.estimate.engine import estimate

    loaded = _loaded(configs[256], framework="hf", recompute="none")
    stage = estimate(loaded.model, loaded.job).stages[0]
    block = (256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 768 + 2 * 256) * 2
    assert stage.peak_phase == "backward"
    assert stage.by_category()[Category.COMMUNICATION] == 2 * block
    peak = TRACED[(256, "hf", "none")]
    assert abs(stage.peak_allocated_bytes - stage.workspace_bytes - peak) / peak < 0.02
