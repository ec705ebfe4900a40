"""DeepEP's communication buffer (Megatron ``--moe-token-dispatcher-type flex`` with the deepep backend).

Megatron's flex dispatcher calls ``fused_a2a.get_buffer(group, hidden_bytes)``
(megatron/core/transformer/moe/fused_a2a.py) on the expert-TP x EP group: it sizes a
``deep_ep.Buffer`` with the larger of the NVLink and RDMA size hints of DeepEP's recommended dispatch
and combine configs for that group size, with ``hidden_bytes = hidden x max(element size, 2)``, after
setting DeepEP's SM count (``--moe-flex-dispatcher-num-sms``, else 20). The buffer lives for the run.
DeepEP allocates it outside PyTorch's caching allocator (deep_ep/buffers/legacy.py ``Buffer``;
csrc/legacy/buffer.hpp): the NVLink buffer plus barrier signals and peer pointers with ``cudaMalloc``
(or fabric memory), a 32 MiB workspace with ``cudaMalloc``, and, past one NVLink domain of 8 ranks,
the RDMA buffer from the NVSHMEM symmetric heap (csrc/legacy/config.hpp ``get_nvl_buffer_size_hint``
and ``get_rdma_buffer_size_hint``).

Known limitations: the NVSHMEM symmetric heap NVSHMEM reserves beyond the RDMA buffer, and the
low-latency mode (not used by training), are not priced.
"""

from __future__ import annotations

from memplan.errors import JobConfigError
from memplan.units import MiB

#: ``Buffer.get_dispatch_config`` / ``get_combine_config``: per EP group size, (NVLink chunked send
#: tokens, NVLink chunked receive tokens, RDMA chunked send tokens, RDMA chunked receive tokens).
DISPATCH_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
COMBINE_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}
#: Megatron's SM count for DeepEP when ``--moe-flex-dispatcher-num-sms`` is not given.
DEFAULT_NUM_SMS = 20
#: LEGACY_NUM_MAX_NVL_PEERS, LEGACY_NUM_WORKSPACE_BYTES (csrc/kernels/legacy/compiled.cuh).
NVL_PEERS = 8
WORKSPACE_BYTES = 32 * MiB
#: kNumMaxTopK, kNumMaxScales; sizeof(SourceMeta) (two ints), topk_idx_t (int64), float, int, int4.
_MAX_TOPK, _MAX_SCALES, _SOURCE_META, _TOPK_IDX, _FLOAT, _INT, _INT4 = 128, 128, 8, 8, 4, 4, 16


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


def nvl_buffer_bytes(hidden_bytes: int, ranks: int, num_sms: int, recv_tokens: int) -> int:
    """``Config::get_nvl_buffer_size_hint``: per channel and NVLink peer, receive slots of tokens with
    their metadata, top-k indices and weights and scales, plus head/tail counters."""
    rdma_ranks, nvl_ranks, channels = max(ranks // NVL_PEERS, 1), min(ranks, NVL_PEERS), num_sms // 2
    per_token = hidden_bytes + _SOURCE_META + _MAX_TOPK * _TOPK_IDX + _MAX_TOPK * _FLOAT + _MAX_SCALES * _FLOAT
    total = channels * nvl_ranks * (2 * rdma_ranks + 3) * _INT + channels * nvl_ranks * recv_tokens * per_token
    return _align(total, 128)


def rdma_buffer_bytes(hidden_bytes: int, ranks: int, num_sms: int, recv_tokens: int) -> int:
    """``Config::get_rdma_buffer_size_hint``: 0 within one NVLink domain; else double (send and
    receive) slots per channel and RDMA peer."""
    if ranks <= NVL_PEERS:
        return 0
    rdma_ranks, channels = ranks // NVL_PEERS, num_sms // 2
    per_token = hidden_bytes + _SOURCE_META + _MAX_TOPK * _TOPK_IDX + _MAX_TOPK * _FLOAT + _MAX_SCALES * _FLOAT + _INT4
    total = channels * rdma_ranks * (NVL_PEERS * 2 + 2) * 2 * _INT + channels * rdma_ranks * recv_tokens * per_token * 2
    return _align(total, 128)


def deepep_buffer_bytes(*, hidden: int, act_bytes: int, group: int, num_sms: int | None) -> int:
    """Device memory of Megatron's DeepEP buffer on one rank (outside PyTorch's allocator)."""
    if group not in DISPATCH_CONFIGS:
        raise JobConfigError("--moe-token-dispatcher-type", f"flex with DeepEP needs an expert-TP x EP group of "
                             f"{', '.join(map(str, DISPATCH_CONFIGS))} ranks (DeepEP has configs for those only)",
                             group)
    sms = num_sms or DEFAULT_NUM_SMS
    hidden_bytes = hidden * max(act_bytes, 2)
    nvl = rdma = 0
    for table in (DISPATCH_CONFIGS, COMBINE_CONFIGS):
        _, nvl_recv, rdma_send, rdma_recv = table[group]
        rdma_recv = _align(rdma_recv, rdma_send)  # the Config constructor rounds it up
        nvl = max(nvl, nvl_buffer_bytes(hidden_bytes, group, sms, nvl_recv))
        rdma = max(rdma, rdma_buffer_bytes(hidden_bytes, group, sms, rdma_recv))
    # barrier signals (int), buffer pointers and barrier-signal pointers, one per NVLink peer
    metadata = NVL_PEERS * (_INT + 8 + 8)
    return nvl + metadata + WORKSPACE_BYTES + rdma
