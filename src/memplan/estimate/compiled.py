"""``--compile``: what a compiled decoder layer saves, from AOT autograd's min-cut partitioner.

``torch.compile`` (inductor) decomposes each compiled region's joint forward-backward graph with its
decomposition table, runs its joint-graph passes and hands it to
``min_cut_rematerialization_partition(compiler="inductor")`` (``torch._inductor.compile_fx.partition_fn``),
which saves the outputs of compute-heavy operators (matmuls, attention kernels, reductions) and recomputes
the elementwise chains around them in the backward. The terms below are the saved set that partitioner
chooses for one decoder layer of each family of transformers' modules, read off ``memplan trace
--compile`` (:mod:`memplan.trace.runners.partitioner`, which runs that very pipeline on fake tensors) and
written per token as functions of the layer's widths; the agreement grid checks them against the trace on
every family (benchmarks/agreement_grid.py, ``compile=True`` cells).

Families priced (``T`` tokens, ``c`` bytes of the compute dtype, ``r`` of the residual stream, ``h`` hidden,
``H``/``KV`` query/key-value heads of ``d`` (``dv`` for values), ``f`` the MLP width):

* **Llama-style** (RMSNorm, rotary, gated MLP; GQA or MHA, biases, fused q/k/v or gate/up, Qwen3's q/k
  norms, Gemma 2's post-norms): the layer input (``r·h``), each norm's fp32 1/rms, the attention norm's
  output, q/k/v after RoPE, the kernel's output and fp32 log-sum-exp, the output projection's output, the
  MLP norm's output, gate, up and the down projection's input (``3c·f``). The inputs of the output
  projection and of the residual adds are recomputed (views, or elementwise from saved values).
  Phi-3's fused q/k/v projection: its whole output too wherever the saved v is a view of it
  (:func:`_saved_v_holds_fused_qkv`).
* **Unfused attention** (``--attention eager``): q, and k and v repeated to every query head, the output
  projection's input, and for 16-bit activations the scores and probabilities (``2c·H·s`` per token) with the
  fp32 softmax max and sum (the fp32 softmax is recomputed from them; Gemma 2's soft-capping too), for fp32
  the probabilities alone.
* **GPT-2-style** (LayerNorm, learned positions, plain MLP, dropout modules): each LayerNorm's fp32 mean and
  1/std and its output, q/k/v, the kernel's output and log-sum-exp, the attention output projection's
  output, the fc output and the activation's output, and with ``--dropout`` above 0 the two residual dropout
  masks (1 byte each; at p = 0 the decomposition returns its input and keeps none).
* **MoE** (Qwen3-MoE style, transformers' grouped experts): the attention as above; the router's input and
  fp32 probabilities, the top-k weights and int64 indices, three int64 permutation index vectors, and per
  routed token the experts' gathered input, gate-up output, activation output and down output in the
  experts' dtype. An fp32 router (DeepSeek's) keeps an fp32 copy of its input without autocast.
  **Shared experts** (DeepSeek-V2, one gated MLP of their summed width): their gate and up outputs and the
  down projection's input, and under autocast their own 16-bit copy of the norm output.
* **MLA** (DeepSeek-V2/V3, ``sdpa``): per latent (the query's when ``q_lora_rank`` is set, the key/value's)
  the down projection's output, the latent norm's fp32 1/rms and output; q, k, v at the full query/key
  head width (``nope + rope``) and v at ``dv``, the kernel's output and log-sum-exp as above, and the
  output projection's input (a copy of the kernel's output).

Not priced (the layer falls back to the eager terms and ``unmodelled_settings`` says so): MLA with unfused
attention, MoE with a gated shared expert (Qwen2-MoE) or a router bias (DeepSeek-V3), parallel-residual
layers, tensor / context / expert parallelism, FP8, activation policies other than ``none``, fine-tuning,
activation offloading, framework model code other than transformers' (torchtitan's own, Megatron's
Transformer Engine layers) and dropout in Llama-style layers where it runs (on the attention probabilities, or
Phi-3's residual dropout; Llama's own code has no hidden-state dropout, so ``--dropout`` with
``--attention-dropout 0`` runs none). Never priced: inductor's generated kernels' transients and workspaces, CUDA graphs, graph breaks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimate import compiled_loss
from memplan.estimate.activations import ActivationShape, Term, pv_matmul_saves_v_view
from memplan.estimate.terms import TermRole
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import AttentionSpec, LayerSpec, MoESpec
from memplan.settings import InputSetting

if TYPE_CHECKING:
    from memplan.estimate.context import RunContext

__all__ = ["FP32_BYTES", "INDEX_BYTES", "compile_note", "compile_settings", "compiled_blocks", "compiled_layer",
           "keeps_masks", "uncovered_reason"]

#: Bytes of the fp32 statistics the decomposed norms and softmax keep (1/rms, mean, max, sum, log-sum-exp).
FP32_BYTES = 4
#: Bytes of an int64 index (top-k indices, token permutation).
INDEX_BYTES = 8
#: The memory-efficient attention kernel's log-sum-exp rows are padded to this many queries
#: (``_efficient_attention_forward``: ``ceil_div(max_seqlen_q, kAlignLSE) * kAlignLSE``, kAlignLSE = 32).
EFFICIENT_LSE_ALIGN = 32
#: Bytes of a dropout mask element (bool).
MASK_BYTES = 1
#: int64 vectors of one element per routed token the MoE permutation keeps (sorted order, expert of each
#: routed token, the inverse permutation written by ``index_put``).
PERMUTATION_VECTORS = 3


def _job_reason(run: RunContext) -> str | None:
    """Why no layer of the job is priced as compiled (None: each layer's own rule decides)."""
    job = run.job
    checks = ((run.policy.name != "none", f"the activation policy {run.policy.name!r} around compiled layers"),
              (run.finetune, "fine-tuning (frozen or adapted layers)"),
              (job.offload.activations, "activation offloading"),
              (job.torchtitan_model, "a framework's own model code (not transformers' modules)"))
    return next((reason for failed, reason in checks if failed), None)


def compiled_layer(run: RunContext, layer: LayerSpec) -> bool:
    """``--compile`` prices ``layer`` with the partitioner's saved set."""
    return run.job.compile and _job_reason(run) is None and uncovered_reason(layer, run.shape) is None


def keeps_masks(run: RunContext) -> bool:
    """Compiled 16-bit eager attention keeps its additive masks (one per kind of layer, shared) for the
    backward: the softmax is recomputed there from the saved scores, the mask added again."""
    shape = run.shape
    return (run.job.compile and shape.attention in ("eager", "math") and shape.act_bytes < FP32_BYTES
            and any(compiled_layer(run, layer) for layer in run.model.layers))


def compile_settings(run: RunContext) -> tuple[InputSetting, ...]:
    """``--compile``: each compiled part memplan prices as eager, as a not-modelled setting (never silent)."""
    if not run.job.compile:
        return ()
    reasons = [_job_reason(run)]
    if reasons[0] is None:
        reasons = list(dict.fromkeys(uncovered_reason(layer, run.shape) for layer in run.model.layers))
    out = [InputSetting(source="--compile", key="compiled layers", value=True, effect="not-modelled",
                        note=f"{reason}: no partitioner rule, the layers are priced as eager")
           for reason in reasons if reason is not None]
    if run.profile.compile_scope == "model":
        parts = "embedding, final norm and head are" if compiled_loss.priced(run) else \
            "embedding, final norm, head and loss are"
        out.append(InputSetting(source="--compile", key="compiled model", value=True, effect="not-modelled",
                                note=f"{run.profile.name} compiles the whole model: the {parts} priced as eager"))
    return (*out, *compiled_loss.loss_settings(run))


def compile_note(run: RunContext) -> list[str]:
    """The assumption sentence of a ``--compile`` job."""
    if not run.job.compile:
        return []
    priced = sum(compiled_layer(run, layer) for layer in run.model.layers)
    return [f"torch.compile: {priced} of {len(run.model.layers)} decoder layers keep AOT autograd's min-cut "
            "partitioner's saved set (inductor's decompositions, default settings; memplan.estimate.compiled); "
            "inductor's kernel transients, workspaces and CUDA graphs are not modelled",
            *compiled_loss.compiled_loss_note(run)]


def uncovered_reason(layer: LayerSpec, shape: ActivationShape) -> str | None:
    """Why the partitioner's saved set of ``layer`` is not priced (None: it is)."""
    attn = layer.attention
    checks = (
        (shape.kernels != "eager", "the framework's fused layers (Transformer Engine or its own model code)"),
        (shape.rope_buffer or shape.fused_rms_norm, "a framework's own model code (not transformers' modules)"),
        (shape.tp > 1 or shape.sequence_parallel, "tensor / sequence parallelism"),
        (shape.kv_seq != shape.seq, "context parallelism"),
        (shape.ep > 1 or shape.expert_tp > 1, "expert parallelism"),
        (shape.fp8, "FP8 GEMMs"),
        (attention_kind(attn).latent and shape.attention in ("eager", "math"),
         "multi-head latent attention (MLA) with unfused attention"),
        (layer.parallel_residual, "parallel-residual layers"),
        (not layer.pre_norms, "layers without pre-norms (OLMo 2's post-norms only)"),
        (layer.moe is not None and (layer.moe.shared_expert_gate or layer.moe.router_bias),
         "MoE with a gated shared expert or a router bias"),
        (layer.moe is not None and layer.moe.shared_expert is not None
         and (layer.moe.shared_expert.fused_gate_up or not layer.moe.shared_expert.gated),
         "MoE with a fused or ungated shared expert"),
    )
    for failed, reason in checks:
        if failed:
            return reason
    family = _family(layer, shape)
    if family is None:
        return "a layer that is neither Llama-style (RMSNorm, RoPE, gated MLP) nor GPT-2-style (LayerNorm, plain MLP)"
    if family == "llama" and (shape.drops_residual or shape.drops_attention):
        return "dropout in Llama-style layers"
    return None


def _family(layer: LayerSpec, shape: ActivationShape) -> str | None:
    gated = layer.moe is not None or (layer.mlp is not None and layer.mlp.gated)
    if shape.norm == "rmsnorm" and shape.rope and gated:
        return "llama"
    if shape.norm == "layernorm" and not shape.rope and not gated and layer.moe is None:
        return "gpt2"
    return None


def compiled_blocks(layer: LayerSpec, shape: ActivationShape) -> tuple[list[Term], list[Term]]:
    """(attention, rest) terms of a compiled layer (call only where :func:`uncovered_reason` is None)."""
    gpt2 = _family(layer, shape) == "gpt2"
    tokens, c, h = shape.seq * shape.micro_batch, shape.act_bytes, shape.hidden
    stats = (2 if gpt2 else 1) * FP32_BYTES  # LayerNorm: mean and 1/std; RMSNorm: 1/rms
    attention = [Term("layer input", shape.residual_bytes * tokens * h, "sp", "input"),
                 Term("attention norm statistics (fp32)", stats * tokens, "sp", "body", role=TermRole.NORM_OTHER),
                 Term("attention norm output (the projections' input)", c * tokens * h, "sp", "body",
                      role=TermRole.NORM_OTHER),
                 *_latent_terms(layer.attention, shape),
                 *_attention_core(layer.attention, shape),
                 Term("output projection output", c * tokens * h, "sp", "body")]
    rest = [Term("MLP norm statistics (fp32)", stats * tokens, "sp", "body"),
            Term("MLP norm output", c * tokens * h, "sp", "body")]
    if gpt2 and shape.drops_residual:
        rest += [Term("residual dropout masks (attention, MLP)", 2 * MASK_BYTES * tokens * h, "sp", "body")]
    post_norms = layer.num_hidden_norms - 2
    if post_norms > 0:  # Gemma 2: the post-norms' 1/rms and the MLP output they normalize
        rest += [Term("post-norms 1/rms (fp32)", post_norms * FP32_BYTES * tokens, "sp", "body"),
                 Term("MLP output (post-norm input)", c * tokens * h, "sp", "body")]
    if layer.moe is not None:
        return attention, rest + _moe(layer.moe, shape)
    assert layer.mlp is not None
    f = layer.mlp.intermediate_size
    if gpt2:
        rest.append(Term("fc output and activation output", 2 * c * tokens * f, "tp", "body"))
    else:
        rest.append(Term("gate and up outputs, down projection input", 3 * c * tokens * f, "tp", "body"))
    return attention, rest


def _attention_core(attn: AttentionSpec, shape: ActivationShape) -> list[Term]:
    tokens, c = shape.seq * shape.micro_batch, shape.act_bytes
    heads, kv_heads, d, dv = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.v_head_dim
    terms = []
    if _saved_v_holds_fused_qkv(attn, shape):
        terms.append(Term("fused q/k/v projection output held by the saved v (a view)",
                          c * tokens * (heads + kv_heads) * d, "tp", "attn"))
    if attn.qk_norm:  # Qwen3: the q and k projections' outputs and the per-head norms' 1/rms
        terms += [Term("q, k projection outputs (q/k norm inputs)", c * tokens * (heads + kv_heads) * d, "tp", "attn"),
                  Term("q, k norms 1/rms (fp32)", FP32_BYTES * tokens * attn.qk_norm_rows, "tp", "attn")]
    if shape.attention in ("eager", "math"):
        scores = heads * shape.micro_batch * shape.seq * shape.kv_seq
        if c >= FP32_BYTES:  # an fp32 softmax is kept as it is: its output feeds its backward and the PV matmul
            core = [Term("probabilities (fp32)", FP32_BYTES * scores, "tp", "core")]
        else:  # the 16-bit scores and the fp32 max and sum recompute the fp32 softmax; its 16-bit cast is kept
            core = [Term("scores and probabilities (compute dtype)", 2 * c * scores, "tp", "core"),
                    Term("softmax max and sum (fp32)", 2 * FP32_BYTES * tokens * heads, "tp", "core")]
        return terms + core + [
            Term("q, and k and v repeated to every query head", c * tokens * heads * (2 * d + dv), "tp", "attn"),
            Term("output projection input", c * tokens * heads * dv, "tp", "attn",
                 role=TermRole.OUTPUT_PROJECTION_INPUT)]
    # fp32 runs the memory-efficient kernel, whose log-sum-exp pads the sequence to a multiple of 32
    lse_seq = -(-shape.seq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN if c >= FP32_BYTES else shape.seq
    return terms + [
        Term("q, k, v (attention kernel inputs)", c * tokens * (heads * d + kv_heads * (d + dv)), "tp", "attn"),
        Term("attention kernel output", c * tokens * heads * dv, "tp", "core"),
        Term("attention log-sum-exp (fp32)", FP32_BYTES * shape.micro_batch * lse_seq * heads, "tp", "core")]


def _saved_v_holds_fused_qkv(attn: AttentionSpec, shape: ActivationShape) -> bool:
    """Phi-3's fused q/k/v projection: q and k are sliced out and rotated into new tensors, v stays a strided
    view of the projection's output, and a saved view keeps that whole output (its q and k parts too) alive.

    SDPA's kernel saves v as given: held, under autocast too. Unfused attention: where the PV matmul saves
    the view rather than a copy (:func:`~memplan.estimate.activations.pv_matmul_saves_v_view`: MHA at
    micro-batch 1, phi-3-mini's grid cell; not at micro-batch 2, the toys of the tests)."""
    if not (attn.fused_qkv and shape.rope):
        return False
    return shape.attention not in ("eager", "math") or pv_matmul_saves_v_view(attn, shape)


def _latent_terms(attn: AttentionSpec, shape: ActivationShape) -> list[Term]:
    """MLA (DeepSeek-V2/V3 in transformers): each latent's down projection output (its norm's input), the
    norm's fp32 1/rms and its output (the up projection's input), and the output projection's input (the
    kernel's output transposed into a copy); the RoPE table's conjugate it keeps is a view of the layer's input."""
    if not attention_kind(attn).latent:
        return []
    tokens, c = shape.seq * shape.micro_batch, shape.act_bytes
    ranks = [("query", attn.q_lora_rank)] if attn.q_lora_rank else []
    ranks.append(("key/value", attn.kv_lora_rank or 0))
    terms = [Term(f"{name} latent: down projection output, norm 1/rms (fp32), norm output",
                  (2 * c * rank + FP32_BYTES) * tokens, "rep", "attn") for name, rank in ranks]
    return terms + [Term("output projection input", c * tokens * attn.num_heads * attn.v_head_dim, "tp", "attn",
                         role=TermRole.OUTPUT_PROJECTION_INPUT)]


def _shared_expert(moe: MoESpec, shape: ActivationShape) -> list[Term]:
    """The shared experts (one gated MLP of their summed width): gate and up outputs and the down projection's
    input; under autocast also their own 16-bit copy of the norm output (the router casts its own)."""
    if moe.shared_expert is None:
        return []
    tokens, c = shape.seq * shape.micro_batch, shape.act_bytes
    terms = [Term("shared experts: norm output copy (autocast)", c * tokens * shape.hidden, "sp", "body")]
    return terms[:shape.autocast] + [
        Term("shared experts: gate and up outputs, down projection input",
             3 * c * tokens * moe.shared_expert.intermediate_size, "tp", "body")]


def _moe(moe: MoESpec, shape: ActivationShape) -> list[Term]:
    tokens = shape.seq * shape.micro_batch
    routed = int(tokens * moe.top_k * shape.routed_factor)
    expert_bytes = shape.expert_bytes or shape.act_bytes
    width = 2 * shape.hidden + 3 * moe.expert.intermediate_size
    fp32_router = moe.router_fp32 and not shape.autocast and shape.act_bytes < FP32_BYTES
    router = [Term("router input cast to fp32 (fp32 router weight)", FP32_BYTES * tokens * shape.hidden, "rep",
                   "body", role=TermRole.ROUTER_OTHER)] if fp32_router else []
    return router + _shared_expert(moe, shape) + [
            Term("router probabilities (fp32)", FP32_BYTES * tokens * moe.num_experts, "rep", "body",
                 role=TermRole.ROUTER_OTHER),
            Term("top-k weights (fp32) and indices (int64)", (FP32_BYTES + INDEX_BYTES) * tokens * moe.top_k,
                 "rep", "body"),
            Term("token permutation indices (int64)", PERMUTATION_VECTORS * INDEX_BYTES * tokens * moe.top_k,
                 "rep", "body"),
            Term("experts: gathered input, gate-up output, activation, down output", expert_bytes * routed * width,
                 "rep", "body")]
