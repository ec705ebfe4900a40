"""``--device cuda`` traces run SDPA, RMSNorm and dropout as CUDA (sm90) runs them (memplan.trace.cuda.dispatch).

Each stand-in is traced on a module whose only saved tensors are the kernel's own: the traced
activation bytes must equal the outputs the CUDA operator keeps, derived here from the operator's
documented outputs (``native_functions.yaml`` schemas, the meta kernels' shapes), each rounded as
the CUDA caching allocator rounds it. ``--device cpu`` traces keep running the CPU kernels.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from memplan.trace import trace
from memplan.trace.cuda.dispatch import cuda_dispatch
from memplan.trace.cuda.rounding import cuda_allocated_size
from memplan.trace.cuda.sdpa import sdpa_backend

B, H, KV, S = 2, 4, 2, 40  # S not a multiple of 32: the efficient kernel pads its log-sum-exp
BF16, FP32 = torch.bfloat16, torch.float32
#: The loss scalar, alive when the backward starts.
LOSS = ((), FP32)


def _bytes(*shapes_dtypes: tuple[tuple[int, ...], torch.dtype]) -> int:
    return sum(cuda_allocated_size(math.prod(shape) * dtype.itemsize) for shape, dtype in shapes_dtypes)


class _Attention(torch.nn.Module):
    """q, k, v as parameters (not activations): what SDPA saves beyond them is the kernel's."""

    def __init__(self, dtype: torch.dtype, head_dim: int, kv_heads: int, mask: bool) -> None:
        super().__init__()
        self.q = torch.nn.Parameter(torch.randn(B, H, S, head_dim, dtype=dtype))
        self.k = torch.nn.Parameter(torch.randn(B, kv_heads, S, head_dim, dtype=dtype))
        self.v = torch.nn.Parameter(torch.randn(B, kv_heads, S, head_dim, dtype=dtype))
        self.mask = torch.ones(B, 1, S, S, dtype=torch.bool).tril() if mask else None

    def forward(self) -> torch.Tensor:
        causal = self.mask is None
        return torch.nn.functional.scaled_dot_product_attention(
            self.q, self.k, self.v, attn_mask=self.mask, is_causal=causal, enable_gqa=self.k.size(1) != H)


def _job(module: Any) -> Any:
    def make_job() -> Any:
        model = module()
        return model, {}, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, _batch: out.float().sum()
    return make_job


def _traced(module: Any, device: str) -> Any:
    return trace(_job(module), device=device, iterations=1)


def _activation(result: Any) -> int:
    return int(result.summary.max_by_category.get("activation", 0))


def _ops(result: Any) -> set[str]:
    return {e.op for e in result.trace.events if e.kind == "alloc"}


def test_cudnn_attention_keeps_output_log_sum_exp_and_rng_state() -> None:
    # _scaled_dot_product_cudnn_attention: output (B,H,S,D), logsumexp (B,H,S,1) fp32, philox seed and offset
    result = _traced(lambda: _Attention(BF16, 64, KV, mask=False), "cuda")
    assert "aten._scaled_dot_product_cudnn_attention.default" in _ops(result)
    expected = _bytes(((B, H, S, 64), BF16), ((B, H, S, 1), FP32), ((), torch.int64), ((), torch.int64), LOSS)
    assert _activation(result) == expected


def test_cudnn_attention_keeps_the_additive_mask_it_makes() -> None:
    # convert_boolean_attn_mask_cudnn: a (B,1,S,S) mask in the query dtype, saved as attn_bias
    result = _traced(lambda: _Attention(BF16, 64, H, mask=True), "cuda")
    expected = _bytes(((B, H, S, 64), BF16), ((B, H, S, 1), FP32), ((), torch.int64), ((), torch.int64),
                      ((B, 1, S, S), BF16), LOSS)
    assert _activation(result) == expected


def test_flash_attention_above_cudnn_head_dim_pads_nothing_and_keeps_rng_state() -> None:
    # head dim 256 > cuDNN's 128: flash; output, logsumexp (B,H,S) fp32, rng_state (2,) and unused () uint64
    result = _traced(lambda: _Attention(BF16, 256, KV, mask=False), "cuda")
    assert "aten._scaled_dot_product_flash_attention.default" in _ops(result)
    expected = _bytes(((B, H, S, 256), BF16), ((B, H, S), FP32), ((2,), torch.uint64), ((), torch.uint64), LOSS)
    assert _activation(result) == expected


