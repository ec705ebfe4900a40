"""The architecture part of Megatron-LM arguments: a ModelSpec for Megatron's GPT model.

Defaults are Megatron's (megatron/training/arguments.py, megatron/core/transformer_config.py):
FFN 4h (SwiGLU: 4h * 2/3 rounded down to a multiple of 64), learned absolute positions, LayerNorm,
biases on linear layers, tied embeddings, one KV group per head.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from memplan.bounds import MAX_EXPERTS, MAX_HEADS, MAX_INT_DIGITS, MAX_LAYERS, MAX_MODEL_INT, check_at_most
from memplan.errors import ModelConfigError
from memplan.frameworks.shell_script import unresolved_hint
from memplan.model.attention_kinds import MLA
from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec

#: Vocabulary sizes of Megatron's tokenizers when ``--vocab-size`` is absent (the tokenizer
#: decides; Megatron then pads it, see estimate.states.padded_vocab).
GPT2_BPE_VOCAB = 50257  # GPT2BPETokenizer: encoder.json entries
LLAMA2_VOCAB = 32000  # Llama2Tokenizer (SentencePiece tokenizer.model)
TIKTOKEN_VOCAB = 131072  # TikTokenizer default vocab_size (2**17, special tokens included)
#: SentencePiece models named in Megatron's tests, by file name.
_SENTENCEPIECE_VOCABS = {"nemotron_2_256k": 256000, "tokenizer.model": LLAMA2_VOCAB}


#: Flags whose value sizes a loop (one entry per layer, expert, head), with the limit each may reach.
_LIMITS = {
    **dict.fromkeys(("--num-layers", "--mtp-num-layers"), (MAX_LAYERS, "MAX_LAYERS")),
    **dict.fromkeys(("--num-experts", "--moe-router-topk"), (MAX_EXPERTS, "MAX_EXPERTS")),
    **dict.fromkeys(("--num-attention-heads", "--num-query-groups"), (MAX_HEADS, "MAX_HEADS")),
}


def _get_int(args: Mapping[str, Any], flag: str, default: int | None = None, *, required: bool = False) -> int | None:
    value = args.get(flag, default)
    if value is None:
        if required:
            raise ModelConfigError(flag, "is required to describe the model", None)
        return None
    if isinstance(value, str) and len(value.strip().lstrip("+-")) > MAX_INT_DIGITS:
        raise ModelConfigError(flag, f"must be an integer of at most {MAX_INT_DIGITS} digits (memplan's limit "
                               "MAX_INT_DIGITS)", value[:20] + "...")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ModelConfigError(flag, "must be an integer", value, hint=unresolved_hint(value)) from None
    if number <= 0:
        raise ModelConfigError(flag, "must be a positive integer", value)
    limit, limit_name = _LIMITS.get(flag, (MAX_MODEL_INT, "MAX_MODEL_INT"))
    return check_at_most(flag, value, number, limit, limit_name, ModelConfigError)


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
    moe = _moe_spec(args, hidden=hidden, ffn=ffn, swiglu=swiglu, bias=bias)
    if moe is None:
        layer_list = (LayerSpec(attention=attention, mlp=mlp),) * layers
    else:
        dense_layer = LayerSpec(attention=attention, mlp=mlp)
        moe_layer = LayerSpec(attention=attention, moe=moe)
        layer_list = tuple(moe_layer if sparse else dense_layer for sparse in moe_layer_pattern(args, layers))
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
        layers=layer_list,
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
        kind=MLA.spec_kind,
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


def _moe_spec(args: Mapping[str, Any], *, hidden: int, ffn: int, swiglu: bool, bias: bool) -> MoESpec | None:
    """The MoE block of ``--num-experts`` models (megatron/core/transformer/moe)."""
    experts = _get_int(args, "--num-experts")
    if experts is None:
        return None
    expert_ffn = _get_int(args, "--moe-ffn-hidden-size", ffn) or ffn
    top_k = _get_int(args, "--moe-router-topk", 2) or 2
    if top_k > experts:
        raise ModelConfigError("--moe-router-topk", f"must not exceed --num-experts ({experts})", top_k)
    expert_bias = flag_is_set(args, "--moe-router-enable-expert-bias")
    score = str(args.get("--moe-router-score-function", "softmax"))
    if expert_bias and score not in ("sigmoid", "sqrtsoftplus"):  # TransformerConfig.__post_init__ raises
        raise ModelConfigError("--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid or "
                               "sqrtsoftplus (Megatron raises with the others)", score)
    act = "swiglu" if swiglu else "gelu"
    shared_size = _get_int(args, "--moe-shared-expert-intermediate-size")
    shared = MLPSpec(intermediate_size=shared_size, gated=swiglu, bias=bias, activation=act) if shared_size else None
    return MoESpec(
        num_experts=experts,
        top_k=top_k,
        expert=MLPSpec(intermediate_size=expert_ffn, gated=swiglu, bias=bias, activation=act),
        shared_expert=shared,
        shared_expert_gate=flag_is_set(args, "--moe-shared-expert-gate"),
        # --moe-router-enable-expert-bias registers the score-correction bias as a buffer.
        router_bias=expert_bias,
        router_bias_is_buffer=True,
    )


def moe_layer_pattern(args: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers are MoE: ``--moe-layer-freq`` N (layer i is MoE when i % N == 0) or a list.

    The list form is a Python expression of 0/1 lists such as ``([0]*3+[1]*11)``; it is evaluated
    by a small arithmetic walker over list literals, ``+`` and ``*`` only (never ``eval``).
    """
    raw = args.get("--moe-layer-freq", 1)
    if isinstance(raw, int) or (isinstance(raw, str) and raw.strip().isdigit()):
        freq = int(raw)
        if freq <= 0:
            raise ModelConfigError("--moe-layer-freq", "must be a positive integer or a 0/1 list", raw)
        return tuple(i % freq == 0 for i in range(num_layers))
    values = raw if isinstance(raw, list) else _int_list_expression(str(raw), "--moe-layer-freq")
    if len(values) != num_layers or any(v not in (0, 1) for v in values):
        raise ModelConfigError(
            "--moe-layer-freq", f"must list a 0 or 1 for each of the {num_layers} layers", raw
        )
    return tuple(bool(v) for v in values)


