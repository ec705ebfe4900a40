"""What the forward moment of DoRA's weight-norm step holds beside the layers' saved tensors and the step's own
temporaries (:func:`~memplan.estimate.adapter_acts.dora_forward_transient`), where that step is the stage's last
layer's MLP output projection (helper bw15, session 15).

peft's ``DoraLinearLayer.forward`` rebuilds the adapted weight inside the linear's forward; the largest one (the
``in x in`` identity) is the MLP output projection's (``down_proj``: its ``in`` is the intermediate size), the last
linear of the layer, so every other tensor the layer saves exists by then. A trace of a Llama toy (hidden 1,024,
intermediate 4,096, bf16-mixed, DoRA all-linear, 256 tokens x 2; peak at layer 1's ``down_proj`` ``lora_B(lora_A(eye))``)
holds, beyond the step's temporaries and the saved tensors made by then, tensors the modeling code binds while the
MLP runs, which nothing saves:

- the layer's input, bound by the model's loop (``hidden_states = decoder_layer(hidden_states, ...)``), where the layer
  saves none of it (a 16-bit eager RMSNorm saves its fp32 copy); the first layer's is the embedding's output
  (:func:`~memplan.estimate.input_leaf.bound_embedding_output`);
- the residual stream after the attention block (the decoder layer's ``residual``), where the MLP's norm saves its
  fp32 copy instead;
- the MLP block's input (the norm's output, the decoder layer's ``hidden_states`` while ``self.mlp`` runs), where the
  adapters' ``lora_A`` save a copy of it (peft's cast to the adapters' dtype, autocast's 16-bit copy) and the frozen
  base GEMMs save nothing;
- eager attention's 4-D masks (:func:`~memplan.estimate.gpt_oss_terms.forward_mask_term`), alive until the model's
  forward returns.

And the output projection's own saved tensors made after the step are not there yet: ``lora_A``'s output, ``lora_B``'s
result and the weight norm and scales (its ``lora_A`` input copy is: the projection's input, the MLP's product, stands
for it, one tensor of that size).

Where the stage's worst step is at the last layer's first adapted attention input projection (DoRA on q_proj and
v_proj: the ``in x in`` identities are all ``hidden x hidden``, q's product the widest; helper bw16, session 16), the
layer has made only its pre-norm's saved tensors and the projection's base result by then: every other tensor it saves
(its attention core's, the MLP block's, the adapters' but for that base result) is not made yet, and the layer's input
and the attention module's input (the pre-norm's output) are bound, with the masks. A trace of the Llama toy with
DoRA on q,v (256 tokens x 2, bf16-mixed, eager) holds 118,133,248 B at q_proj's weight-norm sum (estimate 118,065,152);
the moment was priced with every saved tensor of the layer (+25.5 MB), above the backward's peak (+6.2%).

Where the worst step is the attention output projection's (DoRA on o_proj, alone or tying with q_proj's, both
``hidden x hidden``: the later step holds the attention core's tensors too; the review of session 16), the moment is
o_proj's step: the attention block's saved tensors and its adapters' made (o_proj's own after its step not), the MLP
block's not (helper qknorm18, session 18). A trace of the toy with DoRA on q_proj,o_proj holds 133,075,968 B at
layer 1's o_proj DoRA combine, its forward maximum; the moment had been priced with every saved tensor of the layer
(the MLP's ~14 MiB too: 144,855,040 B, above the backward peak, +6.2%); now 131,463,168 B (the attention
forward's bound locals, q, k, v and o_proj's input, and the combine's fp32 products are not counted).

Not priced: a layer without a pre-MLP norm, with a parallel residual or an MoE block, an adapter on a later attention
input projection whose step is the worst (the earlier projections' adapters made), a step tying with an MLP
projection's, ``--lora-dropout`` (peft's other DoRA path) and a quantized base.
"""

from __future__ import annotations

from typing import Any

from memplan.estimate.activations import divided, has_eager_core
from memplan.estimate.adapter_acts import (
    ATTENTION_INPUT_LINEARS,
    dora_forward_transient,
    module_dora,
    on_attention_output,
    on_mlp_output,
)
from memplan.estimate.context import StageContext
from memplan.estimate.gpt_oss_terms import forward_mask_term
from memplan.estimate.terms import NORM_TERMS, TermRole
from memplan.peft.params import Adapter

__all__ = ["dora_moment_locals"]

#: The attention module's input kept by the pre-norm or the projections' adapters (made before the projections run).
_MODULE_INPUTS = frozenset({TermRole.NORM_OUTPUT, TermRole.ATTENTION_MODULE_INPUT})
#: An attention block's saved tensors made before its input projections run: its pre-norm's, the module's input.
_MADE_BEFORE = NORM_TERMS | _MODULE_INPUTS


