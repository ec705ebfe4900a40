"""Activations of a fine-tuning job's decoder layers: frozen base linears and peft adapters.

* A frozen linear layer saves nothing new for the backward: its grad-input needs only its weight
  (autograd saves the input of ``linear``/``mm`` only when the weight requires grad), so the GEMM
  inputs the full-training terms count are dropped for frozen layers; bitsandbytes' ``MatMul4Bit``
  saves only the packed weight and dequantizes it again in the backward.
* A LoRA adapter (peft ``tuners/lora/layer.py`` ``Linear.forward``): peft casts the input to the fp32
  adapter dtype (``_cast_input_dtype``), applies ``lora_dropout`` (an ``nn.Identity`` at p = 0), then
  ``lora_B(lora_A(x)) * scaling``. Under ``torch.autocast`` (the hf profile's mixed precision)
  ``lora_A`` casts that input back to 16 bits and saves the copy, and both adapters save 16-bit copies
  of their weights; without autocast ``lora_A`` saves the fp32 input. ``lora_B`` saves ``lora_A``'s
  output (rank wide). Dropout adds its mask (1 byte per element) and, without autocast, its output.
* peft's ``ParamWrapper`` adapters on fused MoE expert parameters and routers (peft's conversion of
  MoE targets for transformers 5) add ``B @ A`` to the weight itself; they are not priced here.
* An adapter inside the attention module (``self_attn``, ``attn``, ``attention``) saves what it saves inside
  that module's forward: where the module is checkpointed (``torch.utils.checkpoint``) the checkpoint keeps
  only the module's inputs and the adapter's tensors are made again in its backward (recompute class ``attn``);
  an adapter of the MLP block keeps its own (``body``).
* DoRA (``tuners/lora/dora.py``): ``(m/||W + BA|| - 1) * base_result + m/||W + BA|| * lora_result``
  also saves the base result and the LoRA result (``out`` wide) for the magnitude's gradient; with
  dropout the base product is recomputed on the dropped-out input and keeps a cast of the weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from memplan.estimate.activations import DROPOUT_MASK_BYTES, ActivationShape, Term
from memplan.estimate.terms import Keep, TermRole
from memplan.model.linears import ATTENTION_MODULES
from memplan.peft.params import Adapter

#: Adapter weights' bytes per element by default (fp32: peft ``autocast_adapter_dtype=True``); a job's own
#: comes from ``--adapter-dtype`` (:func:`memplan.estimate.finetune.adapter_bytes`).
ADAPTER_BYTES = 4


#: Linear layers reading the attention block's input norm (their input needs no gradient in the first
#: layer when the embedding is frozen).
ATTENTION_INPUT_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa",
                                     "c_attn", "query_key_value"})


#: Linear layers reading the MLP block's input norm (a shared input).
MLP_INPUT_LINEARS = frozenset({"gate_proj", "up_proj", "gate_up_proj", "c_fc", "dense_h_to_4h"})
#: Linear layers reading the attention output, which flash/SDPA attention keeps anyway.
ATTENTION_OUTPUT_LINEARS = frozenset({"o_proj", "dense"})


def _shared_input(name: str, module: str, attention: str) -> str | None:
    """The input an adapter shares with its neighbours when peft passes ``x`` on uncast (None: its own)."""
    if name in ATTENTION_INPUT_LINEARS:
        return "attention norm output"
    if name in MLP_INPUT_LINEARS:
        return module.rpartition(".")[0] + " input"
    if (name in ATTENTION_OUTPUT_LINEARS or module.endswith("attn.c_proj")) and attention != "eager":
        return ""  # kept by the attention kernel already (the layer's "output projection input" term)
    return None


#: Linear layers closing a dense MLP block (GPT-2's ``mlp.c_proj`` by its module path).
MLP_OUTPUT_LINEARS = frozenset({"down_proj", "dense_4h_to_h", "fc2"})


def _input_role(adapter: Adapter) -> TermRole:
    """The role of the lora_A input ``adapter`` saves: its own where it sits on the MLP's output projection
    (:mod:`~memplan.estimate.mlp_backward_nodes` frees it at that node)."""
    name = adapter.module.name
    if name.rpartition(".")[2] in MLP_OUTPUT_LINEARS or name.endswith("mlp.c_proj"):
        return TermRole.MLP_FC2_DORA_INPUT if adapter.dora else TermRole.MLP_FC2_ADAPTER_INPUT
    return TermRole.OTHER


def _results_role(adapter: Adapter) -> TermRole:
    """The role of the base and LoRA results DoRA ``adapter`` saves: its own on a dense MLP's linear
    (:mod:`~memplan.estimate.mlp_backward_nodes` frees them at the magnitude's node)."""
    if _input_role(adapter) is TermRole.MLP_FC2_DORA_INPUT:
        return TermRole.MLP_FC2_DORA_RESULTS
    if adapter.module.name.rpartition(".")[2] in MLP_INPUT_LINEARS and in_mlp_block(adapter):
        return TermRole.MLP_FC1_DORA_RESULTS
    return TermRole.OTHER


def adapter_terms(adapters: tuple[Adapter, ...], shape: ActivationShape, *, autocast: bool, dropout: bool,
                  compute_bytes: int, input_needs_grad: bool = True, uncast_input: bool = False,
                  base_keeps_input: bool = False, adapter_bytes: int = ADAPTER_BYTES, bias_bytes: int = 0) -> list[Term]:
    """What the adapters of one decoder layer save for one micro-batch (undivided: TP = 1 assumed).

    ``input_needs_grad=False`` (the first layer, frozen embedding, no checkpointing): adapters reading
    the attention norm's output save no weight copy and no dropout mask (autograd keeps what the
    input's gradient needs only when the input requires grad), and DoRA one scale vector less.
    ``uncast_input``: peft's bitsandbytes layers (``lora/bnb.py``) under CUDA autocast pass ``x`` on
    without the fp32 cast, so ``lora_A`` saves the 16-bit input itself, one tensor for the adapters
    that read the same input (q/k/v, gate/up). ``base_keeps_input`` (with ``uncast_input``): the
    base layer saves that very input already (bitsandbytes' 8-bit matmul), so ``lora_A`` adds nothing.
    ``adapter_bytes``: the adapters' dtype (``--adapter-dtype``); under autocast 16-bit adapters in the
    compute dtype need no weight copy (autocast returns a weight already in its dtype as is).
    ``bias_bytes``: the frozen base's biases' bytes per element (``--frozen-dtype``); DoRA subtracts the bias from
    the base result (``base_result - bias``), which type promotion makes fp32 beside an fp32 bias.
    """
    tokens = shape.seq * shape.micro_batch
    terms: list[Term] = []
    lora_bytes = compute_bytes if autocast else adapter_bytes
    shared: set[str] = set()
    for a in adapters:
        if a.experts > 1 or m_is_parameter(a):
            continue  # peft ParamWrapper: adds B @ A to the weight; not priced (stated in the assumptions)
        m, r, keep = a.module, a.rank, adapter_keep(a)
        name = m.name.rpartition(".")[2]
        start = len(terms)
        grad_in = input_needs_grad or name not in ATTENTION_INPUT_LINEARS
        group = _shared_input(name, m.name, shape.attention) if uncast_input and not dropout else None
        if uncast_input and not dropout and base_keeps_input and grad_in:
            pass  # the base layer's saved input is lora_A's input
        elif group is None:
            terms.append(Term(f"{name} lora_A input ({'16-bit autocast copy' if autocast else 'adapter-dtype copy'})",
                              lora_bytes * tokens * m.in_features, "rep", keep, role=_input_role(a)))
        elif group and group not in shared:
            shared.add(group)
            terms.append(Term(f"{group} (kept by lora_A)", compute_bytes * tokens * m.in_features, "rep", keep))
        if dropout and grad_in:
            terms.append(Term(f"{name} lora dropout mask", DROPOUT_MASK_BYTES * tokens * m.in_features, "rep", keep))
        terms.append(Term(f"{name} lora_B input (lora_A output)", lora_bytes * tokens * r, "rep", keep))
        if autocast and adapter_bytes != compute_bytes:
            # lora_B's copy is always kept (lora_A's output requires grad); lora_A's only when its input does.
            copies = r * m.out_features + (r * m.in_features if grad_in else 0)
            terms.append(Term(f"{name} lora_A/lora_B 16-bit weight copies", compute_bytes * copies, "rep", keep))
        if a.dora:
            terms += _dora_terms(a, tokens, grad_in=grad_in, dropout=dropout, autocast=autocast, bias_bytes=bias_bytes,
                                 byte_sizes=(compute_bytes, lora_bytes, adapter_bytes), keep=keep)
        if name in ATTENTION_INPUT_LINEARS:
            terms[start:] = [replace(t, role=TermRole.ATTENTION_INPUT_ADAPTER) for t in terms[start:]]
    return terms


def _dora_terms(a: Adapter, tokens: int, *, grad_in: bool, dropout: bool, autocast: bool, bias_bytes: int,
                byte_sizes: tuple[int, int, int], keep: Keep) -> list[Term]:
    """What DoRA saves beside LoRA's tensors for adapter ``a`` (``byte_sizes``: the compute dtype's, lora_A/lora_B's
    tensors' and the adapters' bytes per element): weight_norm (fp32, kept by magnitude / weight_norm), the scale
    and scale - 1 (fp32), the base result and lora_B's result (adapter dtype) kept by the two products. With dropout
    peft recomputes the base product on the dropped-out input (``F.linear(x, W.to(x.dtype))``): its result is in the
    adapter dtype without autocast, and the linear keeps the cast weight. ``keep``: the terms' keep class (which
    checkpoint, if any, makes them again: :func:`adapter_keep`)."""
    compute_bytes, lora_bytes, adapter_bytes = byte_sizes
    m, name = a.module, a.module.name.rpartition(".")[2]
    scales = 3 if grad_in else 2
    base_bytes = adapter_bytes if dropout and not autocast else compute_bytes
    if m.bias and not dropout:
        base_bytes = max(base_bytes, bias_bytes)
    terms = [Term(f"{name} DoRA weight norm and scales", 4 * scales * m.out_features, "rep", keep),
             Term(f"{name} DoRA base and LoRA results (magnitude gradient)",
                  (base_bytes + lora_bytes) * tokens * m.out_features, "rep", keep, role=_results_role(a))]
    # (fp32 without autocast: the weight already has x's dtype, no cast)
    if dropout and grad_in and (autocast or compute_bytes != lora_bytes):
        terms.append(Term(f"{name} DoRA base weight cast for the dropped-out input",
                          lora_bytes * m.in_features * m.out_features, "rep", keep))
    return terms


def dora_forward_transient(adapters: tuple[Adapter, ...], *, autocast: bool, compute_bytes: int,
                           base_bytes: int, tokens: int, adapter_bytes: int = ADAPTER_BYTES) -> int:
    """Peak of the temporaries peft's DoRA forward allocates for the largest adapted linear of a layer.

    ``DoraLinearLayer.forward`` (peft ``tuners/lora/dora.py``) rebuilds the adapted weight on every
    call: ``lora_B(lora_A(eye(in)))`` — an fp32 ``in x in`` identity (under autocast also its 16-bit
    copy, which ``lora_A``'s graph keeps while the result lives; without autocast the graph keeps the
    identity itself), autocast's copies of the two adapter weights, ``lora_A``'s ``in x r`` output and an
    ``in x out`` product —, the product and the base weight cast to the fp32 input's dtype, then
    ``weight + scaling * lora_weight`` (two fp32 ``out x in`` tensors) for the norm. All of it beside the
    layer's input cast to the adapters' dtype (``_cast_input_dtype``, ``tokens x in``: peft casts it before
    the DoRA call and frees it once ``lora_A`` has read it), which no saved tensor stands for.
    ``base_bytes``: element size of the base weight as the layer holds it (a quantized base is
    dequantized to the compute dtype first).
    """
    worst = 0
    x_bytes = adapter_bytes  # peft casts the input to the adapters' dtype
    for a in adapters:
        if not a.dora or a.experts > 1 or m_is_parameter(a):
            continue
        i, o, r = a.module.in_features, a.module.out_features, a.rank
        eye, eye_copy = adapter_bytes * i * i, (compute_bytes * i * i if autocast and compute_bytes != adapter_bytes else 0)
        kept_eye = eye_copy or eye
        product = (compute_bytes if autocast else adapter_bytes) * i * o
        product_cast = x_bytes * i * o if product != x_bytes * i * o else 0
        weight_cast = x_bytes * i * o if base_bytes != x_bytes else 0
        combined = kept_eye + (product_cast or product) + weight_cast
        # the input's cast, and under autocast the adapter weights' copies with lora_A's output in the compute dtype
        beside = x_bytes * tokens * i if compute_bytes != x_bytes else 0
        small = (compute_bytes * r * (2 * i + o) if eye_copy else adapter_bytes * r * i)
        worst = max(worst,
                    beside + eye + eye_copy + small + product,  # lora_B's output while the identity lives
                    beside + kept_eye + product + product_cast,  # the cast of the product
                    beside + combined + 2 * x_bytes * i * o)  # scaling * lora_weight and the sum, for the norm
    return worst


def dora_forward_before_output(adapters: tuple[Adapter, ...], **sizes: int | bool) -> int:
    """:func:`dora_forward_transient` (``sizes``: its keyword arguments) of the adapters but the one on the MLP's output
    projection: in a recomputed layer whose recompute stops inside that one (:func:`lora_recompute_tail` prices its
    DoRA forward, the stop's, with the tensors made by then), the others' forwards run earlier, beside no more of
    the layer's saved tensors than those the layer saves in all."""
    return dora_forward_transient(tuple(a for a in adapters if _input_role(a) is TermRole.OTHER), **sizes)  # type: ignore[arg-type]


def dora_output_backward(adapters: tuple[Adapter, ...], *, last_linear: str, tokens: int, compute_bytes: int,
                         adapter_bytes: int = ADAPTER_BYTES) -> int:
    """What the backward of a checkpointed layer whose last linear (``last_linear``, its name in the layer) carries
    DoRA makes before the layer's recompute starts.

    peft's ``Linear.forward`` adds DoRA's result (``lora_magnitude_vector``, computed in the adapters' dtype) to
    the base result and casts the sum back (``result.to(torch_result_dtype)``); DoRA's result ends with
    ``mag_norm_scale * lora_result * scaling``, a product by a Python float that saves nothing. Autograd runs
    those nodes first: the cast's backward makes the output gradient in the adapters' dtype, the add's backward
    casts it to the base result's dtype, and the product by ``scaling`` makes its own; only the next node
    unpacks a tensor saved inside the checkpoint, which starts the recompute, so the three stay beside the whole
    recomputed forward. With adapters in the compute dtype the casts are no-ops: the product alone."""
    for a in adapters:
        if a.dora and a.experts == 1 and not m_is_parameter(a) and a.module.name.endswith("." + last_linear):
            size = tokens * a.module.out_features
            casts = size * (adapter_bytes + compute_bytes) if adapter_bytes != compute_bytes else 0
            return casts + size * adapter_bytes
    return 0


def lora_recompute_tail(adapters: tuple[Adapter, ...], *, tokens: int, residual: int, mlp_input: int,
                        byte_sizes: tuple[int, int, int], autocast: bool, mlp_terms: Sequence[Term] = (),
                        dropout: bool = False) -> int:
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
    the layer's MLP-block terms (one rank: the tail applies on one tensor-parallel rank without FP8)."""
    act_bytes, adapter_bytes, _ = byte_sizes
    out = next((a for a in adapters if a.experts == 1 and not m_is_parameter(a)
                and _input_role(a) is not TermRole.OTHER), None)
    if out is None:
        return 0
    size_in, size_out = tokens * out.module.in_features, tokens * out.module.out_features
    unsaved, dropped = _dropout_locals(size_in, byte_sizes, autocast, dropout)
    unsaved += residual + (mlp_input if dropout or act_bytes != adapter_bytes else 0)
    head = _lora_head(out, tokens, byte_sizes, autocast)
    if out.dora:
        stop = unsaved + _dora_tail(out, tokens, byte_sizes, autocast, dropped if dropout else None)
    else:
        # with dropout, lora_A's forward (the dropout's output beside its copy, lora_B's weight copy not made yet)
        copy = act_bytes * out.rank * out.module.out_features if dropped else 0
        stop = head + unsaved + size_out * act_bytes + max(0, dropped - copy)
    return max(stop, _input_projection_moment(adapters, out, tokens=tokens, residual=residual, mlp_input=mlp_input,
                                              byte_sizes=byte_sizes, autocast=autocast, mlp_terms=mlp_terms,
                                              dropout=dropout) + head)


def _dropout_locals(size_in: int, byte_sizes: tuple[int, int, int], autocast: bool, dropout: bool) -> tuple[int, int]:
    """(what of the output projection's input no saved tensor stands for while its adapter runs, the dropout's output
    beside ``lora_A``'s copy of it), ``size_in`` elements each. Without dropout: the input and peft's cast of it to the
    adapters' dtype under autocast (``lora_A`` saves a 16-bit copy; without autocast the cast itself), nothing where
    the cast is a no-op (``lora_A`` saves the input). With dropout ``lora_A`` saves ``dropout(x)`` (or, under autocast,
    its 16-bit copy) instead: the input and its cast are both unsaved, and the dropout's output, a new tensor in the
    adapters' dtype, lives beside the copy until ``lora_A`` returns (peft ``Linear.forward`` / DoRA's variant keep it
    to the end of their forward, DoRA's base product reads it)."""
    act_bytes, adapter_bytes, _ = byte_sizes
    cast = act_bytes != adapter_bytes
    if not dropout:
        return (size_in * (act_bytes + (adapter_bytes if autocast else 0)) if cast else 0), 0
    return size_in * (act_bytes + (adapter_bytes if cast else 0)), (size_in * adapter_bytes if cast and autocast else 0)


def _lora_head(out: Adapter, tokens: int, byte_sizes: tuple[int, int, int], autocast: bool) -> int:
    """What the backward makes at the output projection's adapter ``out`` before it first unpacks a saved tensor: the
    gradient of ``lora_B(...) * scaling`` and, with adapters in another dtype than the activations and no autocast,
    the add's cast of the output gradient to the base result's dtype, waiting for the base's node (the cast of
    ``result.to(torch_result_dtype)`` is freed once the product's node has read it: a trace of GPT-NeoX at pure bf16
    holds the two); DoRA's head is :func:`dora_output_backward`'s."""
    act_bytes, adapter_bytes, _ = byte_sizes
    if out.dora:
        return dora_output_backward((out,), last_linear=out.module.name.rpartition(".")[2], tokens=tokens,
                                    compute_bytes=act_bytes, adapter_bytes=adapter_bytes)
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
    ups = [a for a in adapters if a.module.name.rpartition(".")[2] in MLP_INPUT_LINEARS and a.experts == 1]
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
_SAVED_AFTER_FC1 = frozenset({TermRole.GELU_NEW, TermRole.MLP_FC2, TermRole.MLP_FC2_ADAPTER_INPUT,
                              TermRole.MLP_FC2_DORA_INPUT, TermRole.MLP_FC2_DORA_RESULTS})


def _dora_tail(a: Adapter, tokens: int, byte_sizes: tuple[int, int, int], autocast: bool,
               dropped: int | None = None) -> int:
    """DoRA's own locals while the recompute ends in peft's ``DoraLinearLayer.forward``, at the worst of two moments
    (:func:`dora_forward_transient`'s tensors): ``lora_B(lora_A(eye))`` made while the fp32 identity lives, before
    ``lora_A``'s copy of the input, its output and ``lora_result`` (saved tensors not made yet); and the stop, after
    ``(mag_norm_scale - 1) * base_result`` (that product in the fp32 magnitude's dtype), where the locals still hold
    ``lora_weight`` cast to the input's dtype (with the identity's 16-bit copy and ``lora_A``'s output its graph
    keeps) and the base weight cast to it; between them the weight norm's ``weight + scaling * lora_weight`` (two
    ``out x in`` tensors in the input's dtype, the adapters': traces of Llama and GPT-NeoX at fp32 and pure bf16 peak
    there) beside those locals, before ``lora_A``'s output and ``lora_result``. The head
    (:func:`dora_output_backward`) beside all three. ``dropped``: with ``--lora-dropout``, the dropout's output
    beside its saved copy (:func:`_dropout_locals`; None without dropout): :func:`_dora_dropout_moments`."""
    act_bytes, adapter_bytes, base_bytes = byte_sizes
    i, o, r = a.module.in_features, a.module.out_features, a.rank
    lora_bytes = act_bytes if autocast else adapter_bytes
    eye_copy = act_bytes * i * i if autocast and act_bytes != adapter_bytes else 0
    kept = (eye_copy or adapter_bytes * i * i) + lora_bytes * i * r
    head = dora_output_backward((a,), last_linear=a.module.name.rpartition(".")[2], tokens=tokens,
                                compute_bytes=act_bytes, adapter_bytes=adapter_bytes)
    not_yet = lora_bytes * tokens * (r + o) + (act_bytes * tokens * i if eye_copy else 0)
    made = adapter_bytes * i * i + eye_copy + lora_bytes * i * r + lora_bytes * i * o - not_yet
    # lora_weight in the input's (adapters') dtype: its cast, or itself where it is in that dtype already
    weights = adapter_bytes * i * o + (adapter_bytes * i * o if base_bytes != adapter_bytes else 0)
    stop = kept + weights + tokens * o * max(adapter_bytes, act_bytes)
    norm = kept + weights + 2 * adapter_bytes * i * o - not_yet
    if dropped is None:
        return head + max(made, stop, norm)
    beside, before, copy = _dora_dropout_moments(a, tokens, byte_sizes, autocast)
    return head + dropped + beside + max(made - before, norm - before, stop, kept + weights + copy)


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




def adapter_keep(a: Adapter) -> Keep:
    """The recompute class of what ``a`` saves: ``attn`` inside the attention module (a checkpoint of that module
    makes it again), else ``body``."""
    return "attn" if any(part in ATTENTION_MODULES for part in a.module.name.split(".")) else "body"


def in_mlp_block(a: Adapter) -> bool:
    """The adapter wraps a linear of the MLP block (``mlp.*`` in every family :mod:`memplan.model.linears` names,
    a shared expert's too), not the attention block's."""
    return ".mlp." in a.module.name


def m_is_parameter(adapter: Adapter) -> bool:
    """The adapter wraps a parameter (a router's ``gate.weight``), not a module."""
    return adapter.module.name.endswith(".weight")

