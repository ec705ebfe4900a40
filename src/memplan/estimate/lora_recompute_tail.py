"""A fully recomputed LoRA/DoRA layer's recomputed forward, where it stops inside (or just before) the adapter on
the MLP's output projection (helpers lorafull13, neoxft14, dora14, dora15): what it holds there beyond the layer's
saved tensors (:func:`lora_recompute_tail`, read by
:func:`memplan.estimate.recomputed_backward.unwalked_backward`'s ``_lora_tail``)."""

from __future__ import annotations

from collections.abc import Sequence

from memplan.estimate.activations import DROPOUT_MASK_BYTES, NORM_COMPUTE_BYTES, Term
from memplan.estimate.adapter_acts import (
    MLP_INPUT_LINEARS,
    dora_head,
    dora_weight_norm,
    on_mlp_output,
    on_module,
)
from memplan.estimate.terms import SAVED_BY_OUTPUT_PROJECTION, TermRole
from memplan.peft.params import Adapter

__all__ = ["lora_recompute_tail"]


def lora_recompute_tail(adapters: tuple[Adapter, ...], *, tokens: int, residual: int, mlp_input: int,
                        byte_sizes: tuple[int, int, int], autocast: bool, mlp_terms: Sequence[Term] = (),
                        dropout: bool = False, fp32_input: bool = False, base_keeps_input: bool = False) -> int:
    """What a fully recomputed layer holds beyond its saved tensors at the worst moment of its recomputed forward that
    an adapter on the MLP's output projection makes (0 where no LoRA/DoRA adapter sits there): where the forward
    stops, or inside the MLP's input projection (:func:`_input_projection_moment`).

    ``torch.utils.checkpoint``'s non-reentrant recompute stops once the last saved tensor is made again
    (``_StopRecomputationError``), inside peft's ``Linear.forward`` of that projection (``tuners/lora/layer.py``),
    whose locals are alive there: the base layer's result (``out`` wide; DoRA saves it), its input (``in`` wide; a
    frozen base and ``lora_A``'s own copy leave it unsaved) and peft's cast of it to the adapters' dtype
    (``_cast_input_dtype``; under autocast ``lora_A`` saves a 16-bit copy of it instead), the MLP block's input (the
    norm's output, ``mlp_input`` bytes, unsaved for the same reason) and the residual stream's partial sum
    (``residual`` bytes: with the attention output a layer's forward keeps, less what the MLP's pre-norm saves). Beside them, what the backward made before it first unpacked a saved tensor (the
    recompute's trigger, :func:`_lora_head`). Where peft's cast is a no-op (adapters in the activations' dtype)
    ``lora_A`` saves that input itself and the MLP block's input is its group's kept input: neither is extra.
    ``dropout`` (``--lora-dropout``): ``lora_A`` reads ``dropout(x)`` (:func:`_dropout_locals`).
    ``byte_sizes``: the activations', the adapters' and the frozen base weights' bytes per element; ``mlp_terms``:
    the layer's MLP-block terms (one rank: the tail applies on one tensor-parallel rank without FP8).
    ``fp32_input``: the MLP reads DoRA's fp32 stream on a bitsandbytes base (:mod:`~memplan.estimate.dora_fp32_stream`):
    a DoRA adapter there (LoRA's is not priced: 0) reads an fp32 input, which the base keeps (with the MLP block's
    input) where ``base_keeps_input`` (bitsandbytes' 8-bit matmul), and returns fp32 uncast (peft's ``lora/bnb.py`` under autocast:
    its head is the product by ``scaling``'s gradient alone)."""
    act_bytes, adapter_bytes, _ = byte_sizes
    out = next((a for a in adapters if on_module(a) and on_mlp_output(a)), None)
    if out is None or (fp32_input and not out.dora):
        return 0
    size_in, size_out = tokens * out.module.in_features, tokens * out.module.out_features
    gelu = next((t for t in mlp_terms if t.role is TermRole.GELU_NEW), None)
    x_bytes = gelu.bytes // (gelu.tensors * size_in) if gelu is not None else act_bytes
    unsaved, dropped = _dropout_locals(size_in, NORM_COMPUTE_BYTES if fp32_input else x_bytes, byte_sizes, autocast,
                                       dropout)
    unsaved += residual + (mlp_input if dropout or act_bytes != adapter_bytes else 0) - (
        size_in * NORM_COMPUTE_BYTES + mlp_input if fp32_input and base_keeps_input else 0)  # the base keeps both
    head = _lora_head(out, tokens, byte_sizes, autocast, uncast=fp32_input)
    if out.dora:
        stop = unsaved + head + _dora_tail(out, tokens, byte_sizes, autocast, dropped if dropout else None)
    else:
        # with dropout, lora_A's forward (the dropout's output beside its copy, lora_B's weight copy not made yet)
        copy = act_bytes * out.rank * out.module.out_features if dropped else 0
        stop = head + unsaved + size_out * act_bytes + max(0, dropped - copy)
    return max(stop, _input_projection_moment(adapters, out, tokens=tokens, residual=residual, mlp_input=mlp_input,
                                              byte_sizes=byte_sizes, autocast=autocast, mlp_terms=mlp_terms,
                                              dropout=dropout) + head)