def test_efficient_attention_in_fp32_pads_log_sum_exp_and_keeps_rng_on_the_host() -> None:
    # fp32: no cuDNN/flash; efficient with GQA: output, log_sumexp (B,H,ceil(S/32)*32); seed/offset on the CPU
    result = _traced(lambda: _Attention(FP32, 64, KV, mask=False), "cuda")
    assert "aten._scaled_dot_product_efficient_attention.default" in _ops(result)
    expected = _bytes(((B, H, S, 64), FP32), ((B, H, math.ceil(S / 32) * 32), FP32), LOSS)
    assert _activation(result) == expected
    gradients = result.summary.max_by_category.get("gradient", 0)  # per-query-head gradients reduced
    assert gradients == _bytes(((B, H, S, 64), FP32), ((B, KV, S, 64), FP32), ((B, KV, S, 64), FP32))


def test_cpu_trace_still_runs_the_cpu_flash_kernel() -> None:
    before = torch.nn.functional.scaled_dot_product_attention
    result = _traced(lambda: _Attention(BF16, 64, KV, mask=False), "cpu")
    ops = _ops(result)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops
    assert not {op for op in ops if "cudnn" in op or op.startswith("aten._scaled_dot_product_flash_attention.")}
    assert torch.nn.functional.scaled_dot_product_attention is before


class _Norm(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(torch.randn(B, S, 128, dtype=dtype))
        self.norm = torch.nn.RMSNorm(128, eps=1e-6, dtype=dtype)

    def forward(self) -> torch.Tensor:
        return self.norm(self.x)


def test_rms_norm_is_cudas_fused_kernel() -> None:
    # _fused_rms_norm saves input (here a parameter), weight and rstd (B,S,1) in fp32
    cuda = _traced(lambda: _Norm(BF16), "cuda")
    assert _activation(cuda) == _bytes(((B, S, 1), FP32), LOSS)
    cpu = _traced(lambda: _Norm(BF16), "cpu")  # the CPU composite keeps fp32 copies of the input
    assert _activation(cpu) >= _bytes(((B, S, 128), FP32))


class _Dropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(torch.randn(B, S, 128, dtype=BF16))
        self.dropout = torch.nn.Dropout(0.25)

    def forward(self) -> torch.Tensor:
        return self.dropout(self.x)


def test_dropout_keeps_cudas_boolean_mask() -> None:
    # native_dropout: output and a bool mask of the input's shape; the backward keeps the mask
    cuda = _traced(_Dropout, "cuda")
    assert "aten.native_dropout.default" in _ops(cuda)
    assert _activation(cuda) == _bytes(((B, S, 128), torch.bool), LOSS)
    cpu = _traced(_Dropout, "cpu")  # the CPU composite keeps its scaled noise in the input dtype (unrounded)
    assert _activation(cpu) == B * S * 128 * BF16.itemsize + FP32.itemsize


def test_backend_rules() -> None:
    def backend(dtype: torch.dtype, head_dim: int, kv_heads: int = H, mask: bool = False, **kw: Any) -> str:
        q = torch.empty(B, H, S, head_dim, dtype=dtype)
        kv = torch.empty(B, kv_heads, S, head_dim, dtype=dtype)
        attn_mask = torch.ones(S, S, dtype=torch.bool) if mask else None
        return sdpa_backend(q, kv, kv, attn_mask, enable_gqa=kv_heads != H, **kw)

    assert backend(BF16, 128) == "cudnn"
    assert backend(BF16, 128, KV) == "cudnn"                  # GQA
    assert backend(BF16, 256) == "flash"                      # cuDNN 9.20: head dim <= 128
    assert backend(BF16, 256, mask=True) == "efficient"       # flash takes no mask
    assert backend(BF16, 64, dropout_p=0.1) == "flash"        # cuDNN: dropout in steps of 1/16
    assert backend(FP32, 64) == "efficient"
    assert backend(FP32, 6) == "math"                         # fp32 efficient: head dim a multiple of 4
    q = torch.empty(B, H, S, 64, dtype=BF16)
    kv = torch.empty(B, KV, S, 64, dtype=BF16)
    assert sdpa_backend(q, kv, kv) == "math"                  # fewer kv heads without enable_gqa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert backend(BF16, 64) == "efficient"


def test_real_tensors_are_left_to_pytorch() -> None:
    q = torch.randn(1, 2, 8, 16)
    with cuda_dispatch():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_attention_under_full_recompute_traces(tiny_llama: str, device: str) -> None:
    """The checkpoint's recompute in the backward runs the same kernel as the forward (or checkpoint refuses)."""
    result = trace(tiny_llama, seq=64, mbs=1, precision="bf16-mixed", recompute="full", device=device, iterations=1)
    kernel = "cudnn_attention" if device == "cuda" else "flash_attention_for_cpu"
    assert any(kernel in op for op in _ops(result))
