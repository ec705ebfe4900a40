"""Megatron fine-grained activation offloading: groups, Megatron's keep rules, the Megatron flags.

Hand-computed figures follow memplan/estimate/fine_offload.py's reading of Megatron-LM
(megatron/core/pipeline_parallel/fine_grained_activation_offload.py).
"""

from __future__ import annotations

import pytest

from memplan import estimate, load_model
from memplan.errors import ConfigError, JobConfigError
from memplan.estimate.fine_offload import offloaded
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.jobflags import build_job
from memplan.units import MiB

LLAMA = load_model("llama-3.1-8b")
BASE = {"gpus": 8, "tp": 2, "sequence_parallel": True, "seq": 4096}
#: llama-3.1-8b, tp 2, s 4096, b 1, bf16: q, k, v = 4096 x (4096 + 2 x 1024) x 2 B / 2 = 24 MiB;
#: the output projection's input 4096 x 4096 x 2 B / 2 = 16 MiB (one layer, one rank).
QKV, PROJ = 24 * MiB, 16 * MiB


def _stages(**flags):  # type: ignore[no-untyped-def]
    return estimate(LLAMA, build_job({**BASE, **flags})).stages


def test_core_attention_groups_leave_but_the_last_layers_stay() -> None:
    eager, = _stages()
    moved, = _stages(offload_modules="core_attn,attn_proj")
    # 32 layers x (q, k, v + projection input), less the last layer's two groups (the reload margin)
    assert moved.cpu_activations_bytes == 31 * (QKV + PROJ)
    assert eager.peak_phase == moved.peak_phase == "loss"
    assert eager.peak_allocated_bytes - moved.peak_allocated_bytes == 31 * (QKV + PROJ)


def test_the_backward_reloads_two_groups_and_pipeline_ranks_keep_their_delta() -> None:
    eager = _stages(pp=2, gbs=16)[0]
    moved = _stages(pp=2, gbs=16, offload_modules="core_attn,attn_proj")[0]
    assert moved.peak_phase == "backward" and moved.inflight_microbatches == 2
    assert moved.cpu_activations_bytes == 2 * 16 * (QKV + PROJ) - (QKV + PROJ)
    # the backward holds the group in use and the next one of its chunk, reloaded ahead (neighbours: a
    # layer's q, k, v group and its projection-input group)
    assert eager.peak_allocated_bytes - moved.peak_allocated_bytes == moved.cpu_activations_bytes - (QKV + PROJ)
    last = _stages(pp=2, gbs=16, offload_modules="core_attn", offload_pp_delta=2 * QKV)[1]
    # rank 1 keeps 2 x 24 MiB from its first groups; the last layer's group stays (margin and last stage)
    assert last.cpu_activations_bytes == (16 - 1 - 2) * QKV


def test_rules_in_megatrons_order() -> None:
    chunk = [("core_attn", 10), ("attn_proj", 5), ("core_attn", 10), ("attn_proj", 5)]
    assert offloaded([chunk], fraction=1.0, keep_bytes=0, last_stage=False).cpu_bytes == 15  # margin: last of each
    two = offloaded([chunk, chunk], fraction=1.0, keep_bytes=0, last_stage=False)
    assert (two.cpu_bytes, two.reload_bytes) == (15 + 30, 15)  # neighbours: 10 + 5, never the two 10s
    alone = offloaded([[("core_attn", 10)], [("core_attn", 7)]], fraction=1.0, keep_bytes=0, last_stage=False)
    assert alone.reload_bytes == 7  # one offloaded group per chunk (the first chunk keeps its last): itself
    # fraction 0.5: of the second chunk's 4 eligible groups the last 2 stay; the first chunk's 2 keep 1
    assert offloaded([chunk, chunk], fraction=0.5, keep_bytes=0, last_stage=False).cpu_bytes == 10 + 15
    assert offloaded([chunk, chunk], fraction=1.0, keep_bytes=12, last_stage=False).cpu_bytes == 15 - 10 - 5 + 30
    assert offloaded([chunk, chunk], fraction=1.0, keep_bytes=0, last_stage=True).cpu_bytes == 15 + 15
    assert offloaded([[("core_attn", 0)]], fraction=1.0, keep_bytes=0, last_stage=False).cpu_bytes == 0


