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

from dataclasses import replace

from memplan.estimate.activations import DROPOUT_MASK_BYTES, ActivationShape, Term
from memplan.estimate.terms import Keep, TermRole
from memplan.frozen import frozen_dataclass
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


def feeds_attention(a: Adapter) -> bool:
    """The adapter wraps a linear reading the attention block's input norm (q/k/v), whose output the attention core
    reads."""
    return a.module.name.rpartition(".")[2] in ATTENTION_INPUT_LINEARS


def on_attention_output(a: Adapter) -> bool:
    """The adapter wraps the attention's output projection (``o_proj``, ``dense``, GPT-2's ``attn.c_proj``), which reads
    the attention kernel's output."""
    return a.module.name.rpartition(".")[2] in ATTENTION_OUTPUT_LINEARS or a.module.name.endswith("attn.c_proj")


def _input_role(adapter: Adapter) -> TermRole:
    """The role of the lora_A input ``adapter`` saves: its own where it sits on the MLP's output projection
    (:mod:`~memplan.estimate.mlp_backward_nodes` frees it at that node)."""
    name = adapter.module.name
    if name.rpartition(".")[2] in MLP_OUTPUT_LINEARS or name.endswith("mlp.c_proj"):
        return TermRole.MLP_FC2_DORA_INPUT if adapter.dora else TermRole.MLP_FC2_ADAPTER_INPUT
    return TermRole.OTHER


def on_mlp_output(adapter: Adapter) -> bool:
    """The adapter wraps a dense MLP's output projection (``down_proj``, ``dense_4h_to_h``, ``fc2``, GPT-2's
    ``mlp.c_proj``)."""
    return _input_role(adapter) is not TermRole.OTHER


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
                  base_keeps_input: bool = False, adapter_bytes: int = ADAPTER_BYTES, bias_bytes: int = 0,
                  mlp_input_needs_grad: bool = True, input_bytes: int = 0,
                  output_inputs_grad: tuple[bool, bool] = (True, True)) -> list[Term]:
    """What the adapters of one decoder layer save for one micro-batch (undivided: TP = 1 assumed).

    ``input_needs_grad``, ``mlp_input_needs_grad``, ``output_inputs_grad``: what of the layer's linears' inputs needs a
    gradient (:func:`_reads_gradient`).
    ``uncast_input``: peft's bitsandbytes layers (``lora/bnb.py``) under CUDA autocast pass ``x`` on
    without the fp32 cast, so ``lora_A`` saves the 16-bit input itself, one tensor for the adapters
    that read the same input (q/k/v, gate/up). ``base_keeps_input`` (with ``uncast_input``): the
    base layer saves that very input already (bitsandbytes' 8-bit matmul), so ``lora_A`` adds nothing.
    ``adapter_bytes``: the adapters' dtype (``--adapter-dtype``); under autocast 16-bit adapters in the
    compute dtype need no weight copy (autocast returns a weight already in its dtype as is).
    ``bias_bytes``: the frozen base's biases' bytes per element (``--frozen-dtype``); DoRA subtracts the bias from
    the base result (``base_result - bias``), which type promotion makes fp32 beside an fp32 bias.
    ``input_bytes``: the adapters' input's bytes per element where it is wider than the compute dtype (a quantized
    base's fp32 stream, :mod:`~memplan.estimate.dora_fp32_stream`): DoRA's base result, bitsandbytes' output in that
    dtype, is saved in it.
    """
    tokens = shape.seq * shape.micro_batch
    terms: list[Term] = []
    lora_bytes = compute_bytes if autocast else adapter_bytes
    shared: set[str] = set()
    for a in adapters:
        if not on_module(a):
            continue  # peft ParamWrapper: adds B @ A to the weight; not priced (stated in the assumptions)
        m, r, keep = a.module, a.rank, adapter_keep(a)
        name = m.name.rpartition(".")[2]
        start = len(terms)
        grad_in = _reads_gradient(a, (input_needs_grad, mlp_input_needs_grad, *output_inputs_grad))
        group = _shared_input(name, m.name, shape.attention) if uncast_input and not dropout else None
        if uncast_input and not dropout and base_keeps_input and grad_in:
            pass  # the base layer's saved input is lora_A's input
        elif group is None:
            terms.append(Term(f"{name} lora_A input ({'16-bit autocast copy' if autocast else 'adapter-dtype copy'})",
                              lora_bytes * tokens * m.in_features, "rep", keep, role=_input_role(a)))
        elif group and group not in shared:
            shared.add(group)
            terms.append(Term(f"{group} (kept by lora_A)", compute_bytes * tokens * m.in_features, "rep", keep,
                              role=TermRole.ATTENTION_MODULE_INPUT if name in ATTENTION_INPUT_LINEARS else TermRole.OTHER))
        if dropout and grad_in:
            terms.append(Term(f"{name} lora dropout mask", DROPOUT_MASK_BYTES * tokens * m.in_features, "rep", keep))
        terms.append(Term(f"{name} lora_B input (lora_A output)", lora_bytes * tokens * r, "rep", keep))
        if autocast and adapter_bytes != compute_bytes:
            # lora_B's copy is always kept (lora_A's output requires grad); lora_A's only when its input does.
            copies = r * m.out_features + (r * m.in_features if grad_in else 0)
            terms.append(Term(f"{name} lora_A/lora_B 16-bit weight copies", compute_bytes * copies, "rep", keep))
        if a.dora:
            terms += _dora_terms(a, tokens, grad_in=grad_in, dropout=dropout, autocast=autocast, bias_bytes=bias_bytes,
                                 input_bytes=input_bytes,
                                 byte_sizes=(compute_bytes, lora_bytes, adapter_bytes), keep=keep)
        if name in ATTENTION_INPUT_LINEARS:
            terms[start:] = [t if t.role is TermRole.ATTENTION_MODULE_INPUT else
                             replace(t, role=TermRole.ATTENTION_INPUT_ADAPTER) for t in terms[start:]]
    return terms


