"""What FSDP2 itself holds while a decoder block's backward computes (helper rcmlp18, session 18).

torch 2.13's ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``:

- the block's weight gradients are made on its unsharded parameters, in the compute dtype (``unsharded_param.grad``),
  and stay there until the block's ``post_backward`` hands them to ``foreach_reduce``: a dense MLP's output
  projection's weight gradient is alive at the MLP's worst node (the walk of
  :func:`~memplan.estimate.mlp_backward_nodes.gradients_made`, in the compute dtype); an MoE block's transformers
  grouped experts' down and gate-up weights' gradients at their walk's worst op
  (:mod:`~memplan.estimate.grouped_experts_backward`, in the compute dtype; helper moefsdp18: a trace of the grid's
  ``qwen3_moe_wide`` toy under full recompute holds both, 25 MiB, in layer 0's gate-up grouped GEMM's backward);
- ``post_backward`` pops the oldest ``comm_ctx.reduce_scatter_states`` (``reduce_scatter_max_input_buffers``, 1 by
  default) only when the next unit's gradients are reduced, so the reduce-scatter input (the unit's whole gradients in
  the reduce dtype) of the unit whose backward ran before is alive through a block's backward: the head unit's before
  the first block's (torchtitan's and accelerate's outer units; under one root unit its post-backward comes at the
  end), the block after it before any other. Under expert parallelism torchtitan shards a layer's routed experts as
  a unit of their own (``parallelize.py`` ``apply_fsdp``), whose post-backward comes before the block's: the block
  after it holds only its dense part's input by then (the experts' own input, alive through the attention's backward,
  is not priced, nor are the experts' unsharded gradients under expert parallelism: ``memplan trace`` refuses
  ``--ep``, so no witness);
- ``pre_backward`` waits for its own all-gather first (``wait_for_unshard``: the copy-out fills the unsharded
  parameters while the all-gather output lives, two blocks, before the block's working set: at the first layer
  that moment can outweigh the prefetch's, helper moefsdp18's ``qwen3_moe_wide`` toy), then its
  ``_backward_prefetch`` unshards the unit whose forward ran before: for the first decoder layer
  that is the embedding's unit under the outer units, and nothing under one root unit (already unsharded), where
  :func:`~memplan.estimate.extras.communication_by_phase` prices another block at every block's backward.

The first two are temporaries of the backward walk (:func:`~memplan.estimate.backward_walk.walked_backward`), by layer;
the third, at the first layer's backward, is weighed there too and moved to the communication category by
:meth:`BlockBackward.contributions`. Full training under FSDP2 (a torch optimizer), not under a pipeline schedule
(:mod:`~memplan.estimate.pipeline_fsdp`); fine-tuning's adapters are said, not priced.
"""

from __future__ import annotations

from memplan.estimate.context import StageContext
from memplan.estimate.fsdp_units import head_unit
from memplan.estimate.layer_walk import LayerWalk
from memplan.estimate.ledger import COMMUNICATION, TEMPORARY, Contribution
from memplan.estimate.memo import Same
from memplan.estimate.mlp_backward_nodes import gradients_made
from memplan.estimate.stage_states import StageStates
from memplan.estimate.states import layer_numel_on_rank
from memplan.frozen import frozen_dataclass
from memplan.units import dtype_bytes

__all__ = ["BlockBackward", "block_backward"]

_PHASE = ("backward",)
_EP_NOTE = ("; not modelled under expert parallelism: the routed experts' own FSDP2 unit (their reduce-scatter input "
            "during the attention's backward and their unsharded gradients; memplan trace refuses --ep, no witness)")
_FINETUNE_NOTE = ("FSDP2 under fine-tuning: the adapters' unsharded gradients and the previous unit's reduce-scatter "
                  "input at a block's backward are not priced")


@frozen_dataclass
class BlockBackward:
    """FSDP2's own tensors at each layer's backward (see the module)."""

    #: Per layer index: the block's unsharded gradients made before its worst op and the previous unit's
    #: reduce-scatter input (temporaries), plus at the first layer the prefetch's difference (``prefetch``).
    by_layer: dict[int, int]
    #: What the first layer's backward's prefetch holds beyond another block's unsharded copy (negative where less).
    prefetch: int
    #: The last layer's figure (the first block of the backward), for a backward not walked layer by layer.
    last: int
    note: str

    def early(self, early_gradients: dict[int, int]) -> dict[int, int]:
        """The walk's early gradients by layer with these terms added."""
        out = dict(early_gradients)
        for index, extra in self.by_layer.items():
            out[index] = out.get(index, 0) + extra
        return out

    def contributions(self, position: int | None) -> list[Contribution]:
        """The sentence, and at the first layer's backward (walk position 0) the prefetch's difference moved from
        the temporaries (where the walk weighed it) to the communication category."""
        moved = self.prefetch if position == 0 else 0
        return [Contribution(COMMUNICATION, moved, _PHASE, note=self.note), Contribution(TEMPORARY, -moved, _PHASE)]


