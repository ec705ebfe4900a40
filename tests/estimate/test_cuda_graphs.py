"""Megatron CUDA graphs: the private pool, static inputs, and the Megatron flags that set them.

Hand-computed figures follow memplan/estimate/cuda_graphs.py's reading of Megatron-LM
(megatron/core/transformer/cuda_graphs.py, module.py / transformer_layer.py ``get_layer_static_inputs``,
full_cuda_graph.py) and Transformer Engine (pytorch/graph.py ``make_graphed_callables``).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan import estimate, load_model
from memplan.categories import MemoryCategory
from memplan.cli import app
from memplan.errors import ConfigError, JobConfigError
from memplan.estimate.activations import KEPT_BY, divided, layer_terms_by_block
from memplan.estimate.cuda_graphs import captured_terms, graph_count, te_static_input_bytes
from memplan.estimate.context import activation_shape as _activation_shape
from memplan.estimate.engine import layer_activation_costs
from memplan.estimate.precision import resolve_precision
from memplan.frameworks.megatron_args import from_megatron_args
from memplan.profiles.framework import get_profile
from memplan.jobflags import build_job
from memplan.units import MiB

LLAMA = load_model("llama-3.1-8b")
BASE = {"gpus": 8, "tp": 2, "sequence_parallel": True, "seq": 4096}


def _job(**flags):  # type: ignore[no-untyped-def]
    return build_job({**BASE, **flags})


def _stage(job, stage: int = 0):  # type: ignore[no-untyped-def]
    return estimate(LLAMA, job).stages[stage]


def _shape(job):  # type: ignore[no-untyped-def]
    profile = get_profile(job.framework)
    return _activation_shape(LLAMA, job, profile, resolve_precision(job, profile))


def test_te_static_inputs_are_bf16_hidden_states_and_a_boolean_causal_mask() -> None:
    shape = _shape(_job())
    # [s, b, h] / tp under sequence parallelism in bf16: 4096 / 2 * 4096 * 2 = 16 MiB; mask b * s * s bytes: 16 MiB
    assert te_static_input_bytes(shape, cp=1, attention_captured=True) == 32 * MiB
    assert te_static_input_bytes(shape, cp=1, attention_captured=False) == 16 * MiB
    cp2 = _shape(_job(cp=2))  # s/cp = 2048: hidden 2048 / 2 * 4096 * 2 = 8 MiB, mask 2048 * 4096 = 8 MiB
    assert te_static_input_bytes(cp2, cp=2, attention_captured=True) == 16 * MiB


def test_whole_layer_pool_holds_every_layer_and_the_worst_backward() -> None:
    job = _job(cuda_graph_impl="local")
    kept, _, transient = layer_activation_costs(LLAMA, job, 0)
    stage = _stage(job)
    assert stage.cuda_graph_pool_bytes == 32 * kept + transient
    assert stage.cuda_graph_static_bytes == 0
    eager = _stage(_job())
    # the peak stays at the loss, where the pool also holds the backward working set eager memory has not made yet
    assert stage.peak_phase == eager.peak_phase == "loss"
    assert stage.peak_allocated_bytes - eager.peak_allocated_bytes == transient == stage.cuda_graph_extra_bytes


def test_transformer_engine_adds_static_inputs_per_layer_and_microbatch_in_flight() -> None:
    local, te = _stage(_job(cuda_graph_impl="local")), _stage(_job(cuda_graph_impl="transformer_engine"))
    assert te.cuda_graph_static_bytes == 32 * 32 * MiB  # 32 layers x 1 micro-batch x 32 MiB
    assert te.peak_allocated_bytes - local.peak_allocated_bytes == 32 * 32 * MiB
    piped = estimate(LLAMA, _job(cuda_graph_impl="transformer_engine", pp=2, gbs=16)).stages[0]
    assert piped.inflight_microbatches == 2  # 1F1B: pp micro-batches in flight on the first stage
    assert piped.cuda_graph_static_bytes == 16 * 2 * 32 * MiB


def test_local_chunks_fed_by_another_stage_copy_their_input_into_the_pool() -> None:
    est = estimate(LLAMA, _job(cuda_graph_impl="local", pp=2, gbs=16))
    first, last = est.stages
    job = _job(pp=2, gbs=16)
    kept, _, transient = layer_activation_costs(LLAMA, job, 0)
    # the first stage's chunk is fed by the embedding (not kept): no copy
    assert first.cuda_graph_pool_bytes == first.inflight_microbatches * 16 * kept + transient
    # the last stage's graphs copy the received hidden states: [s, b, h] / tp in bf16 = 16 MiB per micro-batch
    assert last.cuda_graph_pool_bytes == last.inflight_microbatches * (16 * kept + 16 * MiB) + transient


def test_attention_scope_captures_the_attention_block_only() -> None:
    job = _job(cuda_graph_impl="local", cuda_graph_modules="attn")
    shape = _shape(job)
    attention, _ = layer_terms_by_block(LLAMA.layers[0], shape)
    kept = sum(divided(t, shape) for t in attention if t.keep in KEPT_BY["none"])
    largest = max(divided(t, shape) for t in attention)
    assert _stage(job).cuda_graph_pool_bytes == 32 * kept + 2 * largest
    assert captured_terms(LLAMA.layers[0], shape, ("mlp",)) != []
    assert captured_terms(LLAMA.layers[0], shape, ("moe_router",)) == []  # a dense layer has no router


def test_full_iteration_pool_is_the_step_beside_the_optimizer_and_every_batch_is_static() -> None:
    eager = _stage(_job(gbs=8))
    graph = _stage(_job(gbs=8, cuda_graph_impl="full_iteration"))
    states = eager.parameters_bytes + eager.gradients_bytes + eager.optimizer_bytes + eager.workspace_bytes
    assert eager.peak_phase == "loss"
    assert graph.cuda_graph_pool_bytes == eager.peak_allocated_bytes - states - eager.input_bytes
    # 2 micro-batches per step per DP rank (gbs 8 / dp 4): both batches stay in static buffers
    assert graph.cuda_graph_static_bytes == 2 * eager.input_bytes // eager.inflight_microbatches
    assert graph.peak_allocated_bytes >= eager.peak_allocated_bytes
    assert graph.cuda_graphs == 1


def test_categories_add_up_and_graphs_are_counted() -> None:
    stage = _stage(_job(cuda_graph_impl="transformer_engine"))
    cats = stage.by_category()
    assert sum(cats.values()) == stage.peak_allocated_bytes
    assert cats[MemoryCategory.BUFFER] == stage.cuda_graph_extra_bytes > 0
    assert stage.peak_allocated_bytes == (stage.parameters_bytes + stage.gradients_bytes + stage.optimizer_bytes
                                          + stage.activations_bytes + stage.logits_bytes + stage.other_bytes
                                          - stage.gradients_absent_at_peak_bytes)
    assert stage.cuda_graphs == graph_count("transformer_engine", 32, pp=1, num_microbatches=1) == 64
    assert graph_count("local", 16, pp=2, num_microbatches=8) == 256  # one pair per layer and micro-batch
    assert _stage(_job()).cuda_graphs == 0


def test_no_graphs_changes_nothing() -> None:
    assert estimate(LLAMA, _job()).to_dict()["stages"] == estimate(LLAMA, _job(cuda_graph_impl="none")).to_dict()["stages"]


@pytest.mark.parametrize(("flags", "field"), [
    ({"cuda_graph_impl": "local", "framework": "torchtitan"}, "--cuda-graph-impl"),
    ({"cuda_graph_impl": "full_iteration", "cuda_graph_modules": "attn"}, "--cuda-graph-modules"),
    ({"cuda_graph_impl": "local", "cuda_graph_modules": "moe_preprocess"}, "--cuda-graph-modules"),
    ({"cuda_graph_impl": "local", "cuda_graph_modules": "mamba"}, "--cuda-graph-modules"),
    ({"cuda_graph_impl": "local", "cuda_graph_modules": "attn,ffn"}, "--cuda-graph-modules"),
    ({"cuda_graph_impl": "local", "offload_activations": True}, "--cuda-graph-impl"),
    ({"cuda_graph_impl": "graphs"}, "--cuda-graph-impl"),
])
def test_bad_settings_name_the_flag(flags: dict, field: str) -> None:
    with pytest.raises(JobConfigError) as err:
        build_job({**BASE, **flags})
    assert field in str(err.value)


def test_moe_scopes_need_moe_layers() -> None:
    with pytest.raises(JobConfigError, match="--cuda-graph-modules"):
        estimate(LLAMA, _job(cuda_graph_impl="local", cuda_graph_modules="moe_router"))


LAUNCH = """
python pretrain_gpt.py --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024
  --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 16 --bf16
  --tensor-model-parallel-size 2 --sequence-parallel --vocab-size 32000
