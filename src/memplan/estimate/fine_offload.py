"""Megatron-LM fine-grained activation offloading (``--fine-grained-activation-offloading``, ``--offload-modules``).

What the sources say (Megatron-LM d98e8a6, megatron/core/pipeline_parallel/fine_grained_activation_offload.py
and docs/user-guide/features/fine_grained_activation_offloading.md):

* Each listed module opens an offload **group** around its forward; the tensors autograd saves inside it
  (``on_save_for_backward``) leave for pinned CPU memory when the group commits
  (``ChunkOffloadHandler.bulk_offload_group``), unless a tensor has fewer than
  ``--min-offloaded-tensor-size`` elements (``tensor_need_offloading_checker``; parameters and tensors TE
  marks are skipped too). One ``ChunkOffloadHandler`` holds the groups of one model chunk for one
  micro-batch, in forward order.
* After the warm-up iteration ``PipelineOffloadManager.post_warmup_callback`` decides, once for the run,
  which groups stay on the GPU: for every module name, the last group of the first chunk to run its
  backward (so that reloading never stalls the compute stream); then, on pipeline rank r, groups of the
  first backward chunks until ``r x --delta-offload-bytes-across-pp-ranks`` bytes are kept; then, per
  chunk, the last ``(1 - --activation-offload-fraction)`` of the remaining eligible groups.
* At run time a chunk whose backward comes right after its forward (the last pipeline stage) keeps the
  last group of each name (``should_bulk_offload``).
* The backward reloads one group ahead: when a group's backward starts, the next group of the same
  chunk is copied back (``on_group_start_backward`` -> ``bulk_reload``), so two neighbouring groups'
  tensors are on the GPU at once (the worst neighbouring pair is priced).

Which of memplan's saved terms each module's group holds, under Megatron's Transformer Engine layer spec:
``attn_norm`` the layer input when the input norm is its own module (MLA; otherwise it is fused into the
QKV linear and ``attn_norm`` is an ``IdentityOp`` with nothing to offload); ``qkv_linear`` the QKV GEMM's
input (and the layer input its fused norm saves); ``core_attn`` q, k, v and the attention core's own
tensors; ``attn_proj`` the output projection's input; ``mlp_norm`` an MoE layer's pre-MLP norm input
(a dense layer's norm is fused into its MLP); ``expert_fc1`` the dispatched tokens; ``moe_act`` the
experts' fc1 output; ``fused_group_mlp`` all three expert tensors.

Known limitations: the size threshold is applied per memplan term (q, k and v are one term); layers under
full recompute keep only their input and offload nothing; the CUDA-graph pool is priced before offloading;
the pinned CPU pool's reuse across groups is not modelled (CPU bytes are what is offloaded at the peak).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from memplan.estimate.activations import ActivationShape, Term, divided, layer_terms_by_block
from memplan.estimate.layout import StageLayout
from memplan.estimate.recompute_modules import term_site
from memplan.estimate.terms import TermRole
from memplan.job import Offload
from memplan.model.attention_kinds import attention_kind
from memplan.model.spec import LayerSpec, ModelSpec

#: Offload modules in the order a layer's forward opens their groups.
FORWARD_ORDER = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                 "fused_group_mlp")
#: The blocks of :func:`~memplan.estimate.activations.layer_terms_by_block` (the attention block's, the rest).
_ATTENTION, _REST = 0, 1
_EXPERT_FC1, _MOE_ACT = (_REST, TermRole.DISPATCHED_TOKENS), (_REST, TermRole.EXPERT_FC1)


def group_terms(layer: LayerSpec, name: str) -> tuple[tuple[int, TermRole], ...]:
    """The :mod:`memplan.estimate.activations` terms module ``name``'s group holds in ``layer``, as (block, role)."""
    mla, moe = attention_kind(layer.attention).latent, layer.moe is not None
    norm_input, norm_output = (_ATTENTION, TermRole.NORM_INPUT), (_ATTENTION, TermRole.NORM_OUTPUT)
    table = {
        "attn_norm": (norm_input,) if mla else (),
        "qkv_linear": (norm_output,) if mla else (norm_input, norm_output),
        "core_attn": ((_ATTENTION, TermRole.QKV),),
        "attn_proj": ((_ATTENTION, TermRole.OUTPUT_PROJECTION_INPUT),),
        "mlp_norm": ((_REST, TermRole.NORM_INPUT),) if moe else (),
        "expert_fc1": (_EXPERT_FC1,) if moe else (),
        "moe_act": (_MOE_ACT,) if moe else (),
        "fused_group_mlp": (_EXPERT_FC1, _MOE_ACT, (_REST, TermRole.EXPERT_FC2)) if moe else (),
    }
    return table[name]


