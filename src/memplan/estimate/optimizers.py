"""Optimizer states and step temporaries, priced by the job's registry entry (:mod:`memplan.optimizers`).

Every optimizer keeps state only for the parameters it steps (the trainable ones): callers pass the
numel the optimizer steps, and the elements of its *small* tensors, which bitsandbytes treats apart
(:class:`SmallTensors`, computed here from the model). What each optimizer keeps, and the
bitsandbytes thresholds, are documented with its entry (:mod:`memplan.optimizers.bnb` and the others);
this module asks the entry and prices Muon's Newton-Schulz step from the layer shapes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

from memplan.job import resolved_optimizer_impl
from memplan.model.attention_kinds import attention_kind
from memplan.model.linears import layer_linears
from memplan.model.params import position_embedding_params
from memplan.optimizers import optimizer_kind
from memplan.optimizers.bnb import BNB_BLOCK, MIN_8BIT_NUMEL, PAGED_MIN_NUMEL
from memplan.optimizers.kind import OptimizerStates, SmallTensors, StateQuery, StepQuery, WeightMatrix
from memplan.optimizers.muon import muon_matrix_bytes

if TYPE_CHECKING:
    from memplan.job import Job
    from memplan.model.param_groups import TpMatrix
    from memplan.model.spec import LayerSpec, MLPSpec, ModelSpec

__all__ = [
    "ADAM8BIT_BLOCK",
    "BNB_BLOCK",
    "MIN_8BIT_NUMEL",
    "PAGED_MIN_NUMEL",
    "OptimizerStates",
    "SmallTensors",
    "describe_optimizer",
    "in_backward_gradient_bytes",
    "muon_matrices",
    "muon_scalar_numel",
    "muon_step_bytes",
    "muon_weight_matrices",
    "needs_small_tensors",
    "optimizer_state_bytes",
    "optimizer_states",
    "small_tensors",
    "small_tensors_of_sizes",
    "step_temporary_bytes",
]

ADAM8BIT_BLOCK = BNB_BLOCK
_FP32 = 4


def needs_small_tensors(job: Job) -> bool:
    """Whether the job's optimizer prices small tensors apart (bitsandbytes, Adafactor)."""
    return optimizer_kind(job.optimizer.name).small_tensors


@lru_cache(maxsize=4096)
def _vector_sizes(layer: LayerSpec, hidden: int, norm_bias: bool) -> tuple[int, ...]:
    """Element counts of one layer's 1-D parameters (norms, biases) and its routers (small matrices)."""
    attn = layer.attention
    sizes = [hidden] * (layer.num_hidden_norms * (2 if norm_bias else 1))
    if attn.qk_norm:
        sizes += list(attn.qk_norm_widths)
    sizes += attention_kind(attn).qkv_bias_sizes(attn)
    if attn.out_bias:
        sizes.append(hidden)
    mlp = layer.mlp if layer.mlp is not None else None
    if mlp is not None and mlp.bias:
        sizes += [mlp.intermediate_size] * (2 if mlp.gated else 1) + [hidden]
    return tuple(sizes)


def small_tensors(model: ModelSpec, layer_indices: tuple[int, ...], *, has_head: bool) -> SmallTensors:
    """The :class:`SmallTensors` of a stage's parameters (all trainable: full training).

    Counts the norms, qk-norms and attention/MLP biases of its layers (and the final norm on the
    last stage), plus each MoE router's weight, on their unsharded sizes. Expert biases are left out.
    Lists the layers' linear modules (:func:`memplan.model.linears.layer_linears`) for GaLore.
    """
    hidden = model.hidden_size
    vectors: list[int] = [hidden] * (2 if model.norm_bias else 1) if has_head else []
    routers: list[int] = []
    for index in layer_indices:
        layer = model.layers[index]
        vectors += _vector_sizes(layer, hidden, model.norm_bias)
        if layer.moe is not None:
            routers.append(hidden * layer.moe.num_experts)
    sizes = vectors + routers
    linears = tuple(m for index in layer_indices for m in layer_linears(model.layers[index], hidden, model.model_type))
    return SmallTensors(below_8bit=sum(s for s in sizes if s < MIN_8BIT_NUMEL),
                        below_paged=sum(s for s in sizes if s < PAGED_MIN_NUMEL), vectors=sum(vectors),
                        linears=linears, head=hidden * model.vocab_size if has_head and not model.tie_word_embeddings else 0)


def small_tensors_of_sizes(sizes: Iterable[int], *, vectors: int = 0) -> SmallTensors:
    """The :class:`SmallTensors` of stepped tensors given by their element counts — for a trainable set
    that is not the whole stage (e.g. LoRA adapters: ``r x in`` and ``out x r``, each often under the
    paging threshold). ``vectors``: the elements of its 1-D tensors."""
    listed = tuple(sizes)
    return SmallTensors(below_8bit=sum(n for n in listed if n < MIN_8BIT_NUMEL),
                        below_paged=sum(n for n in listed if n < PAGED_MIN_NUMEL), vectors=vectors)


