"""Megatron-LM CUDA graphs (``--cuda-graph-impl``, ``--cuda-graph-modules``): what captured graphs keep.

What the sources say (Megatron-LM d98e8a6, Transformer Engine d0067d0):

* **One private pool, captured in execution order.** The local implementation gives every
  ``_CudaGraphRunner`` the one ``CudaGraphManager.global_mempool`` and captures all graphs at the end
  of the first step in the order they ran (megatron/core/transformer/cuda_graphs.py
  ``_CudagraphGlobalRecord.create_cudagraphs``: "create cudagraphs in execution order, which allows
  multiple cudagraphs to share a single memory pool"). Transformer Engine's ``make_graphed_callables``
  (transformer_engine/pytorch/graph.py) captures every (layer, micro-batch) forward and backward graph
  into one ``graph_pool_handle()`` following Megatron's schedule ``_order``. A pool shared in replay
  order behaves like an allocator that runs only the captured regions: its size is the most the
  captured regions hold at once over the step, and it stays reserved for the run, apart from the
  caching allocator's ordinary pool (eager tensors never reuse it, nor it theirs).
* **Graphs per micro-batch.** Without pipeline parallelism one graph pair per layer is reused
  (``CudaGraphManager.__init__``: ``reuse_cudagraphs = pp == 1``; ``TECudaGraphHelper.
  _get_cuda_graph_input_data``: one micro-batch captured when pp is 1); with it, one pair per layer
  and micro-batch of the step. The pool holds the captured tensors of the micro-batches in flight,
  as the eager schedule does, because replay follows the capture order.
* **Static inputs.** ``TECudaGraphHelper._get_sample_arguments`` allocates each captured layer's
  static inputs per micro-batch, reusing them only once that micro-batch's backward is done, so one
  set per captured layer and micro-batch in flight: ``hidden_states`` ``[s/cp (/tp under sequence
  parallelism), b, h]`` in bf16 (megatron/core/transformer/module.py ``get_layer_static_inputs``) and,
  when attention is captured, a boolean causal mask ``[b, 1, s/cp, s]`` (transformer_layer.py
  ``get_layer_static_inputs``). TE's replay copies the previous graph's output into them
  (``Graphed.forward``), so they are a second copy beside the pool's. The local implementation
  chains a layer's static output into the next graph's input (``create_fwd_graph``:
  ``fwd_cudagraph_buffer``), so only the first captured layer of a chunk gets a fresh pool buffer per
  micro-batch, beside the eager tensor the schedule keeps for the backward; a region whose input comes
  from eager code copies it into its own buffer and the eager tensor is released.
* **Full iteration.** ``FullCudaGraphWrapper`` (megatron/core/full_cuda_graph.py) captures the whole
  forward-backward (not the optimizer step) into one pool, and ``StaticBufferLoader`` keeps every
  micro-batch's batch in static buffers for the run.

Known limitations: the driver's own memory for graph executables, the rotary-embedding cache shared by
the TE graphs, MTP layers' graphs and the optimizer's CUDA graph (``--optimizer-cuda-graph``) are not
priced; partial scopes price the captured block's saved tensors as :mod:`memplan.estimate.activations`
lists them and its backward as its worst term's first node (the rule of ``backward_transient_bytes``); a
checkpoint's extra inputs under ``--recompute-modules`` are left with the eager part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import field

from memplan.estimate.activations import (
    KEPT_BY,
    ActivationShape,
    Term,
    divided,
    first_node_bytes,
    layer_terms_by_block,
)
from memplan.estimate.layout import StageLayout
from memplan.estimate.recompute_modules import term_site
from memplan.estimate.terms import ROUTER, TermRole
from memplan.frozen import frozen_dataclass
from memplan.job import CudaGraphs
from memplan.model.spec import LayerSpec, ModelSpec

#: ``get_layer_static_inputs`` makes ``hidden_states`` in bf16 whatever the training precision.
STATIC_HIDDEN_BYTES = 2
#: Its causal attention mask is boolean: one byte per element.
STATIC_MASK_BYTES = 1


def captured_terms(layer: LayerSpec, shape: ActivationShape, modules: tuple[str, ...]) -> list[Term]:
    """The terms of ``layer`` inside its captured regions (``modules`` empty: the whole layer).

    ``attn`` captures ``TransformerLayer._forward_attention`` (the attention block); ``mlp`` a dense
    layer's ``_forward_mlp``; ``moe`` an MoE layer's; ``moe_router`` the pre-MLP norm, the router and
    the shared experts (not overlapped with EP communication); ``moe_preprocess`` the dispatcher's
    preprocessing (the routing indices and probabilities).
    """
    attention, rest = layer_terms_by_block(layer, shape)
    if not modules:
        return attention + rest
    out = list(attention) if "attn" in modules else []
    if layer.moe is None:
        return out + (list(rest) if "mlp" in modules else [])
    if "moe" in modules:
        return out + list(rest)
    for term in rest:
        router = term.site == "pre_mlp_norm" or term.role in ROUTER or term.site == "shared_experts"
        if ("moe_router" in modules and router) or (
                "moe_preprocess" in modules and term.role is TermRole.ROUTING_INDICES):
            out.append(term)
    return out


def captured_layer_bytes(layer: LayerSpec, shape: ActivationShape, modules: tuple[str, ...],
                         kept_classes: Iterable[str], dropped: frozenset[str]) -> tuple[int, int]:
    """(saved bytes, backward working set) of ``layer``'s captured regions under a partial scope: the
    captured terms its recompute keeps, and the most one captured term's first backward node holds (the
    incoming and the produced gradients, :func:`memplan.estimate.activations.backward_transient_bytes`)."""
    kept_by = frozenset(kept_classes)
    terms = captured_terms(layer, shape, modules)
    kept = sum(divided(t, shape) for t in terms if t.keep in kept_by and term_site(t) not in dropped)
    return kept, max((first_node_bytes(t, shape) for t in terms), default=0)


def hidden_state_bytes(shape: ActivationShape, elem_bytes: int) -> int:
    """One ``[s/cp (/tp under sequence parallelism), b, h]`` hidden-state tensor."""
    return shape.local_tokens * shape.hidden * elem_bytes


def te_static_input_bytes(shape: ActivationShape, *, cp: int, attention_captured: bool) -> int:
    """Transformer Engine's static inputs of one captured layer for one micro-batch: bf16 hidden states
    and, when attention is captured, the boolean ``[b, 1, s/cp, s]`` causal mask."""
    mask = shape.micro_batch * shape.seq * shape.seq * cp * STATIC_MASK_BYTES if attention_captured else 0
    return hidden_state_bytes(shape, STATIC_HIDDEN_BYTES) + mask


def graph_count(impl: str, captured_layers: int, *, pp: int, num_microbatches: int) -> int:
    """Forward and backward graphs one rank of a stage captures."""
    if impl == "none":
        return 0
    if impl == "full_iteration":
        return 1
    return 2 * captured_layers * (num_microbatches if pp > 1 else 1)


def describe(impl: str, modules: tuple[str, ...]) -> str:
    """The assumption line of CUDA graphs."""
    if impl == "full_iteration":
        return ("CUDA graphs (full_iteration): the whole forward-backward is one graph whose private pool keeps the "
                "step's most activation/logit/temporary memory for the run (the optimizer step runs beside it), and "
                "every micro-batch's batch sits in static buffers (cuda_graph_pool_bytes, cuda_graph_static_bytes)")
    scope = ", ".join(modules) if modules else "whole decoder layers"
    statics = ("TE's static inputs per captured layer and micro-batch in flight (bf16 hidden states"
               + (", a boolean causal mask" if not modules or "attn" in modules else "") + ") outside the pool"
               if impl == "transformer_engine" else
               "one static input buffer per chunk and micro-batch in flight (later layers chain the graphs' "
               "buffers)" if not modules else "static inputs replacing the eager ones (no extra)")
    return (f"CUDA graphs ({impl}; {scope}): captured regions allocate from one private pool, captured in "
            "execution order, that keeps for the run the most they hold at once (saved tensors of every "
            "micro-batch in flight and the worst captured backward); eager memory cannot reuse it, so the optimizer "
            f"step and the loss run beside it; {statics}; graphs' driver memory not priced")


#: ``(layer index, kept, backward worst, recomputed) -> (captured kept, captured backward)``.
LayerCapture = Callable[[int, int, int, bool], tuple[int, int]]


def layer_capture(model: ModelSpec, graphs: CudaGraphs, shape: ActivationShape, *, kept_classes: Iterable[str],
                  dropped: frozenset[str]) -> LayerCapture:
    """What a layer's captured regions hold: the whole layer's figures without ``--cuda-graph-modules``,
    else :func:`captured_layer_bytes` under the job's recompute (full recompute: only the layer input)."""
    modules = graphs.module_names
    if graphs.impl == "local" and "moe_router" in modules and "moe_preprocess" not in modules:
        modules += ("moe_preprocess",)  # the local implementation captures both (transformer_config.py)
    kept = frozenset(kept_classes)

    def captured(index: int, keep: int, worst: int, recomputed: bool) -> tuple[int, int]:
        if not modules:
            return keep, worst
        layer = model.layers[index]
        if not captured_terms(layer, shape, modules):
            return 0, 0
        return captured_layer_bytes(layer, shape, modules, KEPT_BY["full"] if recomputed else kept, dropped)
    return captured