def dora_moment_locals(ctx: StageContext, transient: int) -> int:
    """The bytes the module describes (the bound tensors less the output projection's tensors not made yet) at the
    stage's DoRA forward moment, whose temporaries weigh ``transient``; 0 where it is not priced or not there."""
    run = ctx.run
    ft = run.job.finetune
    if (not transient or ctx.recomputed or run.counts is None or ft.lora_dropout > 0 or ft.quant_kind.quantizes
            or not ctx.layout.layer_indices):
        return 0
    index = ctx.layout.layer_indices[-1]
    layer = run.model.layers[index]
    adapter = _output_projection_adapter(run.counts.layer_adapters[index]) if layer.moe is None else None
    from memplan.estimate.layer_costs import dora_forward_sizes, layer_blocks

    sizes = dora_forward_sizes(run)  # as the stage's DoRA transient was priced (layer_costs.dora_transient)
    autocast, act_bytes, lora_dtype = sizes["autocast"], sizes["compute_bytes"], sizes["adapter_bytes"]
    tokens = sizes["tokens"]
    if adapter is None or dora_forward_transient((adapter,), **sizes) != transient:
        return _input_projection_moment(ctx, index, transient, sizes) if not layer.parallel_residual else 0
    if layer.parallel_residual:
        return 0

    found = layer_blocks(run, layer, index)
    if found is None:
        return 0
    shape, (attention, rest) = found
    kept = [t for t in rest if t.keep in run.kept_classes]
    if not any(t.role is TermRole.NORM_OTHER for t in rest):
        return 0  # no pre-MLP norm saving a copy of its input (not priced)
    hidden = shape.local_tokens * run.model.hidden_size
    first = index == 0 and ctx.layout.has_embedding
    layer_input = 0 if first or any(t.keep == "input" for t in attention) else hidden * shape.residual_bytes
    residual = 0 if any(t.role is TermRole.NORM_INPUT for t in kept) else hidden * shape.residual_bytes
    copied = autocast or lora_dtype != act_bytes  # lora_A reads a copy of the MLP's input, not the input itself
    # (the norm's output: its frozen 16-bit weight times the normalized input in the residual stream's dtype)
    norm_output = hidden * max(act_bytes, shape.residual_bytes)
    mlp_input = norm_output if copied and not any(t.role is TermRole.NORM_OUTPUT for t in kept) else 0
    masks = divided(forward_mask_term(run.model, run.shape), run.shape) if has_eager_core(shape) else 0
    return layer_input + residual + mlp_input + masks - _not_made(adapter, tokens, act_bytes if autocast else lora_dtype)


def _input_projection_moment(ctx: StageContext, index: int, transient: int, sizes: dict[str, Any]) -> int:
    """At DoRA's step on layer ``index``'s first adapted attention input projection (q/k/v), where it is the stage's
    worst (``transient``): the layer's input and the attention module's input (the decoder layer's ``residual`` and
    ``hidden_states``) and the 4-D masks bound, less every tensor the layer saves but its pre-norm's and the
    projection's base result (made before the step); 0 where it is not there or not priced. Where the attention output
    projection's step is the worst (DoRA on o_proj, alone or tying with q_proj's, both ``hidden x hidden``), that later
    step is the moment: the attention block's saved tensors and its adapters' are made but the output projection's own
    made after its step (:func:`_not_made`), the MLP block's are not."""
    run = ctx.run
    adapters = run.counts.layer_adapters[index]  # type: ignore[union-attr]
    first = next((a for a in adapters if a.module.name.rpartition(".")[2] in ATTENTION_INPUT_LINEARS), None)
    act_bytes, tokens = sizes["compute_bytes"], sizes["tokens"]
    worst = [a for a in adapters if module_dora(a) and dora_forward_transient((a,), **sizes) == transient]
    tie = next((a for a in worst if on_attention_output(a)), None)  # the attention's last worst step
    if (tie is None and (first not in worst or len(worst) > 1)) or any(
            not on_attention_output(a) and a.module.name.rpartition(".")[2] not in ATTENTION_INPUT_LINEARS
            for a in worst):
        return 0  # not there, or a later step of the same size (an input projection's, the MLP's): not priced
    from memplan.estimate.layer_costs import layer_blocks, layer_costs

    found = layer_blocks(run, run.model.layers[index], index)
    if found is None:
        return 0
    shape, (attention, rest) = found
    made = [t for t in attention if t.keep in run.kept_classes and (tie is not None or t.role in _MADE_BEFORE)]
    if tie is not None:  # the output projection's step: the attention block's and its adapters' tensors made
        made += [t for t in rest if t.keep in run.kept_classes and t.keep == "attn"]
    hidden = shape.local_tokens * run.model.hidden_size
    layer_input = 0 if (index == 0 and ctx.layout.has_embedding) or any(t.keep == "input" for t in attention) \
        else hidden * shape.residual_bytes
    module_input = 0 if any(t.role in _MODULE_INPUTS for t in made) else hidden * max(act_bytes, shape.residual_bytes)
    masks = divided(forward_mask_term(run.model, run.shape), run.shape) if has_eager_core(shape) else 0
    not_made = layer_costs(run, run.model.layers[index], index)[0] - sum(divided(t, shape) for t in made)
    if tie is None:
        not_made -= act_bytes * tokens * first.module.out_features  # type: ignore[union-attr]  # the base result
    else:  # the output projection's own tensors made after its step
        not_made += _not_made(tie, tokens, act_bytes if sizes["autocast"] else sizes["adapter_bytes"])
    return layer_input + module_input + masks - not_made


def _output_projection_adapter(adapters: tuple[Adapter, ...]) -> Adapter | None:
    """The layer's DoRA adapter on its dense MLP's output projection (its last linear), or None."""
    return next((a for a in adapters if module_dora(a) and on_mlp_output(a)), None)


def _not_made(a: Adapter, tokens: int, lora_bytes: int) -> int:
    """The adapter's saved tensors made after its weight-norm step: ``lora_A``'s output, ``lora_B``'s result (both in
    ``lora_bytes`` per element) and the fp32 weight norm and three scales' vectors (its input needs a gradient)."""
    out = a.module.out_features
    return lora_bytes * tokens * (a.rank + out) + 4 * 3 * out
