"""Terms outside the decoder layers: embedding, head and loss, inputs, framework buffers, temporaries."""

from __future__ import annotations

from memplan.estimate.activations import DROPOUT_MASK_BYTES, ActivationShape, eager_norm_terms
from memplan.estimate.optimizers import step_temporary_bytes
from memplan.estimate.precision import ResolvedPrecision
from memplan.estimate.states import StageParams, StateBytes
from memplan.job import Job, resolved_optimizer_impl
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import ModelSpec
from memplan.profiles import FrameworkProfile
from memplan.units import dtype_bytes

#: Megatron's data iterator puts int64 tokens, labels and position ids, an fp32 loss mask and a
#: bool [b, 1, s, s] attention mask on the first and last stages (megatron/training/utils.py
#: get_batch_on_this_tp_rank).
_INT64 = 8
_FP32 = 4


def embedding_activation_bytes(shape: ActivationShape) -> int:
    """Saved by the embedding stage per micro-batch: the embedding-dropout mask."""
    if not shape.drops_embedding:
        return 0
    sbh = shape.seq * shape.micro_batch * shape.hidden
    return DROPOUT_MASK_BYTES * sbh // (shape.tp if shape.sequence_parallel else 1)


def rope_table_bytes(model: ModelSpec, shape: ActivationShape) -> int:
    """RoPE's cos and sin tables, saved by every layer's ``q * cos`` / ``k * sin`` (shared, once).

    transformers' rotary embedding returns them as ``(1, seq, rotary_dim)`` in the hidden states'
    dtype (the residual dtype: fp32 under autocast); ``position_ids`` has batch 1 when not given.
    Gemma 3 and OLMo 3 build one pair per kind of layer (sliding, global: different bases).
    """
    if model.position_embedding != "rope" or shape.kernels != "eager" or shape.rope_buffer:
        return 0  # (a precomputed buffer, sliced as a view, allocates nothing per step)
    attn = model.layers[0].attention
    if not attention_kind(attn).full_head_rope:
        return 0
    rotary_dim = int(attn.head_dim * attn.rotary_fraction)
    kinds = len({layer.attention.sliding_window for layer in model.layers}) if model.rope_per_layer_type else 1
    return 2 * kinds * shape.seq * rotary_dim * shape.residual_bytes


def checkpointed_mask_bytes(model: ModelSpec, shape: ActivationShape, checkpointed: bool) -> int:
    """4-D attention masks kept as checkpoint inputs.

    Eager attention gets an explicit ``(batch, 1, seq, seq)`` additive mask in the hidden states'
    dtype, one per kind of layer (global; sliding-window) built once per forward. Adding it to the
    scores saves nothing, but a checkpointed decoder layer or attention module keeps its inputs,
    the mask among them, until its backward (``torch.utils.checkpoint``). ``checkpointed``: the
    policy checkpoints a region the mask enters (:attr:`memplan.policies.ActivationPolicy.keeps_mask`).
    """
    if shape.attention != "eager" or shape.kernels != "eager" or not checkpointed:
        return 0
    kinds = len({layer.attention.sliding_window for layer in model.layers})
    return kinds * shape.micro_batch * shape.seq * shape.kv_seq * shape.residual_bytes


def head_activation_bytes(shape: ActivationShape) -> int:
    """Saved by the final norm and the output projection: the norm's input, what an eager norm
    saves beyond it (its normalized tensor; :func:`eager_norm_terms`) and the head's input."""
    sbh = shape.seq * shape.micro_batch * shape.hidden
    divisor = shape.tp if shape.sequence_parallel else 1
    norm = sum(t.bytes for t in eager_norm_terms(shape, "final", shape.residual_bytes))
    # Under SP the output layer's input is all-gathered; Megatron saves the gathered copy.
    return (shape.residual_bytes * sbh + norm) // divisor + shape.act_bytes * sbh


#: torchtune ``CEWithChunkedOutputLoss`` default ``num_output_chunks``: the head runs per chunk of
#: tokens, the loss upcasts one chunk of logits to fp32 at a time.
CHUNKED_LOSS_CHUNKS = 8