def _reads_gradient(a: Adapter, grads: tuple[bool, bool, bool, bool]) -> bool:
    """The input of the linear adapter ``a`` wraps needs a gradient, ``grads`` saying whether (the attention block's
    input, the MLP block's input, the attention output projection's input, the MLP output projection's input) does.
    Where it does not (the first layer, frozen embedding, no checkpointing; a parallel-residual layer's MLP reads the
    layer input: GPT-NeoX's first layer; an output projection with nothing before it in its block needing one) the
    adapter saves no ``lora_A`` weight copy and no dropout mask (autograd keeps what the input's gradient needs only
    when the input requires grad), DoRA one scale vector less, and an 8-bit base keeps no input for ``lora_A`` to
    share (``base_keeps_input`` does not apply)."""
    name = a.module.name.rpartition(".")[2]
    return ((grads[0] or name not in ATTENTION_INPUT_LINEARS)
            and (grads[1] or name not in MLP_INPUT_LINEARS or not in_mlp_block(a))
            and (grads[2] or not on_attention_output(a)) and (grads[3] or not on_mlp_output(a)))


def _dora_terms(a: Adapter, tokens: int, *, grad_in: bool, dropout: bool, autocast: bool, bias_bytes: int,
                byte_sizes: tuple[int, int, int], keep: Keep, input_bytes: int = 0) -> list[Term]:
    """What DoRA saves beside LoRA's tensors for adapter ``a`` (``byte_sizes``: the compute dtype's, lora_A/lora_B's
    tensors' and the adapters' bytes per element): weight_norm (fp32, kept by magnitude / weight_norm), the scale
    and scale - 1 (fp32), the base result and lora_B's result (adapter dtype) kept by the two products. With dropout
    peft recomputes the base product on the dropped-out input (``F.linear(x, W.to(x.dtype))``): its result is in the
    adapter dtype without autocast, and the linear keeps the cast weight. ``keep``: the terms' keep class (which
    checkpoint, if any, makes them again: :func:`adapter_keep`); ``input_bytes``: a wider input's (a quantized base
    returns its input's dtype; with dropout the base product is an autocast ``F.linear``)."""
    compute_bytes, lora_bytes, adapter_bytes = byte_sizes
    m, name = a.module, a.module.name.rpartition(".")[2]
    scales = 3 if grad_in else 2
    base_bytes = adapter_bytes if dropout and not autocast else compute_bytes
    if not dropout:
        base_bytes = max(base_bytes, input_bytes, bias_bytes if m.bias else 0)
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
    identity itself), autocast's copies of the two adapter weights, ``lora_A``'s ``in x r`` output (``lora_B``'s
    graph keeps it while the result lives) and an ``in x out`` product —, the product and the base weight cast to
    the fp32 input's dtype, then ``weight + scaling * lora_weight`` (two fp32 ``out x in`` tensors) for the norm.
    All of it beside one ``tokens x in`` tensor no saved tensor stands for: under autocast the input cast to the
    adapters' dtype (``_cast_input_dtype``: peft casts it before the DoRA call and frees it once ``lora_A`` has
    read it, saving autocast's 16-bit copy); without autocast the linear's own input (``lora_A`` saves the cast,
    made before the step: a trace of a pure bf16 Llama toy with fp32 adapters holds it as an activation there,
    beside the 16-bit input).
    ``base_bytes``: element size of the base weight as the layer holds it (a quantized base is
    dequantized to the compute dtype first).
    """
    worst = 0
    for a in adapters:
        if not module_dora(a):
            continue
        i, o, r = a.module.in_features, a.module.out_features, a.rank
        step = dora_weight_norm(a, act_bytes=compute_bytes, adapter_bytes=adapter_bytes, base_bytes=base_bytes,
                                autocast=autocast)
        # the input's cast, and under autocast the adapter weights' copies with lora_A's output in the compute dtype
        beside = (adapter_bytes if autocast else compute_bytes) * tokens * i if compute_bytes != adapter_bytes else 0
        copies = compute_bytes * r * (i + o) if step.eye_copy else 0
        worst = max(worst,
                    beside + step.eye + step.eye_copy + step.eye_output + copies + step.lora_weight,  # lora_B's output
                    beside + step.kept_eye + step.eye_output + step.lora_weight + step.lora_weight_cast,  # its cast
                    beside + step.kept_eye + step.eye_output + step.weights + step.scaled)  # scaling * it and the sum
    return worst


@frozen_dataclass(kw_only=True)
class DoraWeightNorm:
    """The tensors of the weight-norm step peft's ``DoraLinearLayer.forward`` runs for one adapter (bytes each):
    ``lora_weight = lora_B(lora_A(eye)).T`` (``get_lora_weight``), ``.to(x.dtype)``, the base weight
    ``.to(x.dtype)`` and ``get_weight_norm``'s ``weight + scaling * lora_weight``. ``x`` is the input peft cast to the
    adapters' dtype (``_cast_input_dtype``)."""

    #: The ``in x in`` identity, in the adapters' dtype (``lora_A.weight.dtype``).
    eye: int
    #: Its 16-bit copy under autocast, which ``lora_A``'s graph keeps (0 without autocast or with 16-bit adapters).
    eye_copy: int
    #: ``lora_A``'s ``in x r`` output of the identity (``lora_B`` keeps it).
    eye_output: int
    #: ``lora_B``'s ``in x out`` output: ``lora_weight`` (in the compute dtype under autocast).
    lora_weight: int
    #: ``lora_weight.to(x.dtype)`` where that is not a no-op (0 otherwise).
    lora_weight_cast: int
    #: The base weight cast to ``x``'s dtype where it is held in another (0 otherwise).
    base_cast: int
    #: ``scaling * lora_weight`` and the sum ``weight + ...``: two ``out x in`` tensors in ``x``'s dtype.
    scaled: int

    @property
    def kept_eye(self) -> int:
        """The identity ``lora_A``'s graph keeps while ``lora_weight`` lives: its 16-bit copy, or itself."""
        return self.eye_copy or self.eye

    @property
    def weights(self) -> int:
        """``lora_weight`` in ``x``'s dtype (its cast, or itself) and the base weight in it (its cast, if any)."""
        return (self.lora_weight_cast or self.lora_weight) + self.base_cast


