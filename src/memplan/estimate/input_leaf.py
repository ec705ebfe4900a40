"""Mechanic: the embedding's output as a leaf that autograd keeps, under Hugging Face's checkpointing of a frozen embedding;
the same output bound by the model's forward, at the forward's own moment.

``PreTrainedModel.gradient_checkpointing_enable`` (transformers ``modeling_utils.py``) calls
``enable_input_require_grads``, a forward hook on the input embedding module that makes its output require grad, so
that a frozen model's checkpointed layers have an input to differentiate. With the embedding frozen (fine-tuning)
that output is a leaf: autograd's ``AccumulateGrad`` node holds it until the backward ends. Where the model feeds it
to the first decoder layer as it is (Llama-style families; Gemma scales inside its embedding module), it is that
layer's checkpointed input, counted with the layer. Where the forward makes a new tensor of it first
(:attr:`~memplan.model.spec.ModelSpec.first_input_apart`: GPT-2's ``inputs_embeds + position_embeds``, Granite's
``inputs_embeds * embedding_multiplier``; an embedding dropout), the leaf is one more hidden-state tensor beside the
checkpointed inputs (a GPT-2 toy under LoRA and full recompute: 256 KiB the estimate lacked). Under ``save_on_cpu``
the checkpointed inputs go to host memory and the leaf stays on the GPU whatever the model
(:func:`memplan.estimate.stage_activations._save_on_cpu`).
"""

from __future__ import annotations

from memplan.estimate.context import StageContext
from memplan.estimate.finetune import frozen_compute_bytes
from memplan.estimate.partial_freeze import root_flow

#: The sentence --explain gives where the leaf is counted apart.
NOTE = ("enable_input_require_grads under checkpointing makes the frozen embedding's output a leaf that autograd keeps "
        "until the backward ends; the model makes the first layer's input from it as a new tensor (learned position "
        "embeddings, an embedding multiplier or dropout), so the leaf is kept beside the checkpointed inputs")


def input_leaf_bytes(ctx: StageContext) -> int:
    """The embedding's output where ``enable_input_require_grads`` made it a leaf that requires grad (a frozen
    embedding under checkpointing, fine-tuning), for the stage's micro-batches in flight; 0 elsewhere."""
    run, layout = ctx.run, ctx.layout
    if run.counts is None or not layout.has_embedding or not run.policy.input_grads:
        return 0
    if root_flow(run.model, run.job.finetune, True).embedding_trains:
        return 0
    return (run.shape.local_tokens * run.shape.hidden * frozen_compute_bytes(run.job, run.prec.weight_copies)
            * layout.inflight_microbatches)


def leaf_apart_bytes(ctx: StageContext) -> int:
    """The leaf where it is not the first layer's input (see the module), else 0: what it adds to the saved tensors
    of a stage whose saved tensors stay on the GPU."""
    if not (ctx.run.model.first_input_apart or ctx.run.shape.drops_embedding):
        return 0
    return input_leaf_bytes(ctx)


def bound_embedding_output(ctx: StageContext) -> int:
    """The embedding module's output beside the saved tensors at the stage's forward moment (its last layer's forward
    temporaries: gpt-oss's sink attention, DoRA's weights), where the model's forward keeps it bound
    (``FrameworkProfile.binds_embedding_output``: transformers' ``inputs_embeds``, alive until the model's forward
    returns) and no saved tensor is it: the first layer is not recomputed and its role saves none of its input (a
    frozen layer on a frozen embedding; a 16-bit eager RMSNorm, which saves its fp32 copy), or the first layer's input
    is a new tensor made from it (:attr:`~memplan.model.spec.ModelSpec.first_input_apart`), and no input leaf is
    counted (:func:`input_leaf_bytes`). One micro-batch's; 0 elsewhere."""
    run, layout = ctx.run, ctx.layout
    if not (run.profile.binds_embedding_output and layout.has_embedding and layout.layer_indices) or ctx.recomputed:
        return 0
    if input_leaf_bytes(ctx):
        return 0
    from memplan.estimate.layer_costs import layer_blocks
    from memplan.estimate.recomputed_backward import checkpoint_input_bytes

    index = layout.layer_indices[0]
    found = layer_blocks(run, run.model.layers[index], index)
    if found is not None and not run.model.first_input_apart:
        shape, blocks = found
        if checkpoint_input_bytes(blocks[0] + blocks[1], shape):
            return 0  # the first layer saves it
    trains = root_flow(run.model, run.job.finetune, True).embedding_trains if run.counts is not None else True
    per_element = run.shape.residual_bytes if trains else frozen_compute_bytes(run.job, run.prec.weight_copies)
    return run.shape.local_tokens * run.shape.hidden * per_element
