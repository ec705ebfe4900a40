"""The weight gradients a layer's backward has made by its worst op, where the backward makes them (helper
mixtral12, session 12).

Under ``zero_grad(set_to_none=True)`` and one micro-batch a step's backward makes the gradients as it goes (the
stage's backward walk, :func:`~memplan.estimate.stage_peak._backward_walk`, adds each layer's once the layer is
done). Within a layer, two moments come after some of its own:

- an unfused eager core's softmax backward: autograd reaches it once the MLP or MoE block, the pre-MLP norm and
  the output projection are done, so their gradients exist beside the two fp32 gradients of the probabilities
  (:func:`~memplan.estimate.activations.softmax_backward_bytes`); a trace of a Mixtral-like toy's last layer
  (grouped experts, eager attention) holds 12.3 MiB of them there, its largest moment. Beside them (helper gpt2bwd12): the residual stream's gradient, the layer's output gradient summed with the MLP
  block's input gradient, which waits for the attention block's (a trace's ``add`` under the pre-MLP norm: one hidden
  state in the residual dtype, on GPT-2, Llama, GPT-NeoX's parallel residual and the MoE toys alike); and, under
  ``torch.autocast``, the 16-bit copies of those linears' weights are gone (each node frees what it saved). The
  value's gradient, made by the PV matmul's backward, weighs what that node frees of the values. A fully recomputed
  layer the walk does not cover has both too (helper rcresid12): its figure
  (:func:`~memplan.estimate.layer_walk._recomputed`) is net of the checkpointed input, which a plain checkpoint's
  recomputed forward reads rather than copies;
- transformers' grouped experts' walked backward (:mod:`~memplan.estimate.grouped_experts_backward`): the down
  weight's gradient before ``act(gate) * up``'s backward;
- a dense MLP's backward node by node (:mod:`~memplan.estimate.mlp_backward_nodes`, helper mlpbwd13): the output
  projection's weight gradient before the activation's product (eager SwiGLU, GPT-2's ``gelu_new``).

Under partial freezing (``--trainable``, no adapter or copy in the layer, helper bw15) the softmax's moment holds the
layer's trained tensors' gradients among those (a trace of a Llama toy training layers.1 alone: the MLP's, the norm's
and o_proj's fp32 gradients, 2.5 MiB, beside the softmax's two 64 MiB gradients), the copies of the trained weights
freed, and the residual stream's gradient only where the layer's input needs one (else the output projection's
backward consumed it). A layer carrying adapters on an unquantized base autocast does not cast (lead, session 17)
holds, beside the softmax's gradients, those of the adapters whose backward has run (the MLP block's and o_proj's,
in the adapters' dtype) and the residual stream's gradient where its input needs one (a trace of the Llama toy with
LoRA or DoRA on q_proj,v_proj at 1,024 tokens x 2: 1 MiB beside the two 64 MiB gradients; the estimate had been
-0.31% there). Otherwise only for a job that trains the whole model and keeps each gradient it makes whole on the GPU until the step (the
softmax's moment under tensor parallelism too, with each rank's share of the gradients, helper fnorm12; the
experts' walk on one rank's whole weights only): not sharded by ZeRO-2/3 or FSDP (their reduce-scatter has its own
buffers), not moved to host memory with an offloaded optimizer, not consumed by an optimizer step in the backward. Recomputed layers the
walk of :mod:`~memplan.estimate.recomputed_backward` covers have their own; partial policies' figures are net of what they make
again (not here), but for the checkpointed attention module (``hf`` selective), whose recompute runs where the attention
block's backward starts: its softmax moment is a layer's not recomputed, beside the copies that recompute made and has
not freed yet (as a recomputed layer's: helper neox13, GPT-NeoX toys); under ``save_on_cpu``
:mod:`~memplan.estimate.offloaded_backward` has its own.
"""

from __future__ import annotations

from functools import lru_cache

