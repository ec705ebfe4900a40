"""``memplan trace --framework hf --fsdp`` runs accelerate's FSDP2 policy (MixedPrecisionPolicy with the reduce in
the compute dtype, the forward under ``torch.autocast``); ``--framework torchtitan`` keeps torchtitan's (reduce
fp32, no autocast). The estimate of the same jobs: tests/estimate/test_hf_fsdp_policy.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY
from tests.estimate.test_hf_fsdp_policy import FLAGS, TRACED


@pytest.mark.parametrize(("framework", "reduce_dtype", "autocast"), [
    ("hf", torch.bfloat16, torch.bfloat16), ("torchtitan", torch.float32, None)])
def test_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, framework: str, reduce_dtype: torch.dtype,
                autocast: torch.dtype | None) -> None:
    import torch.distributed.fsdp as fsdp

    import memplan.trace.run as run

    policies, forwards = [], []
    real_shard, real_forward = fsdp.fully_shard, run._forward

    def shard(module, **kwargs):  # type: ignore[no-untyped-def]
        policies.append(kwargs["mp_policy"])
        return real_shard(module, **kwargs)

    def forward(job):  # type: ignore[no-untyped-def]
        forwards.append(job.autocast_dtype)
        return real_forward(job)

    monkeypatch.setattr(fsdp, "fully_shard", shard)
    monkeypatch.setattr(run, "_forward", forward)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": 256}), encoding="utf-8")
    trace(str(path), device="cuda", iterations=1, framework=framework, recompute="none", **FLAGS)
    assert policies and {(p.param_dtype, p.reduce_dtype) for p in policies} == {(torch.bfloat16, reduce_dtype)}
    assert forwards and set(forwards) == {autocast}


@pytest.mark.parametrize("key", list(TRACED))
def test_hf_cells_agree(tmp_path: Path, key: tuple[int, str, str]) -> None:
    vocab, framework, recompute = key
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_TOY, "vocab_size": vocab}), encoding="utf-8")
    result = trace(str(path), device="cuda", iterations=2, framework=framework, recompute=recompute, **FLAGS)
    assert result.summary.peak_allocated_bytes == TRACED[key]
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    assert abs(rows["peak allocated"].relative or 0.0) < 0.02, rows["peak allocated"]