def dora_base_bytes(*, quantized: bool, frozen_bytes: int) -> int:
    """The ``base_bytes`` of :func:`dora_weight_norm`, one rule for every caller: the frozen base weight's bytes per
    element (``frozen_bytes``: ``--frozen-dtype`` or the compute dtype), whose ``.to(x.dtype)`` is a no-op where the
    adapters' dtype is the same; 0 for a quantized base: peft's ``dequantize_module_weight`` (``utils/integrations.py``)
    returns a fresh weight (bitsandbytes' dequantization), which the cast to ``x``'s dtype replaces or keeps: one
    ``out x in`` tensor in ``x``'s dtype either way."""
    return 0 if quantized else frozen_bytes


def dora_weight_norm(a: Adapter, *, act_bytes: int, adapter_bytes: int, base_bytes: int,
                     autocast: bool) -> DoraWeightNorm:
    """The weight-norm step's tensors of DoRA adapter ``a`` (:class:`DoraWeightNorm`): ``act_bytes``, ``adapter_bytes``
    and ``base_bytes`` the activations', the adapters' and the base weight's bytes per element (0: a quantized base,
    dequantized into a fresh tensor: :func:`dora_base_bytes`), ``autocast`` the hf profile's mixed precision."""
    i, o, r = a.module.in_features, a.module.out_features, a.rank
    lora_bytes = act_bytes if autocast else adapter_bytes
    lora_weight = lora_bytes * i * o
    x_weight = adapter_bytes * i * o  # an out x in tensor in x's dtype
    return DoraWeightNorm(eye=adapter_bytes * i * i,
                          eye_copy=act_bytes * i * i if autocast and act_bytes != adapter_bytes else 0,
                          eye_output=lora_bytes * i * r, lora_weight=lora_weight,
                          lora_weight_cast=x_weight if lora_weight != x_weight else 0,
                          base_cast=x_weight if base_bytes != adapter_bytes else 0, scaled=2 * x_weight)


