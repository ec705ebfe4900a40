"""Where ``--dropout`` keeps masks: the hidden-state dropout sites of the model code that runs
(:attr:`memplan.model.spec.ModelSpec.hidden_dropout`, Megatron's own layers: every site), and what eager
attention's dropout keeps beside the softmax (its output replaces the cast to the compute dtype). The trace
cells of tests/trace/test_dropout_trace.py measure both."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memplan import estimate, load_model
from memplan.estimate.activations import ActivationShape, layer_terms
from memplan.jobflags import build_job
from memplan.model.hf import model_from_hf_config

_DENSE = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 2048}


@pytest.mark.parametrize("config, sites", [
    ({"model_type": "gpt2", "n_embd": 256, "n_head": 8, "n_layer": 2, "vocab_size": 2048}, "embedding-and-residual"),
    ({**_DENSE, "model_type": "gpt_neox", "num_key_value_heads": 8}, "embedding-and-residual"),
    ({**_DENSE, "model_type": "phi3", "num_key_value_heads": 8}, "residual"),  # resid_pdrop; embd_pdrop unread
    ({**_DENSE, "model_type": "llama"}, "none"),
    ({**_DENSE, "model_type": "qwen3"}, "none"),
    ({**_DENSE, "model_type": "gemma2"}, "none"),
    ({**_DENSE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, "none"),
])
def test_hidden_dropout_sites_are_the_family_code(config: dict[str, object], sites: str) -> None:
    assert model_from_hf_config(config, name="toy").hidden_dropout == sites


def _dropout_bytes(name: str, framework: str) -> int:
    """Forward activations added by --dropout 0.1 under flash attention (the hidden-state masks only)."""
    model = load_model(name)
    stages = [estimate(model, build_job({"framework": framework, "seq": 512, "attention": "flash", "dropout": p}))
              .stages[0] for p in (0.0, 0.1)]
    return stages[1].forward_activations_bytes - stages[0].forward_activations_bytes


@pytest.mark.parametrize("framework", ["hf", "deepspeed", "torchtitan"])
def test_llama_family_code_keeps_no_hidden_dropout_mask(framework: str) -> None:
    assert _dropout_bytes("llama-3.1-8b", framework) == 0
    assert _dropout_bytes("mixtral-8x7b", framework) == 0
    gpt2 = load_model("gpt2")  # the embedding's mask and two per layer, 1 byte per hidden element
    assert _dropout_bytes("gpt2", framework) == (1 + 2 * gpt2.num_layers) * 512 * gpt2.hidden_size


def test_megatron_builds_every_site_whatever_the_family() -> None:
    llama = load_model("llama-3.1-8b")
    assert _dropout_bytes("llama-3.1-8b", "megatron") == (1 + 2 * llama.num_layers) * 512 * llama.hidden_size


def _core_names(act_bytes: int, kernels: str) -> set[str]:
    layer = load_model("llama-3.2-1b").layers[0]
    shape = ActivationShape(seq=64, kv_seq=64, micro_batch=1, hidden=2048, tp=1, sequence_parallel=False,
                            act_bytes=act_bytes, residual_bytes=act_bytes, attention="eager", dropout=True,
                            kernels=kernels, hidden_dropout_sites="none")
    with_dropout = {t.name for t in layer_terms(layer, shape)}
    return with_dropout - {t.name for t in layer_terms(layer, replace(shape, dropout=False))}


def test_eager_dropout_output_replaces_the_cast_and_is_extra_without_one() -> None:
    assert _core_names(2, "eager") == {"attention dropout mask"}  # the PV matmul keeps it instead of the cast
    assert _core_names(4, "eager") == {"attention dropout mask", "attention dropout output"}  # fp32: no cast
    # Megatron's fused softmax writes the compute dtype, which its backward keeps: the dropout output is extra
    assert _core_names(2, "fused") == {"attention dropout mask", "attention dropout output"}


def test_gpt2_eager_softmax_is_fp32_under_autocast_only() -> None:
    """GPT-2's ``eager_attention_forward`` calls ``softmax(attn_weights)`` (no ``dtype=torch.float32``): in
    pure 16-bit the softmax output is 16-bit and the PV matmul reads it uncast; autocast's fp32 list makes it fp32."""
    gpt2 = load_model("gpt2")
    assert gpt2.layers[0].attention.softmax_in_scores_dtype
    assert not load_model("llama-3.2-1b").layers[0].attention.softmax_in_scores_dtype
    shape = ActivationShape(seq=64, kv_seq=64, micro_batch=1, hidden=gpt2.hidden_size, tp=1, sequence_parallel=False,
                            act_bytes=2, residual_bytes=2, attention="eager", dropout=False, kernels="eager",
                            norm="layernorm", rope=False)
    scores = gpt2.layers[0].attention.num_heads * 64 * 64

    def core(s: ActivationShape) -> dict[str, int]:
        return {t.name: t.bytes for t in layer_terms(gpt2.layers[0], s) if t.keep == "core"}

    assert core(shape) == {"softmax output": 2 * scores}
    assert set(core(replace(shape, autocast_ops=True))) == {"softmax output (fp32)",
                                                           "softmax output cast to the compute dtype (PV matmul input)"}