from memplan.estimate.activations import has_eager_core, output_gradient_bytes, softmax_backward_bytes
from memplan.estimate.compiled import compiled_layer
from memplan.estimate.context import RunContext
from memplan.estimate.grouped_experts_backward import experts_figures, weight_gradient_bytes
from memplan.estimate.layer_costs import layer_blocks
from memplan.estimate.memo import Same
from memplan.estimate.mlp_backward_nodes import gradients_made
from memplan.estimate.finetune import adapter_bytes
from memplan.estimate.frozen_copies import casts_frozen
from memplan.estimate.partial_freeze import after_attention_core, is_norm, trained_tensors
from memplan.model.linears import model_parameters
from memplan.model.spec import LayerSpec
from memplan.units import dtype_bytes

__all__ = ["early_gradients"]


def early_gradients(run: RunContext, layer: LayerSpec, index: int, transient: int, copies: int = 0) -> int:
    """Layer ``index``'s (not walked as recomputed, not offloaded) weight gradients made before its backward's worst op,
    beyond its ``transient``: the most of the two moments of the module with the gradients made before each, less
    ``transient``; 0 where the module does not apply. ``copies``: the autocast weight copies its checkpointed region
    made again, which ``transient`` counts whole (:func:`~memplan.estimate.layer_costs.recomputed_copies_bytes`)."""
    job = run.job
    if (job.sharding.zero >= 2 or job.sharding.fsdp != "none" or job.offload.optimizer or job.optimizer.in_backward
            or (run.policy.partial and not run.policy.kind.checkpoints_attention)
            or (layer.moe is None and run.shape.kernels != "eager")):
        return 0  # (a dense layer under fused kernels has none of the moments: no terms built)
    from memplan.estimate.reserved_mlp_backward import attention_split, whole_weights

    mlp = gradients_made(Same(layer), run.shape, run.policy.kind.checkpoints_layers, run.prec.grad_bytes) \
        if whole_weights(run) and not compiled_layer(run, layer) else 0
    if layer.moe is None and not has_eager_core(run.shape):
        return mlp  # a dense layer under a fused or flash core: the MLP walk's moment only (no terms built)

    trained = None if run.counts is None else _trained(run, index)
    if run.counts is not None and trained is None:
        return _adapter_layer_moment(run, layer, index, transient, copies)
    found = layer_blocks(run, layer, index)
    if found is None:
        return 0
    shape, blocks = found
    moments = [0]
    experts = experts_figures(layer, shape, blocks[1], run.dropped, run.policy.kind.checkpoints_layers,
                              weight_gradient_bytes(layer, run.model.hidden_size, run.prec.grad_bytes)
                              ) if whole_weights(run) else None
    if experts is not None and experts.walked:
        moments.append(experts.with_gradients)
    moments.append(transient + mlp)  # the MLP walk's gradients beside what the layer holds at its worst
    softmax = softmax_backward_bytes(layer, shape, blocks)
    sizes = _gradient_sizes(run, index, trained) if softmax else []
    split = attention_split(run.model, index, len(sizes)) if softmax else None
    if split is not None:
        # the MLP block's, its norm's and the output projection's gradients are made; the residual stream's gradient
        # (the layer's output gradient plus the MLP block's input gradient) waits for the attention block's, where
        # the layer's input needs one (else the output projection's backward consumed it); the autocast copies of
        # the weights whose backward has run are freed
        # (the copies a checkpointed region made again are in ``transient``: those not freed yet are beside too)
        waits = trained is None or run.flows is None or run.flows[index].attention.input_grad
        beside = (copies + (output_gradient_bytes(shape, run.model.hidden_size) if waits else 0)
                  - _freed_copies(run, index, split[0], sizes))
        moments.append(softmax + sum(sizes[i] for i in split[0]) + beside)
    return max(0, max(moments) - transient)