def dora_forward_before_output(adapters: tuple[Adapter, ...], **sizes: int | bool) -> int:
    """:func:`dora_forward_transient` (``sizes``: its keyword arguments) of the adapters but the one on the MLP's output
    projection: in a recomputed layer whose recompute stops inside that one (:func:`lora_recompute_tail` prices its
    DoRA forward, the stop's, with the tensors made by then), the others' forwards run earlier, beside no more of
    the layer's saved tensors than those the layer saves in all."""
    return dora_forward_transient(tuple(a for a in adapters if _input_role(a) is TermRole.OTHER), **sizes)  # type: ignore[arg-type]


def dora_output_backward(adapters: tuple[Adapter, ...], *, last_linear: str, tokens: int, compute_bytes: int,
                         adapter_bytes: int = ADAPTER_BYTES, uncast: bool = False) -> int:
    """What the backward of a checkpointed layer whose last linear (``last_linear``, its name in the layer) carries
    DoRA makes before the layer's recompute starts.

    peft's ``Linear.forward`` adds DoRA's result (``lora_magnitude_vector``, computed in the adapters' dtype) to
    the base result and casts the sum back (``result.to(torch_result_dtype)``); DoRA's result ends with
    ``mag_norm_scale * lora_result * scaling``, a product by a Python float that saves nothing. Autograd runs
    those nodes first: the cast's backward makes the output gradient in the adapters' dtype, the add's backward
    casts it to the base result's dtype, and the product by ``scaling`` makes its own; only the next node
    unpacks a tensor saved inside the checkpoint, which starts the recompute, so the three stay beside the whole
    recomputed forward. With adapters in the compute dtype the casts are no-ops: the product alone; likewise where
    the sum is returned ``uncast`` (:func:`dora_head`)."""
    for a in adapters:
        if module_dora(a) and a.module.name.endswith("." + last_linear):
            return dora_head(a, tokens, act_bytes=compute_bytes, adapter_bytes=adapter_bytes, uncast=uncast)
    return 0


def dora_head(a: Adapter, tokens: int, *, act_bytes: int, adapter_bytes: int, uncast: bool = False) -> int:
    """:func:`dora_output_backward`'s three tensors for DoRA adapter ``a`` (``tokens`` x its ``out`` each): the output
    gradient cast to the adapters' dtype and the add's cast back (where the two dtypes differ), the product by
    ``scaling``'s gradient in the adapters' dtype. ``uncast``: the sum is returned in the adapters' dtype (peft's
    bitsandbytes layers under autocast, on DoRA's fp32 stream: :mod:`~memplan.estimate.dora_fp32_stream`), so
    there is no cast: the product's gradient alone."""
    size = tokens * a.module.out_features
    casts = size * (adapter_bytes + act_bytes) if adapter_bytes != act_bytes and not uncast else 0
    return casts + size * adapter_bytes


def adapter_keep(a: Adapter) -> Keep:
    """The recompute class of what ``a`` saves: ``attn`` inside the attention module (a checkpoint of that module
    makes it again), else ``body``."""
    return "attn" if any(part in ATTENTION_MODULES for part in a.module.name.split(".")) else "body"


def in_mlp_block(a: Adapter) -> bool:
    """The adapter wraps a linear of the MLP block (``mlp.*`` in every family :mod:`memplan.model.linears` names,
    a shared expert's too), not the attention block's."""
    return ".mlp." in a.module.name


def on_module(a: Adapter) -> bool:
    """The adapter wraps one module's linear (peft's LoRA ``Linear``, what these modules price), not a parameter of
    fused experts or a router (peft's ``ParamWrapper``)."""
    return a.experts == 1 and not m_is_parameter(a)


def module_dora(a: Adapter) -> bool:
    """A DoRA adapter on one module's linear (:func:`on_module`): peft's ``DoraLinearLayer``."""
    return a.dora and on_module(a)


def m_is_parameter(adapter: Adapter) -> bool:
    """The adapter wraps a parameter (a router's ``gate.weight``), not a module."""
    return adapter.module.name.endswith(".weight")

