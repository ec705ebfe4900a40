"""FSDP2/TP traces record what rank 0 really allocates, checked against hand counts of its shards.

The model is a small Llama (hidden 256, 4 layers) whose sizes do not divide by 3, so FSDP2's
dim-0 padding shows: rank 0 of ``fsdp=3`` holds ``ceil(rows / 3)`` rows of every parameter
(``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, ``_init_sharded_param``: the padded
shard is ``torch.chunk``'s first chunk). Tensor parallelism divides the rows of the
column-parallel and the columns of the row-parallel projections (:data:`TP_PLAN`) first.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.core.distributed import TP_PLAN

GiB = 2**30
FP32_BYTES = 4
BF16_BYTES = 2
LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 4, 256, 640, 8, 2, 1000
CONFIG = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS,
          "vocab_size": VOCAB, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}
#: The optimizer phase holds parameters, gradients, two AdamW moments and one foreach temporary
#: per parameter (``_multi_tensor_adam``'s ``exp_avg_sq_sqrt``): 5x the parameter bytes, plus
#: CUDA's 512-byte rounding of small tensors.
OPTIMIZER_PHASE_FACTOR = 5.1


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("llama-256")) / "config.json"
    path.write_text(json.dumps(CONFIG), encoding="utf-8")
    return str(path)


def _block_shapes() -> dict[str, tuple[int, ...]]:
    kv = KV_HEADS * HIDDEN // HEADS
    return {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (kv, HIDDEN),
            "self_attn.v_proj": (kv, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
            "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
            "mlp.down_proj": (HIDDEN, INTERMEDIATE), "input_layernorm": (HIDDEN,),
            "post_attention_layernorm": (HIDDEN,)}


def _root_shapes() -> list[tuple[tuple[int, ...], str | None]]:
    # embed_tokens and norm whole on every TP rank; the untied lm_head column-parallel (HF's plan).
    return [((VOCAB, HIDDEN), None), ((HIDDEN,), None), ((VOCAB, HIDDEN), "colwise")]


def _rank0_numel(shape: tuple[int, ...], fsdp: int, tp: int, style: str | None) -> int:
    rows, rest = shape[0], math.prod(shape[1:])
    if style == "colwise":
        rows //= tp
    elif style == "rowwise":
        rest //= tp
    return math.ceil(rows / fsdp) * rest


def _block_numel(fsdp: int, tp: int) -> int:
    return sum(_rank0_numel(shape, fsdp, tp, TP_PLAN.get(path) if tp > 1 else None)
               for path, shape in _block_shapes().items())


def _root_numel(fsdp: int, tp: int) -> int:
    return sum(_rank0_numel(shape, fsdp, tp, style if tp > 1 else None) for shape, style in _root_shapes())


def _param_bytes(fsdp: int, tp: int) -> int:
    return (LAYERS * _block_numel(fsdp, tp) + _root_numel(fsdp, tp)) * FP32_BYTES


@pytest.mark.parametrize(("fsdp", "tp"), [(3, 1), (1, 2), (3, 2)])
def test_rank0_states_are_its_shards(config_path: str, fsdp: int, tp: int) -> None:
    # foreach keeps Adam's step counters on the host, so every optimizer state is a shard.
    result = trace(config_path, seq=64, mbs=1, precision="bf16-mixed", device="cuda", fsdp=fsdp, tp=tp,
                   optimizer_impl="foreach")
    states = result.summary.max_requested_by_category
    param_bytes = _param_bytes(fsdp, tp)
    assert states["parameter"] == param_bytes
    assert states["gradient"] == param_bytes
    assert states["optimizer_state"] == 2 * param_bytes  # AdamW: exp_avg, exp_avg_sq
    # DTensor's sharding propagation runs the optimizer's foreach ops on unsharded placeholders;
    # recorded, they made this phase 9-20x the parameter bytes.
    assert result.summary.by_phase["optimizer"] <= OPTIMIZER_PHASE_FACTOR * param_bytes


def test_fsdp_all_gathers_one_block_in_bf16(config_path: str) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16): each FSDP unit all-gathers N padded bf16 shards; outside the
    decoder layers the embedding and [norm, untied head] are units of their own (accelerate's
    ``fsdp2_prepare_model`` for the default ``hf`` framework, as torchtitan's ``apply_fsdp``)."""
    fsdp = 3
    result = trace(config_path, seq=64, mbs=1, precision="bf16-mixed", device="cuda", fsdp=fsdp)
    largest: dict[str, int] = {}
    for event in result.trace.events:
        if event.kind == "alloc" and event.category == "communication" and event.phase == "forward" \
                and event.iteration == 1:
            largest[event.module] = max(largest.get(event.module, 0), event.size)
    for layer in range(LAYERS):
        assert largest[f"model.layers.{layer}"] == fsdp * _block_numel(fsdp, 1) * BF16_BYTES
    outer = {module: size for module, size in largest.items() if not module.startswith("model.layers.")}
    assert len(outer) == 2, outer
    assert sum(outer.values()) == fsdp * _root_numel(fsdp, 1) * BF16_BYTES


def test_fsdp_does_not_shard_activations(config_path: str) -> None:
    """fp32 (no mixed-precision policy, no autocast): the saved activations are the single rank's.

    So are the logits: the root's unsharded parameters, alive from its forward to its backward,
    are FSDP communication buffers in the first iteration too (allocated by ``torch.empty`` there,
    by ``resize_`` later).
    """
    single = trace(config_path, seq=64, mbs=2, precision="fp32", device="cuda", optimizer_impl="foreach")
    sharded = trace(config_path, seq=64, mbs=2, precision="fp32", device="cuda", fsdp=3, optimizer_impl="foreach")
    for category in ("activation", "logits"):
        expected = single.summary.max_requested_by_category[category]
        assert abs(sharded.summary.max_requested_by_category[category] - expected) <= 0.02 * expected


def test_llama_1b_fsdp8_peak_is_its_shards_not_the_whole_model() -> None:
    """Recording the propagation placeholders reported 16.7 GiB here; rank 0 holds ~4.4 GiB."""
    result = trace("llama-3.2-1b", seq=128, mbs=1, precision="bf16-mixed", device="cuda", fsdp=8)
    assert result.summary.peak_allocated_bytes < 6 * GiB


def test_dtensor_operator_records_the_local_shard_only() -> None:
    """An elementwise op on a Shard(0) DTensor: rank 0 allocates its 1/4, not the global placeholder."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from memplan.trace.core.distributed import simulated_ranks
    from memplan.trace.setup import trace_setup
    from memplan.trace.core.recorder import AllocationRecorder
    from memplan.trace.core.tracker import TracingFakeMode

    rows, cols, ranks = 77, 131, 4  # shapes no other test uses: DTensor caches propagation results
    mode = TracingFakeMode(allow_non_fake_inputs=True)
    recorder = AllocationRecorder()
    with simulated_ranks(trace_setup(fsdp=ranks)) as mesh, mode:
        sharded = DTensor.from_local(torch.empty(rows, cols), mesh, [Shard(0)], run_check=False)
        mode.recorder = recorder
        doubled = sharded * 2
        mode.recorder = None
    assert doubled.shape == (rows * ranks, cols)
    assert [event.size for event in recorder.events(drop_host=False)] == [rows * cols * FP32_BYTES]
