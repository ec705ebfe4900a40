"""A documented, analytical step-time model used to rank layouts that fit.

The model is deliberately simple and every constant is named here. For one optimizer step on the
slowest pipeline stage:

* **compute**: forward FLOPs of the stage's layers (matmuls at ``2·params`` per token, causal
  attention core at ``2·seq·heads·(d_qk + d_v)/2`` per token), backward = 2 × forward, plus the
  recomputed forward (full recompute: the whole forward of recomputed layers; selective: the
  attention core, or under torchtitan's per-op checkpointing the ``mm`` calls it drops), divided over ``tp·cp`` GPUs (balanced MoE routing gives every GPU of a stage
  the same share of expert work) and run at :data:`MATMUL_EFFICIENCY` /
  :data:`ATTENTION_EFFICIENCY` of the GPU's dense BF16 peak, plus a fixed
  :data:`LAYER_OVERHEAD_S` per layer and micro-batch (kernel launches and tails);
* **tensor parallel**: 4 all-reduce-sized collectives per layer and micro-batch (2 forward,
  2 backward; all-gather + reduce-scatter under sequence parallelism moves the same bytes), 2 more
  when the layer's forward is recomputed; not overlapped;
* **context parallel**: the ring exchange of K and V (forward) and of K, V and their gradients
  (backward); hidden behind the attention core when shorter than it;
* **expert parallel**: 4 all-to-alls per MoE layer and micro-batch (dispatch and combine, forward
  and backward) of ``tokens·top_k·hidden`` 16-bit values, the off-node share through each GPU's
  NIC; not overlapped;
* **pipeline**: point-to-point sends of the hidden state, and the bubble of 1F1B,
  ``(pp − 1)/vpp`` micro-batch slots (Narayanan et al. 2021, §2.2);
* **data parallel**: one gradient reduction per step (reduce-scatter + parameter all-gather under a
  distributed optimizer or ZeRO, all-reduce otherwise: the same bytes), hidden behind the last
  micro-batch's backward; ZeRO-3/FSDP also all-gathers 16-bit weights for every forward and
  backward, hidden behind compute when shorter than it;
* **optimizer**: a memory-bound pass over this GPU's shard of the optimizer state.
* **fine-tuning** (``job.finetune``): frozen weights need no weight gradient, so with frozen base
  weights the matmuls' backward is one forward's worth (gradient of the input only) instead of two;
  adapters' FLOPs and optimizer step are neglected (LoRA adds well under 1% of the weights); a
  quantized base (bitsandbytes) dequantizes every quantized weight to 16 bits in each forward, each
  backward and each recompute: a memory-bound pass of :attr:`~memplan.tuning.QuantFormat.dequant_bytes_per_weight` per weight
  at HBM speed, per micro-batch (``dequant_s``; part of ``compute_s``'s total, reported apart).

Collectives run at :data:`COMM_EFFICIENCY` of the link: NVLink when the group stays within one node;
across nodes, a rail-optimised network with one NIC per GPU, where NCCL runs one ring per NIC so
a group with k members per node gets ``min(NVLink, k x NIC)``. Known limitations: no overlap of TP/EP
communication with compute (Megatron's ``--tp-comm-overlap``, DualPipe), no zero-bubble or DualPipe
schedules, no FP8 compute, balanced MoE routing, no straggler or failure time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memplan.estimate.sac import recomputed_linear_fraction
from memplan.fit.hardware import Hardware
from memplan.job import Job
from memplan.model.params import attention_params, mlp_params
from memplan.model.spec import LayerSpec, ModelSpec
from memplan.policies import ActivationPolicy, resolve_policy

#: Fraction of the dense BF16 peak that large transformer GEMMs reach (cuBLAS/cuBLASLt on
#: A100/H100 sustain about 70-80% of peak on the GEMM shapes of billion-parameter layers).
MATMUL_EFFICIENCY = 0.75
#: Fraction of peak that FlashAttention-2/3 kernels reach over forward and backward together
#: (their papers report 50-73% forward, lower backward).
ATTENTION_EFFICIENCY = 0.5
#: Fraction of the link bandwidth that NCCL collectives reach on large messages (bus bandwidth).
COMM_EFFICIENCY = 0.8
#: Fixed cost per decoder layer and micro-batch, forward + backward: about 30 kernels at ~4 us
#: of launch latency and tail each. Dominates only for small layers.
LAYER_OVERHEAD_S = 120e-6
#: Bytes per element of gradient reductions (fp32: Megatron's main-grad buffer, FSDP2's
#: ``reduce_dtype`` in torchtitan).
GRAD_REDUCE_BYTES = 4
#: Bytes per element of 16-bit activations, weights all-gathered, tokens dispatched.
HALF_BYTES = 2
#: Bytes the optimizer step reads and writes per parameter of its shard (fp32 master, two fp32
#: moments read and written, fp32 gradient read, 16-bit weight written): 8 + 16 + 4 + 2.
OPTIMIZER_BYTES_PER_PARAM = 30


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted seconds of one optimizer step, by cause (all on the slowest pipeline stage)."""

    compute_s: float
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float
    optimizer_s: float
    total_s: float
    tokens_per_s: float
    #: Model FLOPs utilisation: the FLOPs the job needs per token (6·active params, 4· when the weights are
    #: frozen: no weight gradients; + causal attention), without recompute, over the GPUs' dense peak.
    mfu: float
    #: Dequantizing a bitsandbytes-quantized base (part of ``total_s``; 0 without one).
    dequant_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _layer_matmul_params(layer: LayerSpec, hidden: int) -> int:
    """Weights one token multiplies through in this layer (routed experts: top_k of them)."""
    count = attention_params(layer.attention, hidden).total
    if layer.moe is None:
        assert layer.mlp is not None
        return count + mlp_params(layer.mlp, hidden).total
    moe = layer.moe
    count += hidden * moe.num_experts + moe.top_k * mlp_params(moe.expert, hidden).total
    if moe.shared_expert is not None:
        count += mlp_params(moe.shared_expert, hidden).total
    return count