def block_backward(ctx: StageContext, st: StageStates, walk: LayerWalk) -> BlockBackward | None:
    """FSDP2's tensors at each layer's backward on this stage; None outside FSDP2 or where nothing is priced."""
    if ctx.job.sharding.fsdp == "none":  # (the default job's fast path)
        return None
    run = ctx.run
    if not run.profile.torch_optimizer or not walk.per_layer:
        return None
    from memplan.estimate import pipeline_fsdp

    if pipeline_fsdp.applies(ctx, st) or run.job.parallel.pp > 1:
        return None
    if st.ft is not None:
        return BlockBackward({}, 0, 0, _FINETUNE_NOTE)
    compute, reduce = dtype_bytes(run.prec.compute), run.prec.reduce_bytes
    head = head_unit(ctx)
    # the unit whose reduce-scatter input is held, in backward order: the head unit before the last layer
    held = (head or 0) * reduce
    experts_in_block = run.job.parallel.ep <= 1  # (else the routed experts are a unit of their own: see the module)
    by_layer: dict[int, int] = {}
    own = 0  # the first layer's backward's own bytes at its worst (the walk's, its early gradients, these made)
    for index, _, worst in reversed(walk.per_layer):
        made = _made(ctx, index, compute) if index not in walk.early_gradients else 0
        by_layer[index], own = made + held, worst + walk.early_gradients.get(index, 0) + made
        dense, expert = layer_numel_on_rank(ctx.model.layer_param_groups[index], run.job)
        held = (dense + (expert if experts_in_block else 0)) * reduce
    first, last = walk.per_layer[0][0], walk.per_layer[-1][0]
    block = st.params.largest_layer * compute
    embedding = (st.params.root - head) * compute if head is not None and ctx.layout.has_embedding else 0
    gathered = embedding - (run.profile.fsdp_live_blocks - 1) * block
    # the first layer's pre-backward copy-out holds its all-gather output beside its unsharded block (the two blocks
    # communication_by_phase prices) before its working set: where that moment outweighs the prefetch's, it is the one
    copy_out = own + gathered < 0 and first != last
    prefetch = 0 if copy_out else gathered
    by_layer[first] += -own if copy_out else gathered
    return BlockBackward(by_layer, prefetch, by_layer[last] - (prefetch if last == first else 0), (
        "FSDP2 at a block's backward: its weight gradients made so far, unsharded in the compute dtype until its "
        "post-backward reduce-scatters them, and the previous unit's reduce-scatter input (its gradients in the "
        "reduce dtype, kept until the next unit's post-backward); at the first layer's backward the prefetched "
        f"unit is {'the embedding' if head is not None else 'none (the root unit is unsharded)'}, not another block"
        + ("" if experts_in_block else _EP_NOTE)))


def _made(ctx: StageContext, index: int, compute: int) -> int:
    """Layer ``index``'s unsharded gradients made before its backward's worst op, beyond it (the dense MLP's walk, or
    an MoE layer's grouped experts' walk), where the layer walk has none of its own (a recomputed layer walked op
    by op counts them)."""
    run = ctx.run
    from memplan.estimate.compiled import compiled_layer
    from memplan.estimate.reserved_mlp_backward import whole_weights

    layer = run.model.layers[index]
    if not whole_weights(run) or compiled_layer(run, layer):
        return 0
    if layer.moe is not None:
        return _experts_made(ctx, index, compute)
    return gradients_made(Same(layer), run.shape, run.policy.kind.checkpoints_layers, compute)


def _experts_made(ctx: StageContext, index: int, compute: int) -> int:
    """An MoE layer's grouped experts' unsharded weight gradients (compute dtype) at their walk's worst op beyond the
    layer's backward transient (:mod:`~memplan.estimate.grouped_experts_backward`: the down weight's gradient made
    before ``act(gate) * up``'s backward, the gate-up weight's beside the dispatched rows' gradient); 0 where the
    whole walk does not apply (expert parallelism, another experts implementation)."""
    from memplan.estimate.grouped_experts_backward import experts_figures, weight_gradient_bytes
    from memplan.estimate.layer_costs import layer_blocks, layer_costs
    from memplan.estimate.recomputed_backward import unwalked_backward

    run = ctx.run
    layer = run.model.layers[index]
    found = layer_blocks(run, layer, index)
    if found is None:
        return 0
    shape, blocks = found
    experts = experts_figures(layer, shape, blocks[1], run.dropped, run.policy.kind.checkpoints_layers,
                              weight_gradient_bytes(layer, run.model.hidden_size, compute))
    if experts is None or not experts.walked:
        return 0
    transient = layer_costs(run, layer, index)[2]
    if index in ctx.recomputed and not run.policy.partial:  # (net of the checkpointed input, as the walk's figure)
        transient = sum(unwalked_backward(run, index, transient, not run.job.offload.activations))
    return max(0, experts.with_gradients - transient)
