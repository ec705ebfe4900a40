"""A layer's activation terms as the tensors autograd saves, for the reserved-memory schedule (issue 25,
item 8; :mod:`memplan.estimate.reserved_sim`).

Some of :func:`memplan.estimate.activations.layer_terms`' terms count several tensors that a real
forward makes apart, at different ops, and frees apart in the backward; the allocator places each on
its own, so the schedule splits them (a term it does not recognise stays one tensor):

- the MLP's fc1 output: the gate and up projections' outputs (one tensor of both halves when one GEMM
  makes them, ``gate_up_proj``) and, under an eager gated activation, ``act(gate)``, one
  intermediate-sized tensor each (HF's ``act_fn(gate_proj(x)) * up_proj(x)``);
- a norm's output "autocast copies of the other N GEMMs": N tensors, one per linear that casts it;
- "q, k, v": the query, key and value tensors in proportion to their widths (one tensor for a fused QKV
  projection).

The pieces always add up to the term.
"""

from __future__ import annotations

from memplan.estimate.context import RunContext
from memplan.estimate.terms import Term, TermRole
from memplan.model.spec import LayerSpec


def _fc1(size: int, layer: LayerSpec, run: RunContext) -> list[int]:
    mlp = layer.mlp
    if mlp is None:
        return [size]
    one = run.shape.seq * run.shape.micro_batch * mlp.intermediate_size * run.shape.act_bytes
    one //= max(run.job.parallel.tp, 1)
    count = size // one if one else 0
    if count < 2 or count * one != size:
        return [size]
    if mlp.fused_gate_up:  # one GEMM makes both halves: one tensor, gate and up are its views
        return [2 * one] + [one] * (count - 2)
    return [one] * count


def _parts(size: int, weights: list[int]) -> list[int]:
    whole = sum(weights)
    pieces = [size * w // whole for w in weights]
    pieces[-1] += size - sum(pieces)
    return pieces


def term_tensors(term: Term, size: int, layer: LayerSpec, run: RunContext) -> list[int]:
    """The tensors (bytes, forward order) that ``term``, ``size`` bytes on one rank, counts in ``layer``."""
    if term.role is TermRole.MLP_FC1:
        return _fc1(size, layer, run)
    if term.tensors > 1:
        return _parts(size, [1] * term.tensors)
    attn = layer.attention
    if term.role is TermRole.QKV and attn is not None and not attn.fused_qkv:
        return _parts(size, [attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim,
                             attn.num_kv_heads * attn.v_head_dim])
    return [size]


#: Kinds of the tensors a layer's forward makes in the schedule (see :func:`norm_output`); LAYER_HELD: freed at
#: the layer's end (an eager core's fp32 softmax output under ``save_on_cpu``: the decoder layer drops it on return);
#: ADAPTER: a step of a LoRA adapter's forward (:mod:`~memplan.estimate.reserved_adapters`).
KEPT, DROPPED, HELD, RELEASE, LAYER_HELD, ADAPTER = 0, 1, 2, 3, 4, 5


def norm_output(norm_input: int, run: RunContext) -> int:
    """Bytes of a pre-norm's own output that no term counts, given its norm input term's bytes on one rank
    (``norm_input``). Under ``torch.autocast`` an eager norm returns its
    output in the fp32 residual dtype and each linear saves its own 16-bit cast of it, so the fp32 output
    is a temporary that lives until the block's end (the decoder layer reassigns ``hidden_states`` to the
    block's output), the size of the norm's input; 0 otherwise (the output is the saved GEMM input)."""
    shape = run.shape
    if not shape.autocast or shape.kernels != "eager" or shape.residual_bytes <= shape.act_bytes:
        return 0
    return norm_input
