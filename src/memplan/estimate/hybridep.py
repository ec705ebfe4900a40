"""HybridEP's buffers (Megatron ``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep``).

Megatron's ``fused_a2a.init_hybrid_ep_buffer`` builds one ``deep_ep.HybridEPBuffer`` at the first
dispatch, on the expert-TP x EP group, with ``max_num_of_tokens_per_rank`` = the dispatcher
input's token count (``x.shape[-2]``: sequence x micro-batch on this rank, split by TP under
sequence parallelism) and ``num_local_experts``. From DeepEP's hybrid-ep branch
(``deep_ep/hybrid_ep_buffer.py`` and ``csrc/hybrid_ep``'s ``NVLCoordinator``):

* the buffer config keeps at least 512 tokens, rounded up to 16 (``update_template_config``);
* ``max_num_of_tokens = tokens x ranks per NVLink domain x domains`` (the worst case: every token
  of the group sent to one rank);
* within one NVLink domain the dispatch and combine buffers are shared (``use_shared_buffer``,
  True by default), so one ``expert_input_token`` (``max_num_of_tokens x hidden`` 16-bit) and one
  ``expert_input_prob`` (``max_num_of_tokens x local experts x ranks per domain`` fp32) serve both,
  plus the dispatch's FP8 scaling factors (``max_num_of_tokens x hidden / 128`` fp32, allocated
  also for 16-bit dispatch), per-chunk flags (128-token chunks, one uint32 per chunk and rank, for
  dispatch and combine) and the preprocessing scratch (``blocks x (ranks per domain + local
  experts)`` 8-byte ``tmp_state_t``, 108 blocks by default);
* all of it comes from HybridEP's own allocator (``cudaMalloc`` / fabric memory), outside
  PyTorch's caching allocator, and lives for the run.

Known limitations: ranks per NVLink domain are taken as 8 (an HGX node; HybridEP detects them, and
a rack-scale NVLink system such as GB200 NVL72 has up to 72, which grows the probabilities' buffer
and is not known to the estimate, which has no GPU); across domains (more than one node of
the group) HybridEP adds RDMA staging buffers, which are not priced; the routing-map all-gather
buffer and JIT-compiled kernels are not priced.
"""

from __future__ import annotations

__all__ = ["hybridep_buffer_bytes"]

#: ``max(max_num_of_tokens_per_rank, 512)`` in ``HybridEPBuffer.__init__``; tokens rounded up to 16.
MIN_TOKENS, TOKEN_ALIGN = 512, 16
#: ``NUM_OF_TOKENS_PER_CHUNK_{DISPATCH,COMBINE}_API`` defaults.
CHUNK_TOKENS = 128
#: ``num_sms_preprocessing_api`` default (Megatron passes 108 too).
PREPROCESSING_BLOCKS = 108
#: 16-bit tokens, fp32 probabilities and scales, uint32 flags, hybrid_ep::tmp_state_t.
_TOKEN, _FLOAT, _FLAG, _TMP_STATE = 2, 4, 4, 8
#: Ranks of one NVLink domain on an HGX node.
NODE_RANKS = 8


def hybridep_buffer_bytes(*, hidden: int, tokens: int, local_experts: int, group: int,
                          domain_ranks: int = NODE_RANKS) -> int:
    """Device memory of Megatron's HybridEP buffer on one rank (outside PyTorch's allocator)."""
    per_rank = -(-max(tokens, MIN_TOKENS) // TOKEN_ALIGN) * TOKEN_ALIGN
    ranks = min(group, domain_ranks)
    domains = max(group // ranks, 1)
    most = per_rank * ranks * domains
    tokens_buffer = most * hidden * _TOKEN
    probs = most * local_experts * ranks * _FLOAT
    scales = most * (hidden // 128) * _FLOAT
    chunks = -(-per_rank // CHUNK_TOKENS)
    flags = 2 * chunks * ranks * domains * _FLAG
    scratch = PREPROCESSING_BLOCKS * (ranks + local_experts) * _TMP_STATE
    return tokens_buffer + probs + scales + flags + scratch