def test_the_size_threshold_keeps_small_tensors() -> None:
    # the projection input has 4096 x 4096 / 2 = 8 Mi elements per rank, q, k, v 12 Mi
    moved, = _stages(offload_modules="core_attn,attn_proj", min_offloaded_tensor_size=10 * 2**20)
    assert moved.cpu_activations_bytes == 31 * QKV


def test_moe_groups_and_the_assumption_line() -> None:
    qwen = load_model("qwen3-30b-a3b")
    flags = {**BASE, "ep": 4}
    plain = estimate(qwen, build_job({**flags, "offload_modules": "core_attn,attn_proj"}))
    experts = estimate(qwen, build_job({**flags, "offload_modules": "core_attn,attn_proj,expert_fc1,moe_act"}))
    assert experts.stages[0].cpu_activations_bytes > plain.stages[0].cpu_activations_bytes
    assert any(line.startswith("fine-grained activation offloading (core_attn, attn_proj, expert_fc1, moe_act)")
               for line in experts.assumptions)


@pytest.mark.parametrize(("flags", "field"), [
    ({"offload_modules": "attn_proj"}, "--offload-modules"),
    ({"offload_modules": "gdp_qkv"}, "--offload-modules"),
    ({"offload_modules": "core_attn,qkv"}, "--offload-modules"),
    ({"offload_modules": "fused_group_mlp,moe_act"}, "--offload-modules"),
    ({"offload_modules": "core_attn", "offload_activations": True}, "--offload-modules"),
    ({"offload_modules": "core_attn", "framework": "hf"}, "--offload-modules"),
    ({"offload_modules": "moe_act", "recompute": "selective", "recompute_modules": "moe"}, "--offload-modules"),
    ({"activation_offload_fraction": 1.5}, "--activation-offload-fraction"),
    ({"min_offloaded_tensor_size": -1}, "--min-offloaded-tensor-size"),
])
def test_bad_settings_name_the_flag(flags: dict, field: str) -> None:
    with pytest.raises(JobConfigError) as err:
        build_job({**BASE, **flags})
    assert field in str(err.value)


LAUNCH = """
python pretrain_gpt.py --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024
  --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 16 --bf16
  --tensor-model-parallel-size 2 --sequence-parallel --vocab-size 32000
"""


def test_megatron_flags_map_to_the_job() -> None:
    _, job = from_megatron_args(LAUNCH + " --fine-grained-activation-offloading --offload-modules core_attn attn_proj"
                                " --min-offloaded-tensor-size 4096 --activation-offload-fraction 0.5"
                                " --delta-offload-bytes-across-pp-ranks 1024", gpus=2)
    off = job.offload
    assert (off.modules, off.min_tensor_numel, off.group_fraction, off.pp_delta_bytes) == (
        "core_attn,attn_proj", 4096, 0.5, 1024)
    _, plain = from_megatron_args(LAUNCH + " --offload-modules core_attn", gpus=2)  # no switch: Megatron ignores it
    assert plain.offload.modules == ""
    with pytest.raises(ConfigError):
        from_megatron_args(LAUNCH + " --fine-grained-activation-offloading", gpus=2)


def test_an_unfused_core_attention_group_holds_what_the_core_saves_inside() -> None:
    """``core_attn``'s group is every tensor saved inside the core's forward: with unfused attention the
    s x s softmax output (32 heads / tp 2 x 4096 x 4096, 16-bit) beside q, k, v."""
    moved, = _stages(attention="eager", offload_modules="core_attn")
    softmax = 16 * 4096 * 4096 * 2
    assert moved.cpu_activations_bytes == 31 * (QKV + softmax)