@frozen_dataclass
class GraphMemory:
    """CUDA-graph memory of one stage: the private pool, the static buffers beside it, and per candidate
    peak how much of the eager figures they already hold (``captured``)."""

    pool: int = 0
    static: int = 0
    captured: dict[str, int] = field(default_factory=dict)

    def extra_at(self, phase: str) -> int:
        """Bytes the graphs hold at ``phase`` beyond the eager figures: pool and static buffers less what
        of them the eager figures already count then."""
        if not self.pool and not self.static:
            return 0
        return self.pool - self.captured.get(phase, 0) + self.static


def graph_memory(graphs: CudaGraphs, layout: StageLayout, shape: ActivationShape, weighed: dict[str, int],
                 chunk_graph: list[int], chunk_graph_layers: list[int], worst: int, inputs: int, *, cp: int,
                 num_microbatches: int) -> GraphMemory:
    """The stage's pool and static buffers from the ledger's figures: ``weighed`` (per candidate peak:
    activations, logits, temporaries and collective buffers less the gradients not yet made,
    :meth:`memplan.estimate.ledger.Ledger.weighed`) and the batch ``inputs``; per chunk the captured
    saved bytes and captured layers; ``worst`` the worst captured backward."""
    impl = graphs.impl
    if impl == "none" or not layout.layer_indices:
        return GraphMemory()
    if impl == "full_iteration":
        # every phase of the forward-backward runs inside the graph; the optimizer step does not
        captured = {name: held for name, held in weighed.items() if name != "optimizer step"}
        # StaticBufferLoader keeps every micro-batch's batch; the eager figures hold the in-flight ones
        per_microbatch = inputs // max(layout.inflight_microbatches, 1)
        covered = {name: held + inputs for name, held in captured.items()}
        return GraphMemory(pool=max(captured.values()), static=per_microbatch * num_microbatches, captured=covered)
    inflight = layout.inflight_chunks
    layers = sum(chunk_graph[c] for c in inflight)
    static = chain_inputs = 0
    if impl == "local" and not graphs.module_names:
        # a chunk's first graph copies its input into the pool while the schedule keeps the received tensor
        # for the backward (the embedding's output on the first chunk is not kept)
        received = sum(1 for c in inflight if chunk_graph_layers[c] and not (layout.has_embedding and c == 0))
        chain_inputs = received * hidden_state_bytes(shape, shape.act_bytes)
    if impl == "transformer_engine":
        attention = not graphs.module_names or "attn" in graphs.module_names
        static = sum(chunk_graph_layers[c] for c in inflight) * te_static_input_bytes(
            shape, cp=cp, attention_captured=attention)
    held = {"backward": layers + worst, "loss": layers, "forward": layers}
    return GraphMemory(pool=layers + chain_inputs + worst, static=static, captured=held)