def _dropout_locals(size_in: int, x_bytes: int, byte_sizes: tuple[int, int, int], autocast: bool,
                    dropout: bool) -> tuple[int, int]:
    """(what of the output projection's input no saved tensor stands for while its adapter runs, the dropout's output
    beside ``lora_A``'s copy of it), ``size_in`` elements each; ``x_bytes``: the input's bytes per element (the
    activations', or fp32 out of GPT-2's ``gelu_new`` under autocast). ``lora_A`` saves what it reads: peft's cast of
    the input to the adapters' dtype (``_cast_input_dtype``; the input itself where that is a no-op) or, with dropout,
    ``dropout(...)`` of it, a new tensor in the adapters' dtype; under autocast, with adapters in another dtype than
    the compute dtype, its 16-bit copy instead. What it does not save is unsaved: the input, the cast, and with a copy
    the dropout's output, alive until ``lora_A`` returns (peft ``Linear.forward``; DoRA's variant keeps it to the end of
    its forward, whose base product reads it)."""
    act_bytes, adapter_bytes, _ = byte_sizes
    cast = x_bytes != adapter_bytes
    copies = autocast and adapter_bytes != act_bytes
    read_itself = not dropout and not copies  # lora_A saves the tensor it reads: the cast, or the input
    unsaved = (size_in * x_bytes if cast or not read_itself else 0) + (
        size_in * adapter_bytes if cast and not read_itself else 0)
    return unsaved, (size_in * adapter_bytes if dropout and copies else 0)


def _lora_head(out: Adapter, tokens: int, byte_sizes: tuple[int, int, int], autocast: bool,
               uncast: bool = False) -> int:
    """What the backward makes at the output projection's adapter ``out`` before it first unpacks a saved tensor: the
    gradient of ``lora_B(...) * scaling`` and, with adapters in another dtype than the activations and no autocast,
    the add's cast of the output gradient to the base result's dtype, waiting for the base's node (the cast of
    ``result.to(torch_result_dtype)`` is freed once the product's node has read it: a trace of GPT-NeoX at pure bf16
    holds the two); DoRA's head is :func:`~memplan.estimate.adapter_acts.dora_output_backward`'s (``uncast``: on DoRA's
    fp32 stream, :func:`~memplan.estimate.adapter_acts.dora_head`)."""
    act_bytes, adapter_bytes, _ = byte_sizes
    if out.dora:
        return dora_head(out, tokens, act_bytes=act_bytes, adapter_bytes=adapter_bytes, uncast=uncast)
    lora_bytes = act_bytes if autocast else adapter_bytes
    return tokens * out.module.out_features * (lora_bytes + (act_bytes if lora_bytes != act_bytes else 0))


def _input_projection_moment(adapters: tuple[Adapter, ...], out: Adapter, *, tokens: int, residual: int,
                             mlp_input: int, byte_sizes: tuple[int, int, int], autocast: bool,
                             mlp_terms: Sequence[Term], dropout: bool = False) -> int:
    """The recomputed forward inside peft's ``Linear.forward`` of the MLP's last input projection carrying a LoRA
    adapter (``dense_h_to_4h``, ``up_proj``, ``c_fc``), beyond the layer's saved tensors, without the head: the base
    result (activations' dtype), ``lora_B``'s output and its product by ``scaling`` (the adapters' dtype without
    autocast: peft keeps the adapters in fp32 at pure 16 bits; or, at the add, the product and the sum in the wider
    dtype), the MLP block's input and peft's cast of it (where that cast is not a no-op), the residual's partial sum;
    less what the block saves later: the activation's saved tensors not made yet (a gated MLP's gate output and
    ``act(gate)`` come before ``up_proj``), the output projection's saved tensors and its adapter's (``lora_A``'s
    input, ``lora_B``'s, DoRA's results). 0 where no such adapter (or a DoRA one: its own forward) is there."""
    ups = [a for a in adapters if a.module.name.rpartition(".")[2] in MLP_INPUT_LINEARS and on_module(a)]
    if not ups or ups[-1].dora:
        return 0
    up, (act_bytes, adapter_bytes, _) = ups[-1], byte_sizes
    lora_bytes = act_bytes if autocast else adapter_bytes
    size_out = tokens * up.module.out_features
    made = size_out * (act_bytes + max(2 * lora_bytes, lora_bytes + max(act_bytes, lora_bytes)))
    if dropout:
        made += mlp_input + (tokens * up.module.in_features * adapter_bytes if act_bytes != adapter_bytes else 0)
    elif act_bytes != adapter_bytes:
        made += mlp_input + (tokens * up.module.in_features * adapter_bytes if autocast else 0)
    later = tokens * out.rank * lora_bytes + (DROPOUT_MASK_BYTES * tokens * out.module.in_features if dropout else 0)
    for t in mlp_terms:
        if t.role is TermRole.MLP_FC1:
            later += t.bytes // 3 if t.tensors == 3 and up.module.name.rpartition(".")[2] == "up_proj" else t.bytes
        elif t.role in _SAVED_AFTER_FC1:
            later += t.bytes
    return residual + made - later


