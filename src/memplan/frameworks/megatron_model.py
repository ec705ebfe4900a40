"""The architecture part of Megatron-LM arguments: a ModelSpec for Megatron's GPT model.

Defaults are Megatron's (megatron/training/arguments.py, megatron/core/transformer_config.py):
FFN 4h (SwiGLU: 4h * 2/3 rounded down to a multiple of 64), learned absolute positions, LayerNorm,
biases on linear layers, tied embeddings, one KV group per head.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memplan.errors import ModelConfigError, UnsupportedError
from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec

#: Vocabulary sizes of Megatron's tokenizers when ``--vocab-size`` is absent (the tokenizer
#: decides; Megatron then pads it, see estimate.states.padded_vocab).
GPT2_BPE_VOCAB = 50257  # GPT2BPETokenizer: encoder.json entries
LLAMA2_VOCAB = 32000  # Llama2Tokenizer (SentencePiece tokenizer.model)
TIKTOKEN_VOCAB = 131072  # TikTokenizer default vocab_size (2**17, special tokens included)
#: SentencePiece models named in Megatron's tests, by file name.
_SENTENCEPIECE_VOCABS = {"nemotron_2_256k": 256000, "tokenizer.model": LLAMA2_VOCAB}


def _get_int(args: Mapping[str, Any], flag: str, default: int | None = None, *, required: bool = False) -> int | None:
    value = args.get(flag, default)
    if value is None:
        if required:
            raise ModelConfigError(flag, "is required to describe the model", None)
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ModelConfigError(flag, "must be an integer", value) from None
    if number <= 0:
        raise ModelConfigError(flag, "must be a positive integer", value)
    return number


def flag_is_set(args: Mapping[str, Any], flag: str) -> bool:
    value = args.get(flag, False)
    if isinstance(value, str):
        return value.lower() not in ("false", "0", "no")
    return bool(value)


def tokenizer_vocab_size(args: Mapping[str, Any]) -> int:
    """Vocabulary before padding: ``--vocab-size`` or what the named tokenizer holds."""
    kind = args.get("--tokenizer-type")
    explicit = _get_int(args, "--vocab-size")
    if kind == "NullTokenizer":
        if explicit is None:
            raise ModelConfigError("--vocab-size", "is required with --tokenizer-type NullTokenizer", None)
        return explicit + 1  # NullTokenizer adds an end-of-document id after the vocabulary
    if explicit is not None:
        return explicit
    if kind in (None, "GPT2BPETokenizer"):
        return GPT2_BPE_VOCAB
    if kind == "Llama2Tokenizer":
        return LLAMA2_VOCAB
    if kind == "TikTokenizer":
        return TIKTOKEN_VOCAB
    model_file = str(args.get("--tokenizer-model", ""))
    for stem, size in _SENTENCEPIECE_VOCABS.items():
        if model_file.endswith(stem) or model_file.endswith(stem + ".model"):
            return size
    raise ModelConfigError(
        "--vocab-size",
        f"is needed: the vocabulary of tokenizer {kind!r} ({model_file or 'no model file'}) is not known offline",
        None,
    )


def megatron_model_spec(args: Mapping[str, Any], *, name: str) -> ModelSpec:
    """ModelSpec of Megatron's GPT model for these arguments."""
    hidden = _get_int(args, "--hidden-size", required=True)
    layers = _get_int(args, "--num-layers", required=True)
    heads = _get_int(args, "--num-attention-heads", required=True)
    assert hidden and layers and heads
    if flag_is_set(args, "--num-experts") or "--num-experts" in args:
        raise UnsupportedError("--num-experts: MoE layers from Megatron arguments are not modelled yet")
    head_dim = _get_int(args, "--kv-channels", hidden // heads) or hidden // heads
    groups = _get_int(args, "--num-query-groups", heads) if flag_is_set(args, "--group-query-attention") else heads
    bias = not flag_is_set(args, "--disable-bias-linear")
    swiglu = flag_is_set(args, "--swiglu")
    ffn = _get_int(args, "--ffn-hidden-size")
    if ffn is None:
        ffn = int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden
    attention = _attention_spec(args, heads=heads, groups=groups or heads, head_dim=head_dim, bias=bias)
    mlp = MLPSpec(
        intermediate_size=ffn,
        gated=swiglu,
        bias=bias,
        activation="swiglu" if swiglu else ("squared_relu" if flag_is_set(args, "--squared-relu") else "gelu"),
    )
    layer = LayerSpec(attention=attention, mlp=mlp)
    position = str(args.get("--position-embedding-type", "learned_absolute"))
    if flag_is_set(args, "--use-rotary-position-embeddings"):
        position = "rope"
    learned = position == "learned_absolute"
    norm = str(args.get("--normalization", "LayerNorm"))
    return ModelSpec(
        name=name,
        model_type="megatron-gpt",
        hidden_size=hidden,
        vocab_size=tokenizer_vocab_size(args),
        layers=(layer,) * layers,
        norm="rmsnorm" if norm == "RMSNorm" else "layernorm",
        norm_bias=norm != "RMSNorm",
        tie_word_embeddings=not flag_is_set(args, "--untie-embeddings-and-output-weights"),
        position_embedding="learned" if learned else ("rope" if position in ("rope", "mrope", "yarn") else "none"),
        max_position_embeddings=(_get_int(args, "--max-position-embeddings", _get_int(args, "--seq-length", 1024)) or 0) if learned else 0,
        mtp_layers=_get_int(args, "--mtp-num-layers", None) or 0,
    )


def _attention_spec(args: Mapping[str, Any], *, heads: int, groups: int, head_dim: int, bias: bool) -> AttentionSpec:
    qk_norm = flag_is_set(args, "--qk-layernorm")
    if not flag_is_set(args, "--multi-latent-attention"):
        return AttentionSpec(
            num_heads=heads,
            num_kv_heads=groups,
            head_dim=head_dim,
            v_head_dim=head_dim,
            qkv_bias=bias or flag_is_set(args, "--add-qkv-bias"),
            out_bias=bias,
            qk_norm=qk_norm,
        )
    nope = _get_int(args, "--qk-head-dim", 128) or 128
    rope = _get_int(args, "--qk-pos-emb-head-dim", 64) or 64
    return AttentionSpec(
        kind="mla",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + rope,
        v_head_dim=_get_int(args, "--v-head-dim", 128) or 128,
        q_lora_rank=_get_int(args, "--q-lora-rank"),
        kv_lora_rank=_get_int(args, "--kv-lora-rank", 512),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        qkv_bias=False,
        out_bias=bias,
    )
