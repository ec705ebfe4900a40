"""PEFT adapters under FSDP's mixed precision (memplan.estimate.finetune.adapter_compute_bytes): FSDP2 all-gathers
the fp32 adapters in ``MixedPrecisionPolicy.param_dtype`` with the rest of each unit, so they run and save in 16
bits, while the sharded adapters, their gradients and optimizer states stay fp32.

The figures below are ``memplan trace``'s (helper fsdp16, docs/benchmarks.md): the agreement grid's ``llama`` toy,
2 ranks ``--fsdp full`` bf16-mixed (param bf16, reduce fp32), LoRA r 16 all-linear, seq 256, mbs 2, sdpa, AdamW
foreach, 2 iterations, ``--device cuda``; the estimate's peak is compared less its cuBLAS workspace, as
:func:`memplan.trace.compare.compare_with_estimate` does. tests/trace/test_fsdp_adapters_trace.py runs the trace.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.categories import MemoryCategory as Category
from memplan.estimate.precision import resolve_precision
from memplan.inputs import JobRequest, load_job
from memplan.profiles import get_profile

#: tests/trace/test_agreement_grid.py's ``llama`` config with its common fields.
LLAMA_TOY = {"max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6,
             "model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
             "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 2048, "tie_word_embeddings": False}
FLAGS = {"seq": 256, "mbs": 2, "precision": "bf16-mixed", "attention": "sdpa", "optimizer": "adamw",
         "optimizer_impl": "foreach", "gpus": 2, "fsdp": "full", "peft": "lora", "lora_rank": 16,
         "lora_targets": "all-linear"}

#: (framework, recompute) -> the trace's (peak allocated, activations), bytes. The peaks are at the loss's backward,
#: where the final norm and head's unit is unsharded (torchtitan's and accelerate's outer units).
TRACED = {("torchtitan", "none"): (28_163_072, 11_051_040), ("torchtitan", "full"): (18_195_456, 1_085_440),
          ("hf", "none"): (28_163_072, 11_051_040)}
#: The same at vocabulary 256 (the grid's ``llama_v256``), where layer 1's backward sets the peak, beside the two
#: unsharded blocks (computing + prefetched) with their adapters in bf16: (peak, activations + temporaries).
TRACED_V256 = {("torchtitan", "none"): (18_258_432, 12_378_624)}


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("fsdp16")) / "config.json"
    path.write_text(json.dumps(LLAMA_TOY), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def toy_v256(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("fsdp16_v256")) / "config.json"
    path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": 256}), encoding="utf-8")
    return str(path)


def _job(model: str, **flags: object):  # type: ignore[no-untyped-def]
    return load_job(JobRequest(model=model, flags={**FLAGS, **flags}))


@pytest.mark.parametrize(("flags", "expected"), [
    ({}, 2),  # FSDP2's param_dtype bf16
    ({"framework": "hf"}, 2),  # the Trainer's FSDP (accelerate: MixedPrecisionPolicy(param_dtype=bf16))
    ({"precision": "fp16-mixed"}, 2),
    ({"precision": "bf16"}, 4),  # no policy: the fp32 adapters stay fp32 and peft casts the input
    ({"gpus": 1, "fsdp": "none"}, 4),  # torch.autocast: the fp32 adapters' weights are cast per use, not stored
    ({"adapter_dtype": "bf16"}, 2),
])
def test_adapters_compute_in_fsdp_param_dtype(toy: str, flags: dict[str, object], expected: int) -> None:
    from memplan.estimate.finetune import adapter_compute_bytes

    job = _job(toy, **{"framework": "torchtitan", **flags}).job
    prec = resolve_precision(job, get_profile(job.framework))
    assert adapter_compute_bytes(job, prec.weight_copies) == expected


@pytest.mark.parametrize(("framework", "recompute"), list(TRACED))
def test_toy_agrees_with_the_trace(toy: str, framework: str, recompute: str) -> None:
    """Before: peft's fp32 input casts and fp32 lora_A outputs priced (activations +63.8%, peak +25.0% without
    recompute; +5.5% with full recompute, where the recompute makes them again)."""
    from memplan.estimate.engine import estimate

    loaded = _job(toy, framework=framework, recompute=recompute)
    stage = estimate(loaded.model, loaded.job).stages[0]
    peak, activations = TRACED[(framework, recompute)]
    assert abs(stage.peak_allocated_bytes - stage.workspace_bytes - peak) / peak < 0.002
    assert abs(stage.highest_by_category()[Category.ACTIVATION] - activations) / activations < 0.002


def test_unsharded_blocks_hold_their_adapters(toy_v256: str) -> None:
    """Before: the two unsharded blocks without their adapters (-303,104 B, -1.78%)."""
    from memplan.estimate.engine import estimate

    loaded = _job(toy_v256, framework="torchtitan")
    stage = estimate(loaded.model, loaded.job).stages[0]
    peak, _ = TRACED_V256[("torchtitan", "none")]
    assert stage.peak_phase == "backward"
    assert abs(stage.peak_allocated_bytes - stage.workspace_bytes - peak) / peak < 0.002
    blocks = 2 * (256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 768 + 2 * 256 + 75_776) * 2  # weights, norms, adapters
    assert stage.by_category()[Category.COMMUNICATION] == blocks


def test_states_stay_fp32(toy: str) -> None:
    """The sharded adapters, gradients and Adam moments: fp32, half on each of the two ranks (the trace's too)."""
    from memplan.estimate.engine import estimate

    loaded = _job(toy, framework="torchtitan")
    stage = estimate(loaded.model, loaded.job).stages[0]
    adapters = 2 * (16 * (256 + 256) * 2 + 16 * (256 + 64) * 2 + 16 * (256 + 768) * 3)  # q,o; k,v; gate,up,down
    assert stage.highest_by_category()[Category.GRADIENT] == adapters * 4 // 2
    assert stage.highest_by_category()[Category.OPTIMIZER_STATE] == 2 * adapters * 4 // 2


@pytest.mark.parametrize("peft", ["dora", "lora"])
def test_a_frozen_fp32_base_computes_in_fsdps_param_dtype_too(toy: str, peft: str) -> None:
    """FSDP2's unsharded copy takes ``param_dtype`` for every floating parameter, frozen ones too, so an fp32 frozen base
    (``--frozen-dtype fp32``) runs as a bf16 one does: DoRA's ``weight.to(x.dtype)`` casts nothing and the activations
    and forward temporaries are those of the bf16 base (the review of session 16: DoRA priced a 4-byte base cast)."""
    from memplan.estimate.engine import _stage_parts
    from memplan.estimate.memo import Same

    def moments(frozen: str) -> dict[str, tuple[int, int]]:
        loaded = _job(toy, peft=peft, frozen_dtype=frozen)
        ledger = _stage_parts(Same(loaded.model), loaded.job, 0.1)[1][0][2].ledger
        return {m: (ledger.total("activations", m), ledger.total("temporary", m)) for m in ("forward", "backward")}

    assert moments("fp32") == moments("bf16")