#: The MLP's saved tensors made after its activation's input: the ``gelu_new`` intermediates, the output projection's
#: input (a trained one's) and its adapter's ``lora_A`` input and DoRA results.
_SAVED_AFTER_FC1 = SAVED_BY_OUTPUT_PROJECTION | {TermRole.GELU_NEW}


def _dora_tail(a: Adapter, tokens: int, byte_sizes: tuple[int, int, int], autocast: bool,
               dropped: int | None = None) -> int:
    """DoRA's own locals while the recompute ends in peft's ``DoraLinearLayer.forward``, at the worst of two moments
    (:func:`~memplan.estimate.adapter_acts.dora_forward_transient`'s tensors): ``lora_B(lora_A(eye))`` made while the fp32 identity lives, before
    ``lora_A``'s copy of the input, its output and ``lora_result`` (saved tensors not made yet); and the stop, after
    ``(mag_norm_scale - 1) * base_result`` (that product in the fp32 magnitude's dtype), where the locals still hold
    ``lora_weight`` cast to the input's dtype (with the identity's 16-bit copy and ``lora_A``'s output its graph
    keeps) and the base weight cast to it; between them the weight norm's ``weight + scaling * lora_weight`` (two
    ``out x in`` tensors in the input's dtype, the adapters': traces of Llama and GPT-NeoX at fp32 and pure bf16 peak
    there) beside those locals, before ``lora_A``'s output and ``lora_result`` (the step's tensors:
    :func:`~memplan.estimate.adapter_acts.dora_weight_norm`). Without the head (the caller adds it). ``dropped``: with ``--lora-dropout``, the dropout's output
    beside its saved copy (:func:`_dropout_locals`; None without dropout): :func:`_dora_dropout_moments`."""
    act_bytes, adapter_bytes, base_bytes = byte_sizes
    i, o, r = a.module.in_features, a.module.out_features, a.rank
    lora_bytes = act_bytes if autocast else adapter_bytes
    step = dora_weight_norm(a, act_bytes=act_bytes, adapter_bytes=adapter_bytes, base_bytes=base_bytes,
                            autocast=autocast)
    kept = step.kept_eye + step.eye_output
    not_yet = lora_bytes * tokens * (r + o) + (act_bytes * tokens * i if step.eye_copy else 0)
    made = step.eye + step.eye_copy + step.eye_output + step.lora_weight - not_yet
    # lora_weight in the input's (adapters') dtype: its cast, or itself where it is in that dtype already
    stop = kept + step.weights + tokens * o * max(adapter_bytes, act_bytes)
    norm = kept + step.weights + step.scaled - not_yet
    if dropped is None:
        return max(made, stop, norm)
    beside, before, copy = _dora_dropout_moments(a, tokens, byte_sizes, autocast)
    return dropped + beside + max(made - before, norm - before, stop, kept + step.weights + copy)


def _dora_dropout_moments(a: Adapter, tokens: int, byte_sizes: tuple[int, int, int],
                          autocast: bool) -> tuple[int, int, int]:
    """DoRA's forward with dropout (peft ``DoraLinearVariant.forward``: ``base_result=None``, ``F.linear(dropout(x),
    weight)`` made again after ``lora_result``): (what is held beside every moment: the base layer's own result, no
    longer the one DoRA saves, less, without autocast, the saved cast of the base weight, which is the weight-norm
    step's ``weight.to(x.dtype)`` itself; what DoRA saves at ``F.linear``, not made before it: its base result and,
    under autocast, the linear's 16-bit copy of the cast weight; the 16-bit copy autocast makes of the dropped-out input
    for that linear, freed after it). A trace of the Llama toy under bf16-mixed peaks at that linear."""
    act_bytes, adapter_bytes, _ = byte_sizes
    i, o = a.module.in_features, a.module.out_features
    lora_bytes = act_bytes if autocast else adapter_bytes
    weight_cast = lora_bytes * i * o if autocast or act_bytes != lora_bytes else 0
    base_saved = (act_bytes if autocast else adapter_bytes) * tokens * o
    copy = act_bytes * tokens * i if autocast and act_bytes != adapter_bytes else 0
    if autocast:
        return tokens * o * act_bytes, base_saved + weight_cast, copy
    return tokens * o * act_bytes - weight_cast, base_saved, 0