def optimizer_states(numel: int, job: Job, state_bytes: int, hidden: int,
                     small: SmallTensors | None = None, *, muon_scalar: int = 0,
                     matrices: tuple[WeightMatrix, ...] = ()) -> OptimizerStates:
    """States kept by the job's optimizer for the ``numel`` parameters it steps (its entry's ``states``).

    ``state_bytes``: element size of torch optimizers' states (the precision's); bitsandbytes keeps
    fp32 (or 8-bit) states whatever the parameters' dtype. ``small``: of ``numel``, the elements of
    tensors below bitsandbytes' thresholds (zero: every tensor is large). ``muon_scalar``: with Muon,
    the elements its scalar optimizer (Adam) steps; ``matrices``: the 2-D weights it steps one at a time.
    """
    query = StateQuery(numel, state_bytes, hidden, small or SmallTensors(), job.optimizer, muon_scalar, matrices)
    return optimizer_kind(job.optimizer.name).states(query)


def optimizer_state_bytes(numel: int, job: Job, state_bytes: int, hidden: int,
                          small: SmallTensors | None = None) -> int:
    """Optimizer-state bytes in PyTorch's caching allocator (paged states excluded)."""
    return optimizer_states(numel, job, state_bytes, hidden, small).device_bytes


def step_temporary_bytes(job: Job, stepped_numel: int, largest_tensor: int, state_bytes: int) -> int:
    """Extra memory while the optimizer steps ``stepped_numel`` elements whose largest tensor has
    ``largest_tensor`` elements (its entry's ``step_temporaries``).

    PyTorch's foreach Adam (its default on CUDA) computes ``sqrt(v)`` for the whole parameter group
    at once (torch/optim/adam.py ``_multi_tensor_adam``): one state-sized temporary. Fused kernels
    (``fused=True``, apex/TE FusedAdam, DeepSpeed FusedAdam) and bitsandbytes' kernels (8-bit, paged,
    Lion) work in place. A for-loop step (and SGD and Adafactor, which have no fused kernel) needs
    one temporary of the largest tensor. With ``--optimizer-in-backward`` each parameter steps alone
    (a foreach step over one tensor): at most one temporary of the largest tensor.
    """
    query = StepQuery(resolved_optimizer_impl(job), stepped_numel, largest_tensor, state_bytes,
                      job.optimizer.in_backward)
    return optimizer_kind(job.optimizer.name).step_temporaries(query)


#: One 2-D weight Muon orthogonalizes (the registry's :class:`~memplan.optimizers.kind.WeightMatrix`).
MuonMatrix = WeightMatrix


def _muon_matrix(m: TpMatrix, tp: int) -> MuonMatrix:
    """What Muon orthogonalizes of an attention weight: the whole weight, or of a fused one (QKV,
    split by ``--muon-split-qkv``) its largest part."""
    rows = m.parts[0] if m.parts else m.rows
    return MuonMatrix(rows, m.cols, tp if m.partition_dim is not None else 1, m.partition_dim)


def muon_matrices(layer: LayerSpec, hidden: int, tp: int, expert_tp: int) -> tuple[MuonMatrix, ...]:
    """The 2-D weights of one decoder layer as Megatron's Muon orthogonalizes them.

    With ``--muon-split-qkv`` (Megatron's default) the fused QKV gradient is split into its query,
    key and value parts, each orthogonalized alone; the query part (listed first) is the largest.
    The attention's weights are its kind's (:attr:`~memplan.model.attention_kinds.AttentionKind.matrices`;
    MLA has no fused QKV and lists its down and up projections). Column-parallel
    weights (QKV, fc1) are split on rows, row-parallel ones (proj, fc2) on columns; the MoE router is
    replicated. Routed experts are one matrix each (Transformer Engine grouped linear).
    """
    attn = layer.attention
    out = [_muon_matrix(m, tp) for m in attention_kind(attn).matrices(attn, hidden)]

    def mlp(spec: MLPSpec, size: int) -> list[MuonMatrix]:
        up = spec.intermediate_size * (2 if spec.gated else 1)
        return [MuonMatrix(up, hidden, size, 0), MuonMatrix(hidden, spec.intermediate_size, size, 1)]

    if layer.mlp is not None:
        out += mlp(layer.mlp, tp)
    if layer.moe is not None:
        out += mlp(layer.moe.expert, expert_tp)
        out.append(MuonMatrix(layer.moe.num_experts, hidden))
        if layer.moe.shared_expert is not None:
            out += mlp(layer.moe.shared_expert, tp)
    return tuple(out)