def _adapter_layer_moment(run: RunContext, layer: LayerSpec, index: int, transient: int, copies: int) -> int:
    """The softmax backward's moment of a layer carrying adapters on an unquantized base whose frozen weights autocast
    does not cast, beyond ``transient``: beside the softmax's gradients, those of the adapters whose backward has run
    (the MLP block's and the output projection's, in the adapters' dtype) and the residual stream's gradient where
    the layer's input needs one; 0 elsewhere (no eager softmax backward, or a quantized or cast base)."""
    counts = run.counts
    assert counts is not None
    adapters = counts.layer_adapters[index]
    if not adapters or counts.layers[index].quantized or casts_frozen(run):
        return 0
    found = layer_blocks(run, layer, index)
    if found is None:
        return 0
    shape, blocks = found
    softmax = softmax_backward_bytes(layer, shape, blocks)
    if not softmax:
        return 0
    made = sum(a.numel for a in adapters
               if not after_attention_core(f"{a.module.name.rpartition(f'.{index}.')[2]}.weight"))
    waits = run.flows is None or run.flows[index].attention.input_grad
    beside = copies + (output_gradient_bytes(shape, run.model.hidden_size) if waits else 0)
    return max(0, softmax + made * adapter_bytes(run.job) + beside - transient)


def _freed_copies(run: RunContext, index: int, made: list[int], sizes: list[int]) -> int:
    """Bytes of the autocast weight copies freed once the gradients at positions ``made`` are (each linear's node
    frees the 16-bit copy of its weight and bias it saved after its backward, :mod:`~memplan.estimate.walk_copies`):
    the linears' among them, not the norms' (not cast) nor, under eager kernels, HF's grouped routed experts'
    (``grouped_mm`` is not an autocast op: :func:`~memplan.estimate.autocast.layer_weight_copy_numel`)."""
    if run.prec.weight_copies != "autocast":
        return 0
    copied = _copied(Same(run.model), index, run.profile.kernels == "eager")
    numel = sum(sizes[i] for i in made if copied[i]) // run.prec.grad_bytes
    return numel * dtype_bytes(run.prec.compute)


@lru_cache(maxsize=4096)
def _copied(model: Same, index: int, eager_experts: bool) -> tuple[bool, ...]:
    """Per parameter tensor of layer ``index`` (:func:`_gradient_sizes` order), whether autocast copies it."""
    return tuple(not (is_norm(p.module) or (eager_experts and p.routed_expert))
                 for p in model_parameters(model.obj) if p.layer == index)  # type: ignore[arg-type]


def _trained(run: RunContext, index: int) -> tuple[bool, ...] | None:
    """Under partial freezing (``--trainable``), which of layer ``index``'s parameter tensors train fully
    (:func:`~memplan.estimate.partial_freeze.trained_tensors`); None where none does, the layer holds adapters or
    copies, or its base is quantized."""
    counts = run.counts
    if counts is None or counts.layers[index].quantized:
        return None
    return trained_tensors(run.model, run.job.finetune, index)


def _gradient_sizes(run: RunContext, index: int, trained: tuple[bool, ...] | None = None) -> list[int]:
    """Bytes of each of layer ``index``'s gradients on one rank, in parameter order: whole, or each tensor's share
    under tensor parallelism (:func:`~memplan.estimate.reserved_tp.rank_numel`: the linear weights split, the norms
    whole) and the routed experts' under expert parallelism (split by ep x etp, as the states are:
    :func:`~memplan.estimate.states.layer_numel_on_rank`); 0 for a frozen tensor where ``trained`` says which
    train."""
    from memplan.estimate.reserved_mlp_backward import layer_gradient_sizes

    par, grad_bytes = run.job.parallel, run.prec.grad_bytes
    if par.tp <= 1 and par.ep * par.expert_tp <= 1:
        sizes = layer_gradient_sizes(run.model, index, grad_bytes)
    else:
        from memplan.estimate.reserved_tp import rank_numel

        sizes = [(tensor.numel // (par.ep * par.expert_tp) if tensor.routed_expert
                  else rank_numel(run.model, run.profile, par.tp, tensor)) * grad_bytes
                 for tensor in model_parameters(run.model) if tensor.layer == index]
    return sizes if trained is None else [size if train else 0 for size, train in zip(sizes, trained)]
