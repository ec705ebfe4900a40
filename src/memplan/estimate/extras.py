"""Terms outside the decoder layers: embedding, head and loss, inputs, framework buffers, temporaries."""

from __future__ import annotations

from memplan.estimate.activations import DROPOUT_MASK_BYTES, ActivationShape, eager_norm_terms
from memplan.estimate.precision import ResolvedPrecision
from memplan.estimate.states import StageParams, StateBytes
from memplan.frameworks.profiles import FrameworkProfile, resolved_optimizer_impl
from memplan.job import Job
from memplan.model.spec import ModelSpec
from memplan.units import dtype_bytes

#: Megatron's data iterator puts int64 tokens, labels and position ids, an fp32 loss mask and a
#: bool [b, 1, s, s] attention mask on the first and last stages (megatron/training/utils.py
#: get_batch_on_this_tp_rank).
_INT64 = 8
_FP32 = 4


def embedding_activation_bytes(shape: ActivationShape) -> int:
    """Saved by the embedding stage per micro-batch: the embedding-dropout mask."""
    if not shape.dropout:
        return 0
    sbh = shape.seq * shape.micro_batch * shape.hidden
    return DROPOUT_MASK_BYTES * sbh // (shape.tp if shape.sequence_parallel else 1)


def rope_table_bytes(model: ModelSpec, shape: ActivationShape) -> int:
    """RoPE's cos and sin tables, saved by every layer's ``q * cos`` / ``k * sin`` (shared, once).

    transformers' rotary embedding returns them as ``(1, seq, rotary_dim)`` in the hidden states'
    dtype (the residual dtype: fp32 under autocast); ``position_ids`` has batch 1 when not given.
    """
    if model.position_embedding != "rope" or shape.kernels != "eager":
        return 0
    attn = model.layers[0].attention
    if attn.kind == "mla":
        return 0
    rotary_dim = int(attn.head_dim * attn.rotary_fraction)
    return 2 * shape.seq * rotary_dim * shape.residual_bytes


def checkpointed_mask_bytes(model: ModelSpec, shape: ActivationShape, mode: str) -> int:
    """4-D attention masks kept as checkpoint inputs.

    Eager attention gets an explicit ``(batch, 1, seq, seq)`` additive mask in the hidden states'
    dtype, one per kind of layer (global; sliding-window) built once per forward. Adding it to the
    scores saves nothing, but a checkpointed decoder layer or attention module keeps its inputs,
    the mask among them, until its backward (``torch.utils.checkpoint``).
    """
    if shape.attention != "eager" or shape.kernels != "eager" or mode not in ("full", "selective-attention-module"):
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