"""


@pytest.mark.parametrize(("extra", "impl", "modules"), [
    ("--cuda-graph-impl transformer_engine", "transformer_engine", ""),
    ("--cuda-graph-impl local --cuda-graph-modules attn mlp", "local", "attn,mlp"),
    ("--enable-cuda-graph", "local", ""),
    ("--external-cuda-graph --cuda-graph-scope attn", "transformer_engine", "attn"),
    ("--cuda-graph-impl local --cuda-graph-scope full_iteration", "full_iteration", ""),
    ("--cuda-graph-impl local --cuda-graph-scope full", "local", ""),
    ("--cuda-graph-impl local --cuda-graph-modules attn full_iteration_inference", "local", "attn"),
    ("--cuda-graph-impl none --cuda-graph-modules attn", "none", ""),
    ("", "none", ""),
])
def test_megatron_flags_map_to_the_job(extra: str, impl: str, modules: str) -> None:
    _, job = from_megatron_args(LAUNCH + " " + extra, gpus=2)
    assert (job.cuda_graphs.impl, job.cuda_graphs.modules) == (impl, modules)


@pytest.mark.parametrize("extra", [
    "--cuda-graph-impl graphs",
    "--enable-cuda-graph --cuda-graph-impl local",
    "--enable-cuda-graph --external-cuda-graph",
    "--cuda-graph-impl local --cuda-graph-scope attn --cuda-graph-modules mlp",
])
def test_megatron_refusals_are_errors(extra: str) -> None:
    with pytest.raises(ConfigError):
        from_megatron_args(LAUNCH + " " + extra, gpus=2)


def test_estimate_json_carries_the_pool_and_the_assumption() -> None:
    result = CliRunner().invoke(app, ["estimate", "llama-3.1-8b", "--gpus", "8", "--tp", "2",
                                      "--sequence-parallel", "--cuda-graph-impl", "transformer_engine", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    stage = data["stages"][0]
    assert stage["cuda_graph_static_bytes"] == 32 * 32 * MiB
    assert stage["cuda_graph_pool_bytes"] > 0 and stage["cuda_graphs"] == 64
    assert stage["by_category"]["buffer"] == stage["cuda_graph_extra_bytes"]
    assert data["job"]["cuda_graphs"] == {"impl": "transformer_engine", "modules": ""}
    assert any(line.startswith("CUDA graphs (transformer_engine; whole decoder layers)") for line in data["assumptions"])