def _layer_vectors_on_rank(layer: LayerSpec, hidden: int, norm_bias: bool, tp: int) -> int:
    """Elements of one layer's 1-D tensors on a tensor-parallel rank: norms, qk-norms and MLA's latent
    norms (replicated), biases of column-parallel projections (split), of row-parallel ones (whole), and
    a trainable router bias. Routed experts' biases are left out."""
    attn = layer.attention
    count = layer.num_hidden_norms * hidden * (2 if norm_bias else 1)
    count += sum(attn.qk_norm_widths)
    kind = attention_kind(attn)
    count += kind.extra_norm_numel(attn) + sum(kind.qkv_bias_sizes(attn)) // tp
    if attn.out_bias:
        count += hidden
    mlps = [layer.mlp] if layer.mlp is not None else []
    if layer.moe is not None:
        mlps += [layer.moe.shared_expert] if layer.moe.shared_expert is not None else []
        if layer.moe.router_bias and not layer.moe.router_bias_is_buffer:
            count += layer.moe.num_experts
    for mlp in mlps:
        if mlp.bias:
            count += mlp.intermediate_size * (2 if mlp.gated else 1) // tp + hidden
    return count


def muon_scalar_numel(model: ModelSpec, job: Job, layer_indices: tuple[int, ...], root: int, *,
                      has_embedding: bool) -> int:
    """Elements of a stage's rank Muon's scalar optimizer (Adam) steps: Megatron's ``_is_muon_excluded``,
    the parameters flagged ``is_embedding_or_output_parameter`` (word embedding, output layer) and every
    tensor that is not 2-D (:func:`_layer_vectors_on_rank`). ``root``: the rank's embedding, output layer
    and final norm; a learned position table in it is 2-D and not flagged, so Muon's."""
    scalar = root - (position_embedding_params(model) if has_embedding else 0)
    for index in layer_indices:
        scalar += _layer_vectors_on_rank(model.layers[index], model.hidden_size, model.norm_bias, job.parallel.tp)
    return scalar


def muon_weight_matrices(model: ModelSpec, job: Job, layer_indices: tuple[int, ...], *,
                         has_embedding: bool = False) -> tuple[WeightMatrix, ...]:
    """The 2-D weights Muon steps on a stage's rank, one at a time (:func:`muon_matrices` per layer). The
    query part of a split QKV is preceded by fp32 copies of the three parts (``reshape`` of
    non-contiguous views), the whole local QKV gradient (its ``before``). A learned position table (on
    the embedding stage) is a replicated 2-D weight Muon steps too."""
    par = job.parallel
    out: list[WeightMatrix] = []
    if has_embedding and model.position_embedding == "learned":
        out.append(WeightMatrix(model.max_position_embeddings, model.hidden_size))
    for index in layer_indices:
        layer = model.layers[index]
        matrices = muon_matrices(layer, model.hidden_size, par.tp, par.expert_tp)
        attn = layer.attention
        fused = [m for m in attention_kind(attn).matrices(attn, model.hidden_size) if m.parts]
        if fused:
            # a split fused weight's largest part (listed first) follows fp32 copies of the whole local weight
            first = replace(matrices[0], before=_FP32 * (fused[0].rows * fused[0].cols // par.tp))
            matrices = (first, *matrices[1:])
        out += matrices
    return tuple(out)


def muon_step_bytes(model: ModelSpec, job: Job, layer_indices: tuple[int, ...], *,
                    has_embedding: bool = False) -> int:
    """Peak extra bytes of a Muon step over a stage's layers (the registry entry's
    :func:`~memplan.optimizers.muon.muon_matrix_bytes` of the largest of :func:`muon_weight_matrices`)."""
    opt = job.optimizer
    return max((m.before + muon_matrix_bytes(m, opt.muon_tp_mode, opt.muon_nesterov)
                for m in muon_weight_matrices(model, job, layer_indices, has_embedding=has_embedding)), default=0)


def describe_optimizer(job: Job) -> str:
    """One line for the assumptions: where the optimizer keeps its states."""
    out = optimizer_kind(job.optimizer.name).describe(job.optimizer)
    if job.optimizer.in_backward:
        out += ("; " if out else "") + ("optimizer in backward: each parameter steps in its post-accumulate-grad hook "
                                        "and its gradient is freed; at most the largest gradient is alive")
    return out


def in_backward_gradient_bytes(gradients: int, stepped_numel: int, largest_tensor: int) -> int:
    """Gradient bytes alive with ``--optimizer-in-backward``: each parameter steps in its
    post-accumulate-grad hook and its gradient is freed at once, so at most the largest parameter's
    gradient exists (``gradients`` are the bytes all ``stepped_numel`` gradients would take)."""
    if stepped_numel <= 0:
        return 0
    return min(gradients, -(-gradients * min(largest_tensor, stepped_numel) // stepped_numel))