#: What each non-default loss path keeps, for the assumptions.
LOSS_NOTES = {
    "chunked": (f"chunked loss (torchtune CEWithChunkedOutputLoss, {CHUNKED_LOSS_CHUNKS} chunks): the 16-bit logits of "
                "every chunk exist at the loss, each chunk is upcast to fp32 alone; log-softmax's fp32 outputs of all "
                "chunks are saved for the backward"),
    "fused-linear": ("fused linear cross-entropy (Liger-Kernel style): the hidden states go through the head in chunks "
                     "of next_pow2(tokens / ceil(vocab / hidden)) tokens, so only one chunk's logits (their gradient "
                     "computed in place) exist; the gradient of the head's input (replacing its saved input) and, when "
                     "the head trains, of its weight are made in the forward and kept for the backward; soft-capping "
                     "runs inside the kernel. Apple's cut-cross-entropy keeps less (it recomputes in the backward)"),
}
#: ``--packing``: what memplan assumes about packed rows.
PACKING_NOTE = ("sequence packing: every row holds seq tokens (rows always full); attention stays per document "
                "(flash-attention varlen), costing what one full row's attention costs; position_ids / cu_seqlens "
                "are negligible")


def logits_bytes(job: Job, loss: str, shape: ActivationShape, vocab_rows: int, softcap: bool = False) -> int:
    """Logits and cross-entropy buffers alive at the loss of one micro-batch on one TP rank.

    ``softcap``: the model soft-caps its logits (Gemma 2 ``cap * tanh(logits / cap)``), whose
    tanh output, in the compute dtype, is saved for the backward (see :func:`softcap_bytes`).
    """
    if loss == "fused-linear":
        return fused_linear_bytes(job, shape, vocab_rows)
    return _logits_bytes(loss, shape, vocab_rows) + softcap_bytes(shape, vocab_rows, softcap)