def layer_groups(layer: LayerSpec, shape: ActivationShape, modules: Iterable[str], *, kept_classes: Iterable[str],
                 dropped: frozenset[str], min_numel: int) -> list[tuple[str, int]]:
    """``(module, offloadable bytes)`` of ``layer``'s groups in forward order (one rank, one micro-batch):
    the saved terms the job's recompute keeps, of at least ``min_numel`` elements each."""
    kept_by, chosen = frozenset(kept_classes), set(modules)
    terms = [(block, t) for block, ts in enumerate(layer_terms_by_block(layer, shape)) for t in ts
             if t.keep in kept_by and term_site(t) not in dropped]
    out = []
    for name in FORWARD_ORDER:
        if name in chosen:
            wanted = group_terms(layer, name)
            held = [t for block, t in terms if (block, t.role) in wanted]
            if name == "core_attn":
                # and what the attention core saves inside (unfused: the s x s softmax output, the dropout mask)
                held += [t for _, t in terms if t.keep == "core"]
            out.append((name, sum(size for t in held if (size := divided(t, shape)) >= min_numel * _elem(t, shape))))
    return out


def _elem(term: Term, shape: ActivationShape) -> int:
    """Bytes per element of a term's tensor (FP8 GEMM inputs: 1; norm inputs: the residual dtype)."""
    if term.gemm_input and shape.fp8:
        return 1
    return shape.residual_bytes if term.role is TermRole.NORM_INPUT else shape.act_bytes


@dataclass(frozen=True)
class Offloaded:
    """What fine-grained offloading moves at the peak on one rank of a stage."""

    #: Saved bytes in CPU memory (off the GPU) with every micro-batch in flight.
    cpu_bytes: int
    #: The backward's reload working set: the group being used and the next one reloaded ahead (the worst
    #: neighbouring pair of one chunk).
    reload_bytes: int


def offloaded(instances: Sequence[list[tuple[str, int]]], *, fraction: float, keep_bytes: int,
              last_stage: bool) -> Offloaded:
    """Apply Megatron's rules to the in-flight chunk instances (oldest first; each its groups in forward
    order): the first backward chunk keeps the last group of each name, ``keep_bytes`` (pipeline rank x
    delta) stay from the first chunks on, each chunk keeps its last ``1 - fraction`` eligible groups, and
    on the last stage the newest chunk keeps the last group of each name."""
    offload = [[size > 0 for _, size in groups] for groups in instances]
    if instances:
        _keep_last_of_each_name(instances[0], offload[0])  # post_warmup_callback's reload margin
    for flags, groups in zip(offload, instances, strict=True):
        for position, (_, size) in enumerate(groups):
            if flags[position] and keep_bytes > 0:
                keep_bytes -= size
                flags[position] = False
    for flags in offload:
        eligible = [position for position, on in enumerate(flags) if on]
        for position in eligible[len(eligible) - int(len(eligible) * (1 - fraction)):]:
            flags[position] = False
    if last_stage and instances:
        _keep_last_of_each_name(instances[-1], offload[-1])  # should_bulk_offload, at run time
    moved = [[size for on, (_, size) in zip(flags, groups, strict=True) if on]
             for flags, groups in zip(offload, instances, strict=True)]
    # The backward reloads the next offloaded group of the same chunk while one is in use: the worst
    # pair of neighbours (a chunk with one offloaded group: that group alone).
    reload = max((a + b for sizes in moved for a, b in pairwise(sizes)), default=0)
    reload = max(reload, max((size for sizes in moved for size in sizes), default=0))
    return Offloaded(cpu_bytes=sum(sum(sizes) for sizes in moved), reload_bytes=reload)


def stage_offload(model: ModelSpec, off: Offload, shape: ActivationShape, layout: StageLayout, recomputed: set[int],
                  *, kept_classes: Iterable[str], dropped: frozenset[str]) -> Offloaded:
    """What fine-grained offloading moves on one rank of a stage: the groups of every in-flight chunk
    (layers under full recompute keep only their input and offload nothing) through :func:`offloaded`."""
    def groups(chunk: tuple[int, ...]) -> list[tuple[str, int]]:
        return [group for index in chunk if index not in recomputed
                for group in layer_groups(model.layers[index], shape, off.module_names, kept_classes=kept_classes,
                                          dropped=dropped, min_numel=off.min_tensor_numel)]
    per_chunk = [groups(chunk) for chunk in layout.chunks]
    return offloaded([per_chunk[c] for c in layout.inflight_chunks], fraction=off.group_fraction,
                     keep_bytes=layout.stage * off.pp_delta_bytes, last_stage=layout.has_head)


def _keep_last_of_each_name(groups: list[tuple[str, int]], flags: list[bool]) -> None:
    last = {name: position for position, (name, _) in enumerate(groups)}
    for position in last.values():
        flags[position] = False


def describe(modules: Sequence[str], *, min_numel: int, fraction: float, delta: int) -> str:
    """The assumption line of fine-grained offloading."""
    extra = (f", {fraction:g} of the eligible groups" if fraction < 1 else "") + (
        f", pipeline rank r keeps r x {delta:,} bytes" if delta else "")
    return (f"fine-grained activation offloading ({', '.join(modules)}): the saved inputs of these modules "
            f"(tensors of at least {min_numel:,} elements) go to CPU memory group by group{extra}; the first "
            "backward chunk (and on the last stage the newest) keeps the last group of each module on the GPU; the "
            "backward reloads one group ahead (two groups on the GPU)")