@dataclass(frozen=True)
class _Facts:
    """Per-layer numbers the step-time model needs, computed once per ModelSpec."""

    #: 2 x matmul weights per token (forward FLOPs per token of the projections).
    matmul2: tuple[float, ...]
    #: heads x (d_qk + d_v): the attention core's FLOPs per token are ``coeff x window``.
    attn_coeff: tuple[float, ...]
    #: Sliding window of each layer (None: global attention).
    window: tuple[int | None, ...]
    #: KV heads x (d_qk + d_v): bytes of K and V per token, in elements.
    kv_dim: tuple[float, ...]
    #: Experts per token of MoE layers (0 for dense layers).
    top_k: tuple[int, ...]
    #: Parameters by how TP/EP divide them: (tp-sharded, replicated, expert), all layers.
    params: tuple[float, float, float]


_FACTS: dict[int, tuple[ModelSpec, _Facts]] = {}


def _facts(model: ModelSpec) -> _Facts:
    cached = _FACTS.get(id(model))
    if cached is not None and cached[0] is model:
        return cached[1]
    hidden = model.hidden_size
    layers = model.layers
    groups = model.layer_param_groups
    facts = _Facts(
        matmul2=tuple(2.0 * _layer_matmul_params(layer, hidden) for layer in layers),
        attn_coeff=tuple(float(layer.attention.num_heads * (layer.attention.head_dim + layer.attention.v_head_dim))
                         for layer in layers),
        window=tuple(layer.attention.sliding_window for layer in layers),
        kv_dim=tuple(float(layer.attention.num_kv_heads * (layer.attention.head_dim + layer.attention.v_head_dim))
                     for layer in layers),
        top_k=tuple(layer.moe.top_k if layer.moe is not None else 0 for layer in layers),
        params=(float(sum(g.tp_sharded for g in groups)), float(sum(g.replicated for g in groups)),
                float(sum(g.expert for g in groups))),
    )
    if len(_FACTS) > 64:
        _FACTS.clear()
    _FACTS[id(model)] = (model, facts)
    return facts


