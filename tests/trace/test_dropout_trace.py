"""``--dropout`` and ``--attention-dropout`` reach every dropout of the traced model, the config class's defaults
included, and the estimate prices what the trace keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate

#: GPT-2 without its ``*_pdrop`` keys: transformers' class defaults are 0.1, which the trace kept whatever
#: --dropout said (the estimate at --dropout 0 was 6.5% under the trace's activations on the eager cell).
GPT2 = {"model_type": "gpt2", "n_embd": 256, "n_head": 8, "n_layer": 2, "vocab_size": 2048, "n_positions": 1024}
#: A Llama-style toy (GQA): its transformers code has attention dropout only, no embedding or residual dropout.
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 2048, "tie_word_embeddings": False,
         "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6}
#: Phi-3: residual dropout after attention and MLP (resid_pdrop), none on the embeddings (no module reads embd_pdrop).
PHI3 = {"model_type": "phi3", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
        "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 2048, "tie_word_embeddings": False,
        "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
#: GPT-NeoX (parallel residual, partial rotary): attention and MLP read the same layer input.
NEOX = {"model_type": "gpt_neox", "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8,
        "num_hidden_layers": 2, "vocab_size": 2048, "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "rotary_pct": 0.25, "use_parallel_residual": True, "bos_token_id": 0, "eos_token_id": 0}
CONFIGS = {"gpt2": GPT2, "llama": LLAMA, "phi3": PHI3, "neox": NEOX}


def _error(path: Path, attention: str, precision: str = "bf16-mixed", category: str = "activation",
           recompute: str = "none", **flags: object) -> float:
    result = trace(str(path), seq=256, mbs=2, precision=precision, attention=attention, recompute=recompute,
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, **flags)
    rows = {row.category: row for row in compare_with_estimate(str(path), result.options, result.summary).rows}
    return rows[category].relative or 0.0


def _activation_error(path: Path, attention: str, precision: str = "bf16-mixed", **flags: object) -> float:
    return _error(path, attention, precision, **flags)


@pytest.mark.parametrize("attention, flags", [
    ("eager", {}),
    ("eager", {"dropout": 0.1, "attention_dropout": 0.0}),
    ("sdpa", {"dropout": 0.1}),
    ("sdpa", {"dropout": 0.0, "attention_dropout": 0.1}),
])
def test_gpt2_dropouts_follow_the_job(tmp_path: Path, attention: str, flags: dict[str, float]) -> None:
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(GPT2))
    assert abs(_activation_error(path, attention, **flags)) <= 0.005


#: (model, attention, precision, flags): the estimate before this cell's mechanism was fixed, against the trace's
#: activations. Llama-style layers have no residual or embedding dropout (the three masks were priced anyway:
#: llama sdpa +3.3%, fp32 eager +1.5 to +2.0%); eager attention's dropout output replaces the softmax's cast to
#: the compute dtype as the PV matmul's saved input (llama eager bf16-mixed +11.9 to +13.7%, bf16 +17.1%, GPT-2
#: +9.9%); in fp32 no cast runs and the dropout output is a tensor more (kept exact). Phi-3: residual masks, no
#: embedding mask (+12.5%).
DROPOUT_CELLS = [
    ("llama", "eager", "bf16-mixed", {"dropout": 0.1}),
    ("llama", "eager", "bf16-mixed", {"dropout": 0.1, "attention_dropout": 0.0}),
    ("llama", "eager", "bf16-mixed", {"dropout": 0.0, "attention_dropout": 0.1}),
    ("llama", "sdpa", "bf16-mixed", {"dropout": 0.1}),
    ("llama", "eager", "bf16", {"dropout": 0.1}),
    ("llama", "eager", "fp32", {"dropout": 0.1}),
    ("llama", "eager", "fp32", {"dropout": 0.1, "attention_dropout": 0.0}),
    ("llama", "eager", "fp32", {"dropout": 0.0, "attention_dropout": 0.1}),
    ("llama", "sdpa", "fp32", {"dropout": 0.1}),
    ("gpt2", "eager", "bf16-mixed", {"dropout": 0.1}),
    ("gpt2", "eager", "bf16-mixed", {"dropout": 0.0, "attention_dropout": 0.1}),
    ("phi3", "eager", "bf16-mixed", {"dropout": 0.1}),
    # GPT-2's eager softmax runs in the scores' dtype: no fp32 softmax and no cast without autocast (+43.2%, +15.9%)
    ("gpt2", "eager", "bf16", {"dropout": 0.0}),
    ("gpt2", "eager", "bf16", {"dropout": 0.1}),
]


@pytest.mark.parametrize("model, attention, precision, flags", DROPOUT_CELLS)
def test_dropout_masks_follow_the_model_code(tmp_path: Path, model: str, attention: str, precision: str,
                                             flags: dict[str, float]) -> None:
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps(CONFIGS[model]))
    assert abs(_activation_error(path, attention, precision, **flags)) <= 0.005


#: (attention, precision, flags): GPT-2 with LoRA on its bf16 frozen base (peft's default adapters in fp32). The
#: estimate before the mechanism was fixed, against the trace's activations: the hf profile's torch.autocast runs
#: over a 16-bit base too, so gelu_new's pow and its followers run in fp32 and each LayerNorm saves autocast's fp32
#: copy of its 16-bit input (both were priced only over fp32 weights): eager -25.8% (c_attn), -23.5% (c_attn,
#: dropout 0.1), -23.4% (all-linear), SDPA -41.8%; in pure bf16 (no autocast) a frozen LayerNorm keeps its 16-bit
#: input itself, which was priced as an RMSNorm's (an fp32 copy it does not make): -4.9%.
LORA_CELLS = [
    ("eager", "bf16-mixed", {"lora_targets": "c_attn", "dropout": 0.0}),
    ("eager", "bf16-mixed", {"lora_targets": "c_attn", "dropout": 0.1}),
    ("eager", "bf16-mixed", {"lora_targets": "all-linear", "dropout": 0.0}),
    ("sdpa", "bf16-mixed", {"lora_targets": "c_attn", "dropout": 0.0}),
    ("eager", "bf16", {"lora_targets": "c_attn", "dropout": 0.0}),
]


@pytest.mark.parametrize("attention, precision, flags", LORA_CELLS)
def test_gpt2_lora_on_a_16bit_base_runs_under_autocast(tmp_path: Path, attention: str, precision: str,
                                                       flags: dict[str, object]) -> None:
    pytest.importorskip("peft")
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(GPT2))
    assert abs(_activation_error(path, attention, precision, peft="lora", **flags)) <= 0.005


#: (precision, flags): GPT-2 under full recompute, where the recomputed layer's backward through gelu_new sets the
#: peak. Its last product (0.5 * x times 1 + tanh(...)) holds three tensors of one intermediate's size (fp32 under
#: autocast) beside the saved ones; the general rule took two of the whole gelu_new term, three such tensors: the
#: peak +20.3%, +22.5%, +7.0% and +11.5% (full training) before it priced one term's first node.
RECOMPUTED_CELLS = [
    ("bf16-mixed", {"peft": "lora", "lora_targets": "c_attn", "dropout": 0.0}),
    ("bf16-mixed", {"peft": "lora", "lora_targets": "all-linear", "dropout": 0.1}),
    ("bf16", {"peft": "lora", "lora_targets": "c_attn", "dropout": 0.0}),
    ("bf16-mixed", {"dropout": 0.0}),
    ("fp32", {"peft": "lora", "lora_targets": "c_attn", "dropout": 0.0}),
]


@pytest.mark.parametrize("precision, flags", RECOMPUTED_CELLS)
def test_gpt2_recomputed_layer_backward_prices_gelu_new_node_by_node(tmp_path: Path, precision: str,
                                                                    flags: dict[str, object]) -> None:
    if "peft" in flags:
        pytest.importorskip("peft")
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(GPT2))
    # within 1% since session 13 (the MLP node walk with a recomputed layer's residual gradient and its checkpointed
    # input read once: the all-linear dropout cell was +2.90%, fp32 LoRA -1.58% with only the second)
    assert abs(_error(path, "eager", precision, "peak allocated", recompute="full", **flags)) <= 0.01


#: Granite: Llama's layers, the embedding scaled by ``embedding_multiplier`` in the model's forward.
GRANITE = {**LLAMA, "model_type": "granite", "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
           "attention_multiplier": 0.0078125, "logits_scaling": 16.0}


@pytest.mark.parametrize("model, attention, precision, flags", [
    ("gpt2", "eager", "bf16-mixed", {"lora_targets": "c_attn", "dropout": 0.0}),
    ("gpt2", "sdpa", "bf16-mixed", {"lora_targets": "c_attn", "dropout": 0.0}),
    ("gpt2", "eager", "bf16", {"lora_targets": "c_attn", "dropout": 0.0}),
    ("granite", "eager", "bf16-mixed", {"lora_targets": "q_proj,v_proj"}),
    ("llama", "eager", "bf16-mixed", {"lora_targets": "q_proj,v_proj"}),  # the leaf is the first layer's input
])
def test_checkpointed_lora_keeps_the_embedding_leaf(tmp_path: Path, model: str, attention: str, precision: str,
                                                   flags: dict[str, object]) -> None:
    """Under checkpointing enable_input_require_grads makes the frozen embedding's output a leaf autograd keeps;
    GPT-2 (position embeddings added) and Granite (embedding multiplier) make the first layer's input apart from
    it (activations before: -17.0%, -20.4%, -20.3%, -16.4%)."""
    pytest.importorskip("peft")
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps({**CONFIGS, "granite": GRANITE}[model]))
    assert abs(_error(path, attention, precision, recompute="full", peft="lora", **flags)) <= 0.005

#: (attention, precision, flags): GPT-NeoX's parallel residual (transformers' ``use_parallel_residual``) feeds the
#: MLP's pre-norm the layer input, which the attention's pre-norm keeps already; it was priced as a second tensor
#: (eager bf16-mixed +4.0% at dropout 0, +3.6% at 0.1; fp32 +4.1%; sdpa +6.9%; pure bf16 +2.5%). With LoRA on
#: ``query_key_value`` only, the first layer's MLP reads the frozen embedding's output, so it keeps nothing; it
#: was priced as reading the attention's output (+9.0%).
NEOX_CELLS = [
    ("eager", "bf16-mixed", {"dropout": 0.0}),
    ("eager", "bf16-mixed", {"dropout": 0.1}),
    ("eager", "fp32", {"dropout": 0.0}),
    ("sdpa", "bf16-mixed", {"dropout": 0.0}),
    ("eager", "bf16", {"dropout": 0.0}),
    ("eager", "bf16-mixed", {"dropout": 0.0, "peft": "lora", "lora_targets": "query_key_value"}),
]


@pytest.mark.parametrize("attention, precision, flags", NEOX_CELLS)
def test_gpt_neox_parallel_residual_keeps_the_layer_input_once(tmp_path: Path, attention: str, precision: str,
                                                               flags: dict[str, object]) -> None:
    if "peft" in flags:
        pytest.importorskip("peft")
    path = tmp_path / "neox.json"
    path.write_text(json.dumps(NEOX))
    assert abs(_activation_error(path, attention, precision, **flags)) <= 0.005


#: (model, attention, precision, flags): a frozen base stored in another dtype than autocast's. autocast caches
#: copies of trainable leaves only, so each frozen linear casts its weight at every call and, where its input needs
#: a gradient, its matmul saves the 16-bit copy (unpriced: GPT-2 lora c_attn on an fp32 base -10.8% activations,
#: -6.6% peak; all-linear -9.9%; SDPA -16.4%; an fp16 base under bf16 autocast -10.8%; Llama SDPA all-linear
#: -25.7%). An eager RMSNorm keeps an fp32 input itself (``to(float32)`` is no copy): the final norm's was not
#: priced under partial freezing (Llama SDPA fp32 all-linear -2.7%, Phi-3 eager fp32 qkv_proj -2.2%).
FROZEN_BASE_CELLS = [
    ("gpt2", "eager", "bf16-mixed", {"lora_targets": "c_attn", "frozen_dtype": "fp32"}),
    ("gpt2", "eager", "bf16-mixed", {"lora_targets": "all-linear", "frozen_dtype": "fp32"}),
    ("gpt2", "sdpa", "bf16-mixed", {"lora_targets": "c_attn", "frozen_dtype": "fp32"}),
    ("gpt2", "eager", "bf16-mixed", {"lora_targets": "c_attn", "frozen_dtype": "fp16"}),
    ("llama", "sdpa", "bf16-mixed", {"lora_targets": "all-linear", "frozen_dtype": "fp32"}),
    ("llama", "sdpa", "fp32", {"lora_targets": "all-linear"}),
    ("phi3", "eager", "fp32", {"lora_targets": "qkv_proj"}),
    # peft's default q_proj, v_proj on eager attention: in the first layer (its input needs no gradient) the keys
    # need none, so ``q @ k^T`` saves no q (+1.2% on the bf16 base; fp32 0.00% on 1624be5 only because the final
    # norm's input was missing; an fp32 base -16.0% before the copies, +1.0% after)
    ("llama", "eager", "bf16-mixed", {"lora_targets": "q_proj,v_proj"}),
    ("llama", "eager", "fp32", {"lora_targets": "q_proj,v_proj"}),
    ("llama", "eager", "bf16-mixed", {"lora_targets": "q_proj,v_proj", "frozen_dtype": "fp32"}),
    # DoRA subtracts the frozen fp32 bias from the 16-bit base result, which type promotion makes fp32 (c_attn
    # -13.5%, all-linear -16.2%; -4.0% and -9.0% with the weight copies priced)
    ("gpt2", "eager", "bf16-mixed", {"peft": "dora", "lora_targets": "c_attn", "frozen_dtype": "fp32"}),
    ("gpt2", "eager", "bf16-mixed", {"peft": "dora", "lora_targets": "all-linear", "frozen_dtype": "fp32"}),
]


@pytest.mark.parametrize("model, attention, precision, flags", FROZEN_BASE_CELLS)
def test_a_frozen_base_in_another_dtype_keeps_its_weight_copies(tmp_path: Path, model: str, attention: str,
                                                                 precision: str, flags: dict[str, object]) -> None:
    pytest.importorskip("peft")
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps(CONFIGS[model]))
    result = trace(str(path), seq=256, mbs=2, precision=precision, attention=attention, recompute="none",
                   optimizer="adamw", optimizer_impl="foreach", device="cuda", iterations=2, dropout=0.0,
                   **{"peft": "lora", **flags})
    rows = {row.category: row for row in compare_with_estimate(str(path), result.options, result.summary).rows}
    assert abs(rows["activation"].relative or 0.0) <= 0.005
    assert abs(rows["peak allocated"].relative or 0.0) <= 0.005
