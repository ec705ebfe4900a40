"""A saved tensor of a layer as the activation mechanics price it (:class:`Term`), and its region, recompute
class and role (:mod:`memplan.estimate.activations` explains the first two; it re-exports these names).

A term's ``name`` is the human label the breakdown prints; code that treats some terms apart reads the term's
:class:`TermRole`, set where the term is made, never its name (tests/test_structure.py checks it).
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Literal

from memplan.frozen import frozen_dataclass

__all__ = ["EXPERTS_OWN", "Keep", "NORM_TERMS", "NORMALIZED", "ROUTER", "Region", "SAVED_BY_OUTPUT_PROJECTION", "Term", "TermRole"]

Region = Literal["tp", "sp", "rep"]
Keep = Literal["input", "core", "attn", "attn_input", "body", "ckpt_input", "layer_ckpt_input"]


class TermRole(Enum):
    """What a term stands for, for the code that treats it apart (each member names its readers)."""

    #: Nothing reads it apart (the default).
    OTHER = auto()
    #: A pre-norm's (or the final norm's) input: reserved_forward (a block's start), fine_offload (residual
    #: dtype), partial_freeze (frozen blocks).
    NORM_INPUT = auto()
    #: A pre-norm's output, the GEMM input: reserved_forward (the fp32 norm output beside it).
    NORM_OUTPUT = auto()
    #: A pre-norm's output, autocast copies of the other GEMMs: reserved_terms (one tensor per copy),
    #: partial_freeze (trained norm weights).
    NORM_COPIES = auto()
    #: An eager norm's normalized tensor: partial_freeze, finetune (kept for a trained norm weight).
    NORM_NORMALIZED = auto()
    #: Another tensor of a pre-norm (statistics, fp32 copies): partial_freeze (the block's own norm).
    NORM_OTHER = auto()
    #: The post-norms' normalized output: recomputed_tensors, partial_freeze, finetune.
    POST_NORM_NORMALIZED = auto()
    #: An MLA latent norm's normalized tensor: partial_freeze, finetune (:data:`NORMALIZED`).
    LATENT_NORM_NORMALIZED = auto()
    #: The q / kv latent norm's fp32 input copy and 1/rms: partial_freeze (kept only where that latent needs a
    #: gradient, :attr:`~memplan.estimate.partial_freeze.BlockFlow.latents_grad`).
    Q_LATENT_NORM = auto()
    KV_LATENT_NORM = auto()
    #: The per-head q/k norms' fp32 input copies and fp32 normalized tensors (Gemma 3's eager norms):
    #: partial_freeze (among :data:`NORMALIZED`: a frozen norm keeps none of it).
    QK_NORMS_FP32 = auto()
    #: The per-head q/k norms' fp32 1/rms (eager norms): partial_freeze (the share of the factors needing a
    #: gradient, :func:`~memplan.estimate.partial_freeze.qk_norm_share_terms`).
    QK_NORMS_RSTD = auto()
    #: The query, key and value tensors: reserved_terms (one tensor each unless fused).
    QKV = auto()
    #: The per-head q/k norms' saved input and normalized tensor: partial_freeze (frozen blocks).
    QK_NORMS = auto()
    #: The output projection's input: reserved_backward, reserved_mlp_backward, activations' backward transient,
    #: partial_freeze.
    OUTPUT_PROJECTION_INPUT = auto()
    #: A fused attention kernel's own output where the output projection reads a copy of it (heads-first q):
    #: partial_freeze (a frozen output projection keeps the kernel's output, not its input).
    KERNEL_OUTPUT = auto()
    #: A softmax output in the compute dtype (a fused kernel's; GPT-2's eager softmax outside autocast):
    #: activations' backward transient (the eager core).
    SOFTMAX = auto()
    #: Eager softmax's fp32 output: reserved_mlp_backward (its slot), activations' backward transient.
    SOFTMAX_FP32 = auto()
    #: The softmax output cast to the compute dtype: reserved_backward, reserved_mlp_backward, activations.
    SOFTMAX_CAST = auto()
    #: Gemma 2's soft-capped scores: reserved_mlp_backward (its slot), activations' backward transient.
    SOFTCAP_SCORES = auto()
    #: Keys and values repeated per query head (``repeat_kv``): recompute_modules, activations.
    REPEATED_KV = auto()
    #: Keys cast for every query head (the values a view): activations' backward transient (the eager core).
    KEYS_CAST = auto()
    #: gpt-oss's softmax over the scores and the sink column: reserved_forward, reserved_mlp_backward.
    SINK_SOFTMAX = auto()
    #: gpt-oss's row maxima's indices: activations' backward transient (the eager core).
    SINK_ROW_MAX = auto()
    #: The dense MLP's fc1 output: reserved_terms (gate, up, act(gate)), reserved_mlp_backward (slots).
    MLP_FC1 = auto()
    #: The dense MLP's fc2 input: reserved_mlp_backward (its slot).
    MLP_FC2 = auto()
    #: GPT-2's eager gelu_new intermediates of the dense MLP: frozen_mlp_backward (not walked), mlp_backward_nodes.
    GELU_NEW = auto()
    #: The lora_A input an adapter on the dense MLP's output projection saves: mlp_backward_nodes (its node frees it).
    MLP_FC2_ADAPTER_INPUT = auto()
    #: ... where that adapter is DoRA's (its magnitude's backward is not walked): mlp_backward_nodes.
    MLP_FC2_DORA_INPUT = auto()
    #: The base and LoRA results a DoRA adapter on the dense MLP's output projection saves for its magnitude's
    #: gradient, and those of DoRA adapters on its input projections: mlp_backward_nodes (the magnitude's node frees
    #: them), adapter_acts (the recompute's moment inside an input projection).
    MLP_FC2_DORA_RESULTS = auto()
    MLP_FC1_DORA_RESULTS = auto()
    #: The shared expert's fc2 input: layer_costs (kept on an 8-bit base, whose shared expert is quantized).
    SHARED_EXPERT_FC2 = auto()
    #: The MLP norm output's autocast copies for the shared expert's GEMMs and gate: layer_costs (kept on an 8-bit
    #: base), partial_freeze (among :data:`NORM_TERMS`).
    SHARED_EXPERT_NORM_COPIES = auto()
    #: The dropout mask of the MLP's residual: ep_overlap (the experts' side).
    MLP_RESIDUAL_DROPOUT = auto()
    #: A router's tensor (:data:`ROUTER`): cuda_graphs (outside the captured experts).
    ROUTER_OTHER = auto()
    #: HF routers' fp32 softmax scores: moe_freeze (routing-weight gradient only), cuda_graphs.
    ROUTER_SCORES = auto()
    #: Megatron's routing indices and probabilities: cuda_graphs (``moe_preprocess``).
    ROUTING_INDICES = auto()
    #: The tokens dispatched to the experts: ep_overlap, moe_freeze, reserved_experts_backward.
    DISPATCHED_TOKENS = auto()
    #: gpt-oss's sorted expert ids indexing the bias rows: moe_freeze (the experts' own).
    SORTED_BIAS_IDS = auto()
    #: The expert outputs the weighted combine keeps: ep_overlap, moe_freeze, reserved_experts_backward.
    EXPERT_OUTPUTS = auto()
    #: The routed experts' fc1 output: reserved_experts_backward (its slot), :data:`EXPERTS_OWN`.
    EXPERT_FC1 = auto()
    #: gpt-oss's clamped SwiGLU, in forward order: reserved_experts_backward (slots), :data:`EXPERTS_OWN`.
    CLAMPED_GATE = auto()
    CLAMPED_SIGMOID = auto()
    CLAMPED_PRODUCT = auto()
    CLAMPED_UP_PLUS_ONE = auto()
    #: The routed experts' fc2 input: reserved_experts_backward (its slot), :data:`EXPERTS_OWN`.
    EXPERT_FC2 = auto()
    #: Another tensor of the routed experts' own: :data:`EXPERTS_OWN`.
    EXPERT_OTHER = auto()
    #: What an adapter on an attention input projection (q, k, v) saves, among the MLP block's terms of a fine-tuning
    #: role: activations.softmax_backward_bytes (alive at the softmax backward: its linear's backward comes after).
    ATTENTION_INPUT_ADAPTER = auto()
    #: ... the one of them that is the attention module's input itself (the pre-norm's output), which peft passes on
    #: uncast to the q/k/v adapters' lora_A (fp32 adapters on fp32 activations; one tensor for the three):
    #: activations.recomputed_forward_transient (not a tensor apart from what the layer saves).
    ATTENTION_MODULE_INPUT = auto()


#: What the adapters on the attention input projections save (:data:`TermRole.ATTENTION_INPUT_ADAPTER`).
ATTENTION_ADAPTER_TERMS = frozenset({TermRole.ATTENTION_INPUT_ADAPTER, TermRole.ATTENTION_MODULE_INPUT})


#: A pre-norm's terms (partial_freeze: the block's own norm).
NORM_TERMS = frozenset({TermRole.NORM_INPUT, TermRole.NORM_OUTPUT, TermRole.NORM_COPIES, TermRole.NORM_NORMALIZED,
                        TermRole.NORM_OTHER, TermRole.SHARED_EXPERT_NORM_COPIES})
#: Norms' normalized tensors, kept for a trained norm weight's gradient (partial_freeze, finetune).
NORMALIZED = frozenset({TermRole.NORM_NORMALIZED, TermRole.POST_NORM_NORMALIZED, TermRole.LATENT_NORM_NORMALIZED,
                        TermRole.QK_NORMS_FP32})
#: The router's tensors (cuda_graphs).
ROUTER = frozenset({TermRole.ROUTER_OTHER, TermRole.ROUTER_SCORES})
#: What the routed experts' own modules save (their GEMMs' and activation's tensors; moe_freeze, ep_overlap).
EXPERTS_OWN = frozenset({TermRole.EXPERT_FC1, TermRole.CLAMPED_GATE, TermRole.CLAMPED_SIGMOID,
                         TermRole.CLAMPED_PRODUCT, TermRole.CLAMPED_UP_PLUS_ONE, TermRole.EXPERT_FC2,
                         TermRole.EXPERT_OTHER})


@frozen_dataclass
class Term:
    name: str
    bytes: int
    region: Region
    keep: Keep
    #: Input of a linear layer's GEMM: saved in FP8 (1 byte per element) under FP8 training.
    gemm_input: bool = False
    #: Which checkpointable part of a Megatron layer saves it (:data:`memplan.estimate.recompute_modules.
    #: SITES_DROPPED_BY` says which ``--recompute-modules`` drop each); "" for none.
    site: str = ""
    #: What it stands for, for the code that treats it apart (:class:`TermRole`); the name is only printed.
    role: TermRole = TermRole.OTHER
    #: How many tensors of equal size the term lumps together (a norm output's autocast copies, one per GEMM; a
    #: gated MLP's gate, up and ``act(gate)`` outputs; GPT-2's ``gelu_new`` intermediates): one of them is
    #: ``bytes // tensors``. :func:`memplan.estimate.reserved_terms.term_tensors` lays them out apart.
    tensors: int = 1
    #: Under ``save_on_cpu`` (:mod:`memplan.estimate.offloaded_backward`): how many of those tensors the one
    #: backward node that saved the most of them brings back (a product of two of them saves both factors).
    node_saves: int = 1
    #: ... and how many tensors of that size its worst node holds beside them: the gradient coming in and
    #: those it makes (one per saved factor of a product; an op's own temporaries).
    node_made: int = 2
    #: Where the layer's saved tensors stay on the GPU (:func:`memplan.estimate.activations.backward_transient_bytes`):
    #: how many tensors of that size the term's first backward node holds beside them, the gradient coming in and
    #: those it makes (two for a product of two of its tensors). Autograd frees a node's saved tensors once it has
    #: run, so each later node of the term holds no more above what is left (GPT-2's ``gelu_new``: its last product
    #: holds three fp32 tensors; its pow, five, after three of its saved tensors are gone).
    first_made: int = 2


#: What the MLP's output projection and its adapters save: made after a recompute that stops before them.
SAVED_BY_OUTPUT_PROJECTION = frozenset({TermRole.MLP_FC2, TermRole.MLP_FC2_ADAPTER_INPUT, TermRole.MLP_FC2_DORA_INPUT,
                                        TermRole.MLP_FC2_DORA_RESULTS})