def _attention_flops(facts: _Facts, index: int, seq: int) -> float:
    """Forward attention-core FLOPs per token of layer ``index`` (causal: half the window)."""
    window = facts.window[index]
    span = min(seq, window) if window else seq
    return facts.attn_coeff[index] * span


def model_flops_per_token(model: ModelSpec, seq: int, *, frozen_weights: bool = False) -> float:
    """Training FLOPs per token without recompute: 3 × (2·matmul params + attention core); with frozen
    weights the matmuls' backward makes no weight gradient, so they count 2 passes (the attention core,
    which has no weights, still 3)."""
    facts = _facts(model)
    matmul = 2.0 * model.hidden_size * model.vocab_size + sum(facts.matmul2)
    attention = sum(_attention_flops(facts, i, seq) for i in range(model.num_layers))
    return _weight_passes(frozen_weights) * matmul + 3.0 * attention


def _weight_passes(frozen_weights: bool) -> float:
    """Passes over a matmul's FLOPs in one training step: forward, the input's gradient and (unless its
    weight is frozen) the weight's gradient."""
    return 2.0 if frozen_weights else 3.0


def _stage_layer_counts(model: ModelSpec, job: Job) -> tuple[int, ...]:
    from memplan.estimate.layout import stage_layer_counts
    from memplan.profiles import get_profile

    return stage_layer_counts(model.num_layers, job.parallel, get_profile(job.framework).pipeline_split)


def _per_op_recompute_s(model: ModelSpec, idx: range, matmul2: tuple[float, ...], per_flop_s: float,
                        attn_each: list[float]) -> float:
    """torchtitan's per-op selective checkpointing: each layer's backward recomputes its dropped
    ``mm`` calls (:func:`memplan.estimate.sac.recomputed_linear_fraction`), not its attention; a
    layer not listed op by op (MoE, MLA) recomputes its attention core as Megatron's selective does."""
    total = 0.0
    for i, attn in zip(idx, attn_each, strict=True):
        fraction = recomputed_linear_fraction(model.layers[i], model.hidden_size)
        total += attn if fraction is None else fraction * matmul2[i] * per_flop_s
    return total