def logits_bytes(job: Job, loss: str, shape: ActivationShape, vocab_rows: int, softcap: bool = False) -> int:
    """Logits and cross-entropy buffers alive at the loss of one micro-batch on one TP rank.

    ``softcap``: the model soft-caps its logits (Gemma 2 ``cap * tanh(logits / cap)``), whose
    tanh output, in the compute dtype, is saved for the backward (see :func:`softcap_bytes`).
    """
    return _logits_bytes(loss, shape, vocab_rows) + softcap_bytes(shape, vocab_rows, softcap)


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
    if loss == "fp32-logits":
        elements = shape.seq * shape.micro_batch * (vocab_rows // (shape.vocab_tp or shape.tp))
        return _FP32 * elements + softcap_bytes(shape, vocab_rows, softcap)
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
    # chunked: the logits of one chunk of about vocab/hidden tokens at a time, fp32 gradient
    # accumulators for the head weight.
    chunk_tokens = max(1, min(tokens, tokens * shape.hidden // max(vocab_local, 1)))
    return (c + _FP32 * 2) * chunk_tokens * vocab_local + _FP32 * vocab_local * shape.hidden


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


def input_bytes(shape: ActivationShape, framework: str) -> int:
    """The batch on the GPU: token ids and labels (Megatron adds a loss mask and an s*s mask)."""
    s, b = shape.seq, shape.micro_batch
    base = 2 * _INT64 * s * b
    if framework == "megatron":
        base += _INT64 * s * b + _FP32 * s * b + b * s * shape.kv_seq
    return base


def communication_bytes(
    job: Job,
    profile: FrameworkProfile,
    params: StageParams,
    states: StateBytes,
    prec: ResolvedPrecision,
) -> int:
    """Collective staging buffers one GPU keeps beside the model states."""
    total = 0
    dp = job.parallel.data_parallel * job.parallel.cp
    if profile.ddp_bucket_copy and dp > 1 and job.sharding.zero == 0 and job.sharding.fsdp == "none":
        total += states.gradients  # DDP's bucket copy of every gradient
    c = dtype_bytes(prec.compute)
    if job.sharding.fsdp != "none" or (job.sharding.zero == 3 and prec.weight_copies == "fsdp"):
        # Unsharded compute-dtype blocks (computing + prefetched), the root module, and one
        # block's unsharded gradient for its reduce-scatter.
        total += profile.fsdp_live_blocks * params.largest_layer * c + params.root * c
        total += params.largest_layer * prec.grad_bytes
    elif job.sharding.zero == 3:
        # DeepSpeed's own estimator: 4 bytes per parameter of the largest layer (16-bit
        # gathered weights and gradients).
        total += 4 * max(params.largest_layer, params.root)
    elif job.sharding.zero in (1, 2) and profile.reduce_bucket_elements:
        total += min(profile.reduce_bucket_elements, params.total) * prec.grad_bytes
    return total


def communication_by_phase(job: Job, profile: FrameworkProfile, params: StageParams, prec: ResolvedPrecision,
                           held: int, *, tied: bool = False) -> dict[str, int]:
    """Collective buffers alive at each candidate peak, for PyTorch FSDP2; ``held`` everywhere else.

    FSDP2 (torch/distributed/fsdp/_fully_shard) keeps the root unit's unsharded parameters from
    its forward to the end of the backward and reshards each block after its forward and backward:
    at the loss, the root and the last block (prefetched for the backward) are unsharded; a
    block's backward adds the next block's prefetch and the block's unsharded gradients for the
    reduce-scatter (``held``); at the end of the backward the root's unsharded parameters and, for
    an untied head, the root's unsharded gradients (in the compute dtype, before the reduce-scatter
    casts them to fp32) — a tied embedding's gradients are the summed temporaries counted apart;
    the optimizer step holds none.
    """
    if job.sharding.fsdp == "none" or not profile.torch_optimizer:
        return {phase: held for phase in ("loss", "backward", "end of backward", "optimizer step")}
    c = dtype_bytes(prec.compute)
    root = params.root * c
    root_grads = 0 if tied else root
    return {"loss": root + params.largest_layer * c, "backward": held,
            "end of backward": root + root_grads, "optimizer step": 0}


def optimizer_temporary_bytes(job: Job, profile: FrameworkProfile, states: StateBytes, prec: ResolvedPrecision, largest_tensor: int) -> int:
    """Extra memory while ``optimizer.step()`` runs.

    PyTorch's foreach Adam (its default on CUDA) computes ``sqrt(v)`` for the whole parameter group
    at once (torch/optim/adam.py ``_multi_tensor_adam``): one state-sized temporary. Fused kernels
    (``fused=True``, apex/TE FusedAdam, DeepSpeed FusedAdam) work in place. A for-loop step needs
    one temporary of the largest tensor.
    """
    impl = resolved_optimizer_impl(job)
    if job.optimizer.name in ("sgd", "adafactor", "adam8bit"):
        impl = "for-loop" if impl != "fused" else impl
    if impl == "fused":
        return 0
    if impl == "foreach":
        return states.optimizer_numel * prec.state_bytes
    return largest_tensor * prec.state_bytes
