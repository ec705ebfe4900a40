"""``--compile`` in the estimator (memplan.estimate.compiled): which layers the partitioner's rules price, what
is listed as not modelled, and the refusal. The rules themselves are held against the partitioner's saved
sets in tests/trace/test_compiled_trace.py and the agreement grid's ``--compile`` cells."""

from __future__ import annotations

import pytest

from memplan.errors import JobConfigError
from memplan.estimate import estimate
from memplan.estimate.compiled import compiled_blocks
from memplan.estimate.context import run_context
from memplan.jobflags import build_job
from memplan.model import load_model


def _activations(model: str, **flags: object) -> int:
    est = estimate(load_model(model), build_job({"framework": "hf", "seq": 2048, **flags}))
    from memplan.categories import MemoryCategory

    return est.stages[0].highest_by_category()[MemoryCategory.ACTIVATION]


def test_compiled_layers_keep_less_than_eager_and_what_the_rule_says() -> None:
    spec = load_model("llama-3.2-1b")
    eager, compiled = _activations("llama-3.2-1b"), _activations("llama-3.2-1b", compile=True)
    job = build_job({"framework": "hf", "seq": 2048, "compile": True})
    attention, rest = compiled_blocks(spec.layers[0], run_context(spec, job, 0.1).shape)
    eager_job = build_job({"framework": "hf", "seq": 2048})
    from memplan.estimate.activations import KEPT_BY, layer_terms

    eager_layer = sum(t.bytes for t in layer_terms(spec.layers[0], run_context(spec, eager_job, 0.1).shape)
                      if t.keep in KEPT_BY["none"])
    per_layer = sum(t.bytes for t in attention + rest)
    assert per_layer < eager_layer
    assert eager - compiled == spec.num_layers * (eager_layer - per_layer)


def test_an_uncovered_family_is_listed_and_priced_as_eager() -> None:
    flags = {"framework": "hf", "seq": 1024, "compile": True, "attention": "eager"}
    est = estimate(load_model("deepseek-v2-lite"), build_job(flags))
    notes = est.unmodelled_settings
    assert any("multi-head latent attention (MLA) with unfused attention" in n for n in notes)
    assert any(n.startswith("--compile compiled model") for n in notes)  # the Trainer compiles the whole model
    assert (_activations("deepseek-v2-lite", compile=True, seq=1024, attention="eager")
            == _activations("deepseek-v2-lite", seq=1024, attention="eager"))


def test_mla_and_shared_experts_are_priced_and_a_router_bias_is_listed() -> None:
    est = estimate(load_model("deepseek-v2-lite"), build_job({"framework": "hf", "seq": 1024, "compile": True}))
    assert not any(n.startswith("--compile compiled layers") for n in est.unmodelled_settings)
    assert any(a.startswith("torch.compile: 27 of 27 decoder layers") for a in est.assumptions)
    assert _activations("deepseek-v2-lite", compile=True, seq=1024) < _activations("deepseek-v2-lite", seq=1024)
    v3 = estimate(load_model("deepseek-v3"), build_job({"framework": "hf", "seq": 1024, "compile": True}))
    assert any("MoE with a gated shared expert or a router bias" in n for n in v3.unmodelled_settings)
    assert any(a.startswith("torch.compile: 3 of 61 decoder layers") for a in v3.assumptions)  # the dense ones


@pytest.mark.parametrize("flags, reason", [
    ({"recompute": "full"}, "activation policy 'full'"),
    ({"peft": "lora"}, "fine-tuning"),
    ({"gpus": 2, "tp": 2}, "tensor / sequence parallelism"),
])
def test_a_setting_without_a_rule_is_listed(flags: dict[str, object], reason: str) -> None:
    est = estimate(load_model("llama-3.2-1b"), build_job({"framework": "hf", "seq": 1024, "compile": True, **flags}))
    assert any(reason in n for n in est.unmodelled_settings), est.unmodelled_settings


def test_torchtitan_compiles_blocks_only() -> None:
    est = estimate(load_model("llama-3.1-8b"), build_job({"framework": "torchtitan", "seq": 1024, "compile": True}))
    assert est.unmodelled_settings == ()
    assert any(a.startswith("torch.compile: 32 of 32 decoder layers") for a in est.assumptions)


def test_megatron_has_no_compile() -> None:
    with pytest.raises(JobConfigError) as caught:
        build_job({"framework": "megatron", "compile": True})
    assert caught.value.field == "--compile"