def fused_linear_chunk_tokens(tokens: int, vocab_local: int, hidden: int) -> int:
    """Tokens per chunk of a fused linear cross-entropy: Liger-Kernel's
    ``next_power_of_2(ceil(tokens / ceil(vocab / hidden)))`` (a chunk's logits about the size of the
    hidden states), at most ``tokens``."""
    per = -(-tokens // max(1, -(-vocab_local // hidden)))
    return min(tokens, 1 << max(0, per - 1).bit_length())


def head_trains(job: Job) -> bool:
    ft = job.finetune
    trained = ft.resolved_trainable
    if trained == "all":
        return True
    names = set(trained.split(",")) | set(filter(None, ft.modules_to_save.split(",")))
    return "lm_head" in names


def fused_linear_bytes(job: Job, shape: ActivationShape, vocab_rows: int) -> int:
    """``--loss fused-linear`` at the loss: one chunk's logits and the head weight's gradient (when it
    trains; in the weights' dtype: fp32 under ``*-mixed``)."""
    tokens = shape.seq * shape.micro_batch
    vocab_local = vocab_rows // (shape.vocab_tp or shape.tp)
    chunk = fused_linear_chunk_tokens(tokens, vocab_local, shape.hidden)
    weight_bytes = _FP32 if job.precision.name.endswith("-mixed") else shape.act_bytes
    head_grad = weight_bytes * vocab_local * shape.hidden if head_trains(job) else 0
    return shape.act_bytes * chunk * vocab_local + head_grad


def softcap_bytes(shape: ActivationShape, vocab_rows: int, softcap: bool) -> int:
    """Gemma 2's final logit soft-capping (transformers ``Gemma2ForCausalLM.forward``): ``tanh``
    saves its output, one compute-dtype tensor of the logits' size (the divisions by and
    multiplication with the constant cap save nothing)."""
    if not softcap:
        return 0
    return shape.act_bytes * shape.seq * shape.micro_batch * (vocab_rows // (shape.vocab_tp or shape.tp))


def saved_logits_bytes(job: Job, loss: str, shape: ActivationShape, vocab_rows: int, softcap: bool = False) -> int:
    """Logits-sized tensors still saved for the backward when it starts (what ``memplan trace``
    files as ``logits``). For ``fp32-logits`` that is log-softmax's fp32 output only: the 16-bit
    logits and their fp32 copy are freed with the model's output once the loss exists (the HF
    Trainer keeps only the loss). The other paths keep what they hold at the loss."""
    elements = shape.seq * shape.micro_batch * (vocab_rows // (shape.vocab_tp or shape.tp))
    if loss in ("fp32-logits", "chunked"):
        return _FP32 * elements + softcap_bytes(shape, vocab_rows, softcap)
    if loss == "fused-linear":
        # The chunk's logits are gone; the head weight's gradient made in the forward remains.
        tokens = shape.seq * shape.micro_batch
        vocab_local = vocab_rows // (shape.vocab_tp or shape.tp)
        chunk = fused_linear_chunk_tokens(tokens, vocab_local, shape.hidden)
        return fused_linear_bytes(job, shape, vocab_rows) - shape.act_bytes * chunk * vocab_local
    return logits_bytes(job, loss, shape, vocab_rows, softcap)


def _logits_bytes(loss: str, shape: ActivationShape, vocab_rows: int) -> int:
    tokens = shape.seq * shape.micro_batch
    vocab_local = vocab_rows // (shape.vocab_tp or shape.tp)
    elements = tokens * vocab_local
    c = shape.act_bytes
    upcast = _FP32 * elements if c < _FP32 else 0
    if loss == "vocab-parallel":
        # Logits in the compute dtype + their fp32 copy, which the in-place softmax reuses and
        # the backward keeps (Megatron tensor_parallel/cross_entropy.py).
        return c * elements + upcast
    if loss == "fp32-logits":
        # Forward: the logits, their .float() copy and log_softmax's fp32 output saved for
        # backward. The backward of log_softmax then holds that output, its incoming gradient and
        # the gradient it produces, all fp32 (the 16-bit logits are gone by then when the loop
        # keeps only the loss, as the HF Trainer does; checked with memplan trace).
        return max(c * elements + upcast + _FP32 * elements, 3 * _FP32 * elements)
    if loss == "fused":
        # Megatron's fused vocab-parallel cross-entropy (--cross-entropy-loss-fusion) upcasts the
        # logits and computes the fp32 gradient already in the forward, keeping it for backward:
        # logits + fp32 copy + fp32 gradient.
        return c * elements + upcast + _FP32 * elements
    # chunked (torchtune CEWithChunkedOutputLoss): the 16-bit logits of every chunk, the fp32
    # log-softmax outputs saved for the backward, and one chunk's fp32 upcast at a time.
    return c * elements + _FP32 * elements + _FP32 * -(-elements // CHUNKED_LOSS_CHUNKS)


def loss_forward_logits_bytes(job: Job, loss: str, shape: ActivationShape, vocab_rows: int,
                              softcap: bool = False) -> int:
    """Of :func:`logits_bytes`, what the loss's forward holds when the cross-entropy returns (before its
    backward): for ``fp32-logits`` the logits, their fp32 copy and the fp32 log-softmax, without the
    backward's three fp32 tensors; the other losses are priced at one moment."""
    if loss != "fp32-logits":
        return logits_bytes(job, loss, shape, vocab_rows, softcap)
    elements = shape.seq * shape.micro_batch * (vocab_rows // (shape.vocab_tp or shape.tp))
    c = shape.act_bytes
    upcast = _FP32 * elements if c < _FP32 else 0
    return c * elements + upcast + _FP32 * elements + softcap_bytes(shape, vocab_rows, softcap)


def deferred_wgrad_bytes(job: Job, shape: ActivationShape, vocab_rows: int) -> int:
    """Megatron --defer-embedding-wgrad-compute: logits gradient + head input kept per finished micro-batch."""
    if not job.defer_embedding_wgrad:
        return 0
    finished = job.num_microbatches - 1
    if job.wgrad_deferral_limit:
        finished = min(finished, job.wgrad_deferral_limit)
    tokens = shape.seq * shape.micro_batch
    per_microbatch = shape.act_bytes * tokens * (vocab_rows // (shape.vocab_tp or shape.tp) + shape.hidden)
    return max(0, finished) * per_microbatch


def input_bytes(shape: ActivationShape, full_batch: bool, cp: int = 1) -> int:
    """The batch on the GPU: token ids and labels (``full_batch``: Megatron's position ids, loss mask and s*s mask too).

    Under context parallelism Megatron keeps each rank's ``s / cp`` tokens of every tensor, but only
    the query rows of the mask: ``[b, 1, s / cp, s]`` (megatron/core/utils.py
    ``_get_batch_on_this_cp_rank_per_sequence_balancing`` slices the mask along dimension 2).
    """
    s, b = shape.seq, shape.micro_batch
    base = 2 * _INT64 * s * b
    if full_batch:
        base += _INT64 * s * b + _FP32 * s * b + b * s * shape.kv_seq * cp
    return base


def communication_bytes(
    job: Job,
    profile: FrameworkProfile,
    params: StageParams,
    states: StateBytes,
    prec: ResolvedPrecision,
) -> int:
    """Collective staging buffers one GPU keeps beside the model states (DeepSpeed's ZeRO buffers:
    :mod:`memplan.estimate.zero3_buffers`, :mod:`memplan.estimate.zero12_bucket`)."""
    total = 0
    dp = job.parallel.data_parallel * job.parallel.cp
    if profile.ddp_bucket_copy and dp > 1 and job.sharding.zero == 0 and job.sharding.fsdp == "none":
        total += states.gradients  # DDP's bucket copy of every gradient
    c = dtype_bytes(prec.compute)
    if job.sharding.fsdp != "none" or (job.sharding.zero == 3 and prec.weight_copies == "fsdp"):
        # Unsharded compute-dtype blocks (computing + prefetched; a block's peft adapters with it), the root
        # module, and one block's unsharded gradient (its trainable tensors') for its reduce-scatter, in the
        # reduce dtype.
        total += profile.fsdp_live_blocks * unsharded_block(params, c) + params.root * c
        total += (params.largest_layer if params.layer_trainable is None else params.layer_trainable) * prec.reduce_bytes
    elif job.sharding.zero == 3:
        # Not DeepSpeed's (memplan.estimate.zero3_buffers): DeepSpeed's own estimator's rule, 4 bytes per
        # parameter of the largest layer (16-bit gathered weights and gradients).
        total += 4 * max(params.largest_layer, params.root)
    return total


def unsharded_block(params: StageParams, compute_bytes: int) -> int:
    """Bytes of the largest block's unsharded copy: its weights in the compute dtype and its peft adapters."""
    return params.largest_layer * compute_bytes + params.layer_adapter_bytes


def communication_by_phase(job: Job, profile: FrameworkProfile, params: StageParams, prec: ResolvedPrecision,
                           held: int, *, tied: bool = False, head: int | None = None) -> dict[str, int]:
    """Collective buffers alive at each candidate peak, for PyTorch FSDP2; ``held`` everywhere else.

    FSDP2 (torch/distributed/fsdp/_fully_shard) keeps the root unit's unsharded parameters from
    its forward to the end of the backward and reshards each block after its forward and backward:
    at the loss, the root and the last block (prefetched for the backward) are unsharded; a
    block's backward adds the next block's prefetch; at the end of the backward the root's unsharded
    parameters and, for an untied head, the root's unsharded gradients (in the compute dtype, before the
    reduce-scatter casts them to the reduce dtype) — a tied embedding's gradients are the summed temporaries counted apart;
    the optimizer step holds none.

    ``head``: the numel of the final norm and head when they are a unit apart from the embedding
    (torchtitan, ``FrameworkProfile.fsdp_outer_units``). Then only that unit is unsharded at the loss
    (the last block is gathered again when the head's backward begins, after the loss's), neither is
    during the blocks' backward (the head unit reshards after its backward), and at the end of the
    backward the embedding's unit holds its unsharded parameters and gradients in the compute dtype.
    While a block's backward computes, the block and the prefetched next one are unsharded; its
    reduce-scatter input (the gradients in the reduce dtype) is made only after that, once FSDP2's
    post-backward has resharded the block and the backward's temporaries are freed (torch
    ``FSDPParamGroup.post_backward``, ``foreach_reduce``), so it is not priced beside them here. It is kept
    (``comm_ctx.reduce_scatter_states``, one buffer by default) until the next unit's post-backward, so a
    later block's backward holds the previous block's: that held input, with the block's unsharded gradients
    made so far, is priced per layer by :mod:`memplan.estimate.fsdp_block_backward`, not in this category's
    phases (``held``, the largest block's input, stays the category's bound outside FSDP2).
    """
    if job.sharding.fsdp == "none" or not profile.torch_optimizer:
        return {phase: held for phase in ("loss", "backward", "end of backward", "optimizer step")}
    c = dtype_bytes(prec.compute)
    if head is not None:
        embedding = params.root - head
        return {"loss": head * c, "backward": profile.fsdp_live_blocks * unsharded_block(params, c),
                "end of backward": 2 * embedding * c, "optimizer step": 0}
    root = params.root * c
    root_grads = 0 if tied else root
    return {"loss": root + unsharded_block(params, c),
            "backward": root + profile.fsdp_live_blocks * unsharded_block(params, c),
            "end of backward": root + root_grads, "optimizer step": 0}


def optimizer_temporary_bytes(job: Job, profile: FrameworkProfile, states: StateBytes, prec: ResolvedPrecision, largest_tensor: int) -> int:
    """Extra memory while ``optimizer.step()`` runs (:func:`memplan.estimate.optimizers.step_temporary_bytes`).

    States of several dtypes (``StateBytes.step_groups``) step group by group, each group's temporaries in
    its own dtype: a foreach step's add up (``_multi_tensor_adam`` still holds one group's ``sqrt(v)`` when
    it makes the next group's; exact for two dtypes), a per-tensor step's do not (the largest counts)."""
    if states.step_groups:
        each = [step_temporary_bytes(job, numel, largest_tensor, nbytes) for numel, nbytes in states.step_groups]
        foreach = resolved_optimizer_impl(job) == "foreach" and not job.optimizer.in_backward
        return max(sum(each) if foreach else max(each), states.optimizer_step)
    return max(step_temporary_bytes(job, states.optimizer_numel, largest_tensor,
                                    states.state_element_bytes or prec.state_bytes), states.optimizer_step)