def _int_list_expression(text: str, flag: str) -> list[int]:
    try:
        tree = ast.parse(text.strip(), mode="eval")
        value = _walk(tree.body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        raise ModelConfigError(flag, "must be an integer or a list expression like ([0]*3+[1]*11)", text) from None
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ModelConfigError(flag, "must evaluate to a list of integers", text)
    return value


def _walk(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_walk(e) for e in node.elts]
        return items if isinstance(node, ast.List) else (items[0] if len(items) == 1 else items)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(right, int) and not 0 <= right <= MAX_LAYERS:
            raise ValueError("repeat count out of range")
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and len(left) * right > MAX_LAYERS:
            raise ValueError("list longer than MAX_LAYERS")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("unsupported expression")


def pipeline_layout_chunks(layout: str) -> tuple[tuple[int, ...], bool]:
    """Decoder layers per chunk of Megatron's ``--pipeline-model-parallel-layout``, and whether MTP is last.

    The layout is a string of stages separated by ``|``: ``E`` embedding, ``t`` a decoder layer,
    ``m`` a multi-token-prediction layer, ``L`` the loss; ``X*n`` repeats a symbol and ``(..)*n`` a
    group, e.g. ``Et*2|(tt|)*5t|tmL`` (8 chunks: 2,2,2,2,2,2,1,1 layers).
    """
    try:
        flat = _expand_layout(layout.replace(" ", ""))
    except (ValueError, IndexError, RecursionError):
        raise ModelConfigError("--pipeline-model-parallel-layout", "is not a valid layout string", layout) from None
    stages = flat.split("|")
    counts = tuple(stage.count("t") for stage in stages)
    mtp_last = all("m" not in stage for stage in stages[:-1])
    return counts, mtp_last


def _expand_layout(text: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "(":
            depth, j = 1, i + 1
            while depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            item, i = _expand_layout(text[i + 1 : j - 1]), j
        elif char in "Etm L|":
            item, i = char, i + 1
        else:
            raise ValueError(f"unexpected {char!r}")
        if i < len(text) and text[i] == "*":
            j = i + 1
            while j < len(text) and text[j].isdigit():
                j += 1
            count = int(text[i + 1 : j]) if j - i - 1 <= MAX_INT_DIGITS else MAX_LAYERS + 1
            if len(item) * count > 8 * MAX_LAYERS:
                raise ValueError("layout longer than 8 x MAX_LAYERS symbols")
            item, i = item * count, j
        out.append(item)
    return "".join(out)