def _loss(model: str, **flags: object) -> tuple[int, int, tuple[str, ...]]:
    est = estimate(load_model(model), build_job({"framework": "hf", "seq": 2048, **flags}))
    stage = est.stages[0]
    return stage.loss_logits_bytes, stage.saved_logits_bytes, est.unmodelled_settings


def test_a_compiled_loss_keeps_the_16_bit_logits_and_two_fp32_values_per_token() -> None:
    tokens, vocab = 2048, load_model("llama-3.2-1b").vocab_size
    for framework in ("hf", "torchtitan"):  # both compile the loss with the model by default
        at_loss, saved, notes = _loss("llama-3.2-1b", compile=True, framework=framework)
        assert saved == 2 * tokens * vocab + 8 * tokens and at_loss == saved + 2 * tokens * vocab
        assert not any("loss are priced as eager" in n for n in notes)
    eager = _loss("llama-3.2-1b")
    assert _loss("llama-3.2-1b", compile=True, compile_loss="off")[:2] == eager[:2]
    assert eager[1] == 4 * tokens * vocab  # the eager loss's fp32 log-softmax


def test_a_compiled_loss_without_a_rule_is_listed_and_soft_capping_is_priced() -> None:
    notes = _loss("llama-3.2-1b", compile=True, gpus=2, tp=2)[2]
    assert any(n.startswith("--compile compiled loss = true: a loss over TP-sharded logits") for n in notes), notes
    tokens, vocab = 2048, load_model("gemma-2-9b").vocab_size
    at_loss, saved, _ = _loss("gemma-2-9b", compile=True)  # the tanh output of the soft-capping besides
    assert saved == 2 * 2 * tokens * vocab + 8 * tokens and at_loss == saved + 2 * tokens * vocab


def test_compile_loss_needs_compile() -> None:
    with pytest.raises(JobConfigError) as caught:
        build_job({"framework": "hf", "compile_loss": "on"})
    assert caught.value.field == "--compile-loss"


def test_a_compiled_chunked_loss_keeps_each_chunks_16_bit_logits_and_one_chunks_gradient() -> None:
    """torchtune compiles its chunked loss's per-chunk compute_cross_entropy: every chunk's 16-bit logits and two fp32
    values per token are saved (no fp32 log-softmax), one chunk's gradient beside them at the loss; listed no more."""
    tokens, vocab = 2048, load_model("llama-3.2-1b").vocab_size
    at_loss, saved, notes = _loss("llama-3.2-1b", compile=True, loss="chunked")
    assert saved == 2 * tokens * vocab + 8 * tokens and at_loss == saved + 2 * tokens * vocab // 8
    assert not any("compiled loss" in n for n in notes), notes
    eager = _loss("llama-3.2-1b", loss="chunked")
    assert eager[1] == 4 * tokens * vocab  # the eager chunks' fp32 log-softmax
    assert _loss("llama-3.2-1b", compile=True, loss="chunked", compile_loss="off")[:2] == eager[:2]
    tokens, vocab = 2048, load_model("gemma-2-9b").vocab_size
    at_loss, saved, _ = _loss("gemma-2-9b", compile=True, loss="chunked")  # the soft-capping's tanh output besides
    assert saved == 2 * 2 * tokens * vocab + 8 * tokens and at_loss == saved + 2 * tokens * vocab // 8


def test_the_fused_linear_loss_compiled_is_still_listed() -> None:
    notes = _loss("llama-3.2-1b", compile=True, loss="fused-linear")[2]
    assert any(n.startswith("--compile compiled loss = true: the 'fused-linear' loss") for n in notes), notes


def test_a_trained_head_under_the_chunked_loss_has_its_per_chunk_backward() -> None:
    """Full training with the chunked loss: the head's per-chunk backward (three weight-sized gradients beside the
    chunks' logits gradients not yet used) is a moment of its own, said; a frozen head (LoRA) makes no weight
    gradient there."""
    model = load_model("llama-3.2-1b")
    full = estimate(model, build_job({"framework": "hf", "seq": 2048, "compile": True, "loss": "chunked"}))
    assert any("chunked loss with a trained head" in a for a in full.assumptions)
    assert full.stages[0].peak_phase == "backward"
    lora = estimate(model, build_job({"framework": "hf", "seq": 2048, "compile": True, "loss": "chunked",
                                      "peft": "lora"}))
    assert not any("chunked loss with a trained head" in a for a in lora.assumptions)