def _recompute_fraction(job: Job, layers_on_stage: int, policy: ActivationPolicy | None = None) -> float:
    """Fraction of the stage's layers whose whole forward runs again in the backward (``policy``: the job's
    resolved policy, when the caller has it)."""
    rc = job.recompute
    if not (policy or resolve_policy(job)).kind.checkpoints_layers:
        return 0.0
    if rc.method == "block" and rc.num_layers is not None and layers_on_stage:
        chunk_layers = max(1, layers_on_stage // job.parallel.vpp)
        return min(1.0, rc.num_layers / chunk_layers)
    return 1.0


def _bandwidth(hw: Hardware, group: int, stride: int, gpus_per_node: int) -> float:
    """Bus bandwidth of a ring collective over ``group`` ranks that are ``stride`` ranks apart.

    Within a node: NVLink. Across nodes on a rail-optimised network (one NIC per GPU), NCCL runs
    one ring per NIC, so the group's members in a node share their NICs:
    ``min(NVLink, NIC x members per node)``.
    """
    if group * stride <= gpus_per_node:
        link = hw.intra_node_bytes_per_s
    else:
        members = max(1, gpus_per_node // stride) if stride < gpus_per_node else 1
        link = min(hw.intra_node_bytes_per_s, hw.inter_node_bytes_per_s * min(members, group))
    return link * COMM_EFFICIENCY


def _all_to_all_seconds(hw: Hardware, sent_bytes: float, group: int, stride: int, gpus_per_node: int) -> float:
    """An all-to-all where each rank sends ``sent_bytes`` to the others: the off-node share goes
    through the rank's own NIC, the on-node share over NVLink, at the same time."""
    local = max(1, min(group, gpus_per_node // max(1, stride)))
    off_node = sent_bytes * (group - local) / max(1, group - 1)
    on_node = sent_bytes - off_node
    return max(off_node / hw.inter_node_bytes_per_s, on_node / hw.intra_node_bytes_per_s) / COMM_EFFICIENCY


def step_time(model: ModelSpec, job: Job, hw: Hardware, *, gpus_per_node: int = 8) -> StepTime:
    """Predicted time of one optimizer step of ``job`` (see the module docstring for the model).

    Example::

        >>> from memplan import load_model, Job, Parallelism
        >>> from memplan.fit import HARDWARE
        >>> t = step_time(load_model("llama-3.1-8b"), Job(parallel=Parallelism(world_size=8)),
        ...               HARDWARE["h100-80gb"])
        >>> 0.0 < t.mfu < 1.0
        True
    """
    par, b = job.parallel, job.batch
    tp, cp, pp, vpp, dp, ep = par.tp, par.cp, par.pp, par.vpp, par.data_parallel, par.ep
    seq, mbs = b.seq_length, b.micro_batch_size
    micro = job.num_microbatches
    tokens_mb = mbs * seq  # tokens of one micro-batch through one model replica
    tokens_rank = tokens_mb / cp  # tokens one CP rank holds
    hidden = model.hidden_size
    matmul_rate = hw.peak_flops * MATMUL_EFFICIENCY
    attn_rate = hw.peak_flops * ATTENTION_EFFICIENCY
    gpn = gpus_per_node
    tp_bw = _bandwidth(hw, tp, 1, gpn)
    cp_bw = _bandwidth(hw, cp, tp, gpn)
    pp_bw = _bandwidth(hw, 2, tp * cp * dp, gpn)  # point-to-point: each rank's own link
    dp_bw = _bandwidth(hw, dp * cp, tp, gpn)

    facts = _facts(model)
    counts = _stage_layer_counts(model, job)
    policy = resolve_policy(job)  # once: a job hashes all its settings on each memoised look-up
    worst: tuple[float, ...] | None = None
    start = 0
    share = tokens_mb / (tp * cp)  # tokens whose work one GPU of a stage does
    for stage, n_layers in enumerate(counts):
        idx = range(start, start + n_layers)
        start += n_layers
        rc_frac = _recompute_fraction(job, n_layers, policy)
        attn_each = [_attention_flops(facts, i, seq) * share / attn_rate for i in idx]
        matmul = sum(facts.matmul2[i] for i in idx) * share
        if stage == pp - 1:
            matmul += 2.0 * hidden * model.vocab_size * share
        attn = sum(attn_each)
        # Frozen weights: the backward computes the input's gradient only (one forward's FLOPs).
        passes = _weight_passes(job.finetune.has_frozen)
        compute = passes * matmul / matmul_rate + 3.0 * attn + LAYER_OVERHEAD_S * n_layers
        if policy.kind.per_op:
            recompute = _per_op_recompute_s(model, idx, facts.matmul2, share / matmul_rate, attn_each)
        elif policy.kind.budget:
            # the partitioner recomputes what it does not keep: at most (1 - budget) of the layer (a bound)
            recompute = (1.0 - (policy.memory_budget or 0.0)) * (matmul / matmul_rate + attn)
        elif policy.partial:
            recompute = attn
        else:
            recompute = rc_frac * (matmul / matmul_rate + attn)
        act_bytes = tokens_rank * hidden * HALF_BYTES
        tp_coll = (4 + 2 * rc_frac) * 2 * (tp - 1) / tp * act_bytes / tp_bw if tp > 1 else 0.0
        tp_comm = tp_coll * n_layers
        cp_comm = 0.0
        if cp > 1:
            ring_each = 3 * (cp - 1) * tokens_rank * HALF_BYTES / tp / cp_bw
            cp_comm = sum(max(0.0, ring_each * facts.kv_dim[i] - 3.0 * a) for i, a in zip(idx, attn_each))
        ep_comm = 0.0
        if ep > 1:
            experts = sum(facts.top_k[i] for i in idx)
            sent = tokens_rank / tp * hidden * HALF_BYTES * (ep - 1) / ep
            ep_comm = (4 + 2 * rc_frac) * experts * _all_to_all_seconds(hw, sent, ep, par.expert_tp, gpn)
        pp_comm = (2 * vpp * act_bytes / tp / pp_bw) if pp > 1 else 0.0
        dequant = _dequant_seconds(job, hw, sum(facts.matmul2[i] for i in idx) / 2.0 / tp, rc_frac)
        per_mb = compute + recompute + tp_comm + cp_comm + ep_comm + pp_comm + dequant
        parts = (per_mb, compute, recompute, tp_comm, cp_comm, ep_comm, pp_comm, dequant)
        if worst is None or parts[0] > worst[0]:
            worst = parts
    assert worst is not None
    per_mb, compute, recompute, tp_comm, cp_comm, ep_comm, pp_comm, dequant = worst
    bubble = per_mb * (pp - 1) / vpp if pp > 1 else 0.0
    dp_comm, optimizer = _dp_and_optimizer(model, job, hw, dp_bw, per_mb, compute, micro)
    total = per_mb * micro + bubble + dp_comm + optimizer
    tokens_step = (b.global_batch_size or mbs * dp) * seq
    tokens_per_s = tokens_step / total
    needed = model_flops_per_token(model, seq, frozen_weights=job.finetune.has_frozen)
    mfu = needed * tokens_per_s / (hw.peak_flops * par.world_size)
    return StepTime(
        compute_s=compute * micro, recompute_s=recompute * micro, tp_comm_s=tp_comm * micro,
        cp_comm_s=cp_comm * micro, ep_comm_s=ep_comm * micro, pp_comm_s=pp_comm * micro,
        bubble_s=bubble, dp_comm_s=dp_comm, optimizer_s=optimizer, total_s=total,
        tokens_per_s=tokens_per_s, mfu=mfu, dequant_s=dequant * micro,
    )


def _dequant_seconds(job: Job, hw: Hardware, weights: float, recompute_fraction: float) -> float:
    """One micro-batch's dequantization of the quantized base on one GPU: forward, backward and the
    recompute each dequantize every quantized weight (``weights``: the stage's decoder linears)."""
    quant = job.finetune.quant_kind
    if not quant.quantizes:
        return 0.0
    passes = 2.0 + recompute_fraction
    return passes * weights * quant.dequant_bytes_per_weight / hw.hbm_bytes_per_s


def _local_params(model: ModelSpec, job: Job) -> tuple[float, float]:
    """(dense, expert) parameters one GPU holds before data-parallel sharding (stage average)."""
    par = job.parallel
    sharded, replicated, expert = _facts(model).params
    embed = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2) / par.tp
    return (sharded / par.tp + replicated + embed) / par.pp, expert / (par.ep * par.expert_tp) / par.pp


def _dp_and_optimizer(
    model: ModelSpec, job: Job, hw: Hardware, bw: float, per_mb: float, compute: float, micro: int
) -> tuple[float, float]:
    """Exposed data-parallel communication and the optimizer step, seconds."""
    par, sh = job.parallel, job.sharding
    dense, expert = _local_params(model, job)
    dp = par.data_parallel * par.cp  # gradients are reduced over DP x CP in Megatron
    edp = par.expert_dp
    sharded = sh.distributed_optimizer or sh.zero >= 1 or sh.fsdp != "none"
    comm = 0.0
    for count, group in ((dense, dp), (expert, edp)):
        if group <= 1:
            continue
        frac = (group - 1) / group
        grads = count * GRAD_REDUCE_BYTES * frac
        params = count * HALF_BYTES * frac
        comm += (grads + params if sharded else 2 * grads) / bw
    if job.finetune.has_frozen:
        comm = 0.0  # only the adapters' gradients are reduced: neglected
    exposed = max(0.0, comm - 2.0 / 3.0 * compute)  # hidden behind the last backward
    if sh.zero == 3 or sh.fsdp != "none":
        gather = 2 * (dense + expert) * HALF_BYTES * (max(dp, 2) - 1) / max(dp, 2) / bw
        exposed += micro * max(0.0, gather - per_mb)
    shard = (dense / dp if sharded else dense) + (expert / edp if sharded else expert)
    if job.finetune.has_frozen:
        return exposed, 0.0  # the adapters' step is neglected (module docstring)
    optimizer = shard * OPTIMIZER_BYTES_PER_PARAM / hw.hbm_bytes_per_s
    return exposed, optimizer
