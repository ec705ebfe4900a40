"""``--compile``: the tracer runs inductor's partitioned graphs per decoder layer, the estimator prices their
saved set per family (memplan.estimate.compiled); small configs of each family the rules cover.

Tolerances: model states equal, activations within 5% (the issue's target for compiled layers), and each
layer's saved bytes as the partitioner chose them equal to the rule's terms.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_agreement_grid import _COMMON  # tests/trace is on sys.path: the agreement grid's small configs
from test_agreement_grid import CONFIGS as GRID_CONFIGS

from memplan.errors import ConfigError
from memplan.estimate.compiled import compiled_blocks
from memplan.estimate.context import run_context
from memplan.jobflags import build_job
from memplan.model import load_model
from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from memplan.trace.runners.compiled_loss import LOSS_PATH

TOLERANCE = 0.05
EXACT = ("parameter", "gradient", "optimizer_state")

#: DeepSeek-V2's layers (MLA, a dense first layer, then MoE with two shared experts); the latents' widths
#: (64, 112, 80 with the RoPE part) share no factor with the cells' 88 tokens.
DEEPSEEK = {"model_type": "deepseek_v2", "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 2048,
            "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
            "v_head_dim": 32, "n_shared_experts": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
            "norm_topk_prob": False, "tie_word_embeddings": False}

#: The agreement grid's small configs, and the families it has no toy of.
CONFIGS: dict[str, dict[str, object]] = {
    **GRID_CONFIGS,
    "qwen3": {**GRID_CONFIGS["qwen2"], "model_type": "qwen3", "head_dim": 32},
    "deepseek_v2": DEEPSEEK,
    "deepseek_v2_qlora": {**DEEPSEEK, "q_lora_rank": 112},
    # the dropout keys spelled out, as in GPT-2's config.json: the trace sets them to --dropout (transformers'
    # default for a missing key is 0.1)
    "gpt2": {"model_type": "gpt2", "n_embd": 256, "n_head": 8, "n_layer": 2, "vocab_size": 2048, "n_positions": 1024,
             "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0},
}

#: (config, seq, precision, attention): one cell per family and attention kind the rules cover.
#: Sequences of 80 and 160 share no factor with the toys' widths, so a saved value's token dimension is
#: told apart from a weight's (:func:`_per_token`); gemma2's 160 exceeds its 128-token sliding window.
CELLS = (
    ("llama", 80, "bf16-mixed", "sdpa"),
    ("llama", 80, "bf16", "eager"),
    ("qwen2", 80, "bf16-mixed", "sdpa"),
    ("qwen3", 80, "bf16", "sdpa"),
    ("phi3", 80, "fp32", "eager"),  # micro-batch 2: the PV matmul copies v, the fused output is not held
    ("phi3", 80, "bf16-mixed", "eager"),
    ("gemma2", 160, "bf16-mixed", "eager"),
    ("gemma3_text", 160, "bf16-mixed", "eager"),  # Gemma's fp32 norm on the per-head q/k norms
    ("qwen3_moe", 80, "bf16-mixed", "sdpa"),
    ("gpt2", 80, "bf16-mixed", "sdpa"),
    ("gpt2", 80, "fp32", "sdpa"),
    ("deepseek_v2", 88, "bf16-mixed", "sdpa"),
    ("deepseek_v2", 88, "bf16", "sdpa"),
    ("deepseek_v2_qlora", 88, "bf16-mixed", "sdpa"),
)


def _written(path: Path, config: dict[str, object]) -> str:
    path.write_text(json.dumps(config), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def config_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = Path(tmp_path_factory.mktemp("compiled"))
    return {name: _written(folder / f"{name}.json", {**(_COMMON if name != "gpt2" else {}), **config})
            for name, config in CONFIGS.items()}


@pytest.mark.parametrize("name, seq, precision, attention", CELLS)
def test_compiled_estimate_agrees_with_the_partitioner(config_paths: dict[str, str], name: str, seq: int,
                                                       precision: str, attention: str) -> None:
    _agrees(config_paths[name], seq, precision, attention)


def test_gpt2_with_dropout_keeps_the_residual_masks(config_paths: dict[str, str]) -> None:
    """--dropout 0.1: the two residual dropout masks are saved (1 byte per element; the attention's dropout runs
    in the kernel from a seed); at 0 they are not (the cells above)."""
    _agrees(config_paths["gpt2"], 80, "bf16-mixed", "sdpa", dropout=0.1)


def test_llama_with_hidden_dropout_only_runs_no_dropout(config_paths: dict[str, str]) -> None:
    """--dropout 0.1 --attention-dropout 0 on a Llama-style model: transformers' Llama code has no embedding or
    residual dropout, so no dropout runs and the compiled rule prices the layer (it fell back to the eager terms
    with three masks the trace does not keep)."""
    _agrees(config_paths["llama"], 80, "bf16-mixed", "sdpa", dropout=0.1, attention_dropout=0.0)


#: (config, micro-batch, precision, attention, held): whether Phi-3's saved v is a view of the fused q/k/v
#: projection's output, keeping it whole (memplan.estimate.compiled._saved_v_holds_fused_qkv).
FUSED_QKV_CELLS = (
    ("phi3", 2, "fp32", "eager", False),  # the PV matmul cannot fold batch and heads of the slice: it copies v
    ("phi3", 1, "fp32", "eager", True),  # it can at micro-batch 1 (phi-3-mini's grid cell)
    ("phi3", 1, "bf16-mixed", "eager", True),  # autocast: the projection's output is 16-bit already
    ("phi3_one_head", 2, "fp32", "eager", True),  # and with one head
    ("phi3_gqa", 1, "fp32", "eager", False),  # repeat_kv copies v first
    ("phi3", 2, "bf16-mixed", "sdpa", True),  # the kernel saves v as given
    ("phi3_gqa", 2, "fp32", "sdpa", True),
)


@pytest.mark.parametrize("name, mbs, precision, attention, held", FUSED_QKV_CELLS)
def test_phi3_fused_projection_is_held_where_the_saved_v_is_its_view(
        config_paths: dict[str, str], name: str, mbs: int, precision: str, attention: str, held: bool) -> None:
    """The saved v's view of the fused output is not in the partitioner's list by its storage, so the layer-by-
    layer check above cannot see it: the activations are held to 0.1% here (the term is 2-10% of them)."""
    spec = load_model(config_paths[name])
    job = build_job({"framework": "hf", "seq": 80, "mbs": mbs, "precision": precision, "attention": attention,
                     "compile": True})
    attention_terms, _ = compiled_blocks(spec.layers[0], run_context(spec, job, 0.1).shape)
    assert any("fused q/k/v" in t.name for t in attention_terms) is held
    _agrees(config_paths[name], 80, precision, attention, mbs=mbs, tolerance=0.001)


def _agrees(model: str, seq: int, precision: str, attention: str, mbs: int = 2, tolerance: float = TOLERANCE,
            **flags: object) -> None:
    result = trace(model, seq=seq, mbs=mbs, precision=precision, attention=attention, recompute="none",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, compile=True, **flags)
    assert result.to_dict()["compiled_layers"], "the partitioner's saved sets are reported"
    rows = {r.category: r for r in compare_with_estimate(model, result.options, result.summary).rows}
    for category in EXACT:
        assert rows[category].estimated_bytes == rows[category].traced_bytes, category
    row = rows["activation"]
    assert abs(row.relative or 0.0) <= tolerance, (row.traced_bytes, row.estimated_bytes)
    # each layer: what the partitioner saved beyond the layer's inputs is what the rule prices beyond its input
    spec = load_model(model)
    run = run_context(spec, result.options.job, 0.1)
    priced = []
    for layer in spec.layers:
        attention_terms, rest = compiled_blocks(layer, run.shape)
        # (a view the partitioner saves is counted by its own size there, by the storage it holds here)
        priced.append(sum(t.bytes for t in attention_terms + rest if t.keep != "input" and "(a view)" not in t.name))
    computed = [sum(t["bytes"] for t in saved if not t["graph_input"] and _per_token(t, seq))
                for path, saved in result.compiled_layers.items() if path != LOSS_PATH]
    assert computed == priced


def _per_token(tensor: dict[str, object], seq: int) -> bool:
    """A saved value that grows with the tokens (not a weight's 16-bit copy, a view of an expert weight or MLA's
    complex RoPE table's conjugate, a view of the layer's input); the efficient kernel's log-sum-exp has the
    sequence padded to a multiple of 32."""
    shape = tensor["shape"]
    assert isinstance(shape, list)
    return str(tensor["dtype"]).startswith("complex") is False and any((dim % seq == 0 and dim >= seq) or dim == -(-seq // 32) * 32 for dim in shape)


@pytest.mark.parametrize("flags, field", [
    ({"recompute": "full"}, "--recompute"),
    ({"fsdp": 2}, "--gpus"),
    ({"peft": "lora"}, "--peft"),
])
def test_trace_compile_refuses_what_it_does_not_run(config_paths: dict[str, str], flags: dict[str, object],
                                                    field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        trace(config_paths["llama"], seq=64, mbs=1, device="cuda", iterations=1, compile=True, **flags)
    assert caught.value.field == field and "--compile" in str(caught.value)


def test_eager_estimate_is_unchanged_without_compile(config_paths: dict[str, str]) -> None:
    spec = load_model(config_paths["llama"])
    job = build_job({"framework": "hf", "seq": 256})
    assert job.compile is False
    run = run_context(spec, job, 0.1)
    from memplan.estimate.compiled import compiled_layer

    assert not compiled_layer(run, spec.layers[0])


def test_a_compiled_cross_entropy_keeps_the_16_bit_logits_and_two_fp32_values_per_row() -> None:
    """The compiled loss (torchtune's chunked loss, torchtitan's ``"loss"`` component, the Trainer's whole model)
    keeps its 16-bit input and the fp32 max and log-sum-exp per row, where eager cross-entropy on upcast logits
    keeps an fp32 log-softmax (memplan prices the loss as eager and lists it in unmodelled_settings)."""
    import torch
    import torch.nn.functional as F

    from memplan.trace.runners.partitioner import partitioned_saved_set

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, reduction="sum")

    rows, vocab = 96, 1000
    saved = partitioned_saved_set(loss, torch.zeros(rows, vocab, dtype=torch.bfloat16, requires_grad=True),
                                  torch.zeros(rows, dtype=torch.long))
    computed = [t for t in saved if not t.graph_input]
    assert {(t.shape, t.dtype) for t in computed} == {((rows, 1), "float32")} and len(computed) == 2
    assert {(t.shape, t.dtype) for t in saved if t.graph_input} == {((rows, vocab), "bfloat16"), ((rows,), "int64")}


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_the_compiled_loss_keeps_the_logits_and_two_fp32_values_per_token(config_paths: dict[str, str],
                                                                           precision: str) -> None:
    """The Hugging Face loss compiled with the model (--compile-loss auto): the trace runs it as its partitioned
    graphs, whose saved set is the logits, the padded labels and an fp32 maximum and log of the sum per token;
    the estimate's saved logits agree (the padded labels aside). The loss's transients are not compared: the
    trace runs the graphs operator by operator, inductor fuses them (memplan.estimate.compiled_loss)."""
    model, seq, mbs = config_paths["llama"], 96, 2
    result = trace(model, seq=seq, mbs=mbs, precision=precision, attention="sdpa", recompute="none",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, compile=True)
    saved = result.compiled_layers[LOSS_PATH]
    logits_dtype = "float32" if precision == "fp32" else "bfloat16"
    assert [(t["shape"], t["dtype"]) for t in saved if t["graph_input"]] == [([mbs, seq, 2048], logits_dtype)]
    stats = [t for t in saved if not t["graph_input"] and t["shape"] == [mbs * seq, 1]]
    assert [t["dtype"] for t in stats] == ["float32", "float32"]
    row = {r.category: r for r in compare_with_estimate(model, result.options, result.summary).rows}["logits"]
    assert abs(row.relative or 0.0) <= 0.005, (row.traced_bytes, row.estimated_bytes)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_the_compiled_chunked_loss_keeps_each_chunks_logits_and_two_fp32_values_per_token(
        config_paths: dict[str, str], precision: str) -> None:
    """torchtune's chunked loss compiled as torchtune compiles it (``compute_cross_entropy`` alone, per chunk): the
    partitioner saves each chunk's logits in the compute dtype and an fp32 maximum and log of the sum per token, no
    fp32 log-softmax; the estimate's saved logits are that set over every chunk (labels aside), priced in
    memplan.estimate.compiled_loss. (The trace's logits row also holds what the head makes when it runs in the
    loss, autocast's copies of its weight and input, which the estimate counts as activations.)"""
    from memplan.trace.standins.chunked_loss import CHUNKS

    model, seq, mbs = config_paths["llama"], 96, 2
    result = trace(model, seq=seq, mbs=mbs, precision=precision, attention="sdpa", recompute="none",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, compile=True,
                   loss="chunked")
    saved = result.compiled_layers[LOSS_PATH]
    rows = mbs * seq // CHUNKS
    logits_dtype = "float32" if precision == "fp32" else "bfloat16"
    assert [(t["shape"], t["dtype"]) for t in saved if t["graph_input"] and t["dtype"] != "int64"] == \
        [([rows, 2048], logits_dtype)]
    assert sorted((t["shape"], t["dtype"]) for t in saved if not t["graph_input"]) == [([rows, 1], "float32")] * 2
    row = {r.category: r for r in compare_with_estimate(model, result.options, result.summary).rows}["logits"]
    assert row.estimated_bytes == CHUNKS * sum(t["bytes"] for t in saved if t["dtype"] != "int64")


@pytest.mark.parametrize("name, precision, attention", [("llama_heavy", "bf16", "sdpa"),
                                                         ("llama_heavy", "bf16-mixed", "sdpa"),
                                                         ("gemma2_heavy", "bf16-mixed", "eager")])
def test_the_compiled_chunked_loss_peak_agrees_where_the_heads_backward_sets_it(
        config_paths: dict[str, str], name: str, precision: str, attention: str) -> None:
    """A trained (tied) head under the compiled chunked loss: the peak is the head's per-chunk backward, where the
    chunks' weight gradients are summed out of place beside the chunks' logits gradients not yet used (and Gemma 2's
    saved tanh outputs of those chunks): memplan.estimate.chunked_head_backward (benchmarks/compiled_chunked_loss.py's
    K4, K1, K5)."""
    model = config_paths[name]
    result = trace(model, seq=512, mbs=2, precision=precision, attention=attention, recompute="none",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, compile=True,
                   loss="chunked")
    assert result.summary.peak_phase == "backward"
    row = {r.category: r for r in compare_with_estimate(model, result.options, result.summary).rows}["peak allocated"]
    assert abs(row.relative or 0.0) <= 0.01, (row.traced_bytes, row.estimated_bytes)
