"""``memplan trace --framework hf`` runs accelerate's own ``convert_outputs_to_fp32`` around the model's forward where
the Trainer's accelerate does (``native_amp``: a 16-bit precision, not DeepSpeed): an fp32 copy of the logits made at
the model's top level after the forward, gone before the backward. The estimate of the same jobs:
tests/estimate/test_fp32_outputs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memplan.trace import trace
from tests.estimate.test_fsdp_adapter_dtype import LLAMA_TOY

SEQ, MBS = 128, 2
_JOB = {"seq": SEQ, "mbs": MBS, "attention": "sdpa", "recompute": "none", "optimizer": "adamw",
        "optimizer_impl": "foreach", "device": "cuda", "iterations": 2}


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("fp32out17")) / "llama.json"
    path.write_text(json.dumps(LLAMA_TOY), encoding="utf-8")
    return str(path)


def _copies(result) -> int:  # type: ignore[no-untyped-def]
    """fp32 logits-sized copies made at the model's top level in the last iteration's forward."""
    size = 4 * SEQ * MBS * LLAMA_TOY["vocab_size"]
    return sum(1 for e in result.trace.events
               if e.kind == "alloc" and e.iteration == 1 and e.phase == "forward" and e.module == ""
               and e.op == "aten._to_copy.default" and e.size == size)


@pytest.mark.parametrize(("flags", "copies"), [
    ({"framework": "hf", "precision": "bf16-mixed"}, 2),  # the loss's upcast and accelerate's copy
    ({"framework": "hf", "precision": "fp16-mixed"}, 2),
    ({"framework": "hf", "precision": "bf16"}, 2),  # the Trainer's --bf16 with bf16 weights: native_amp too
    ({"framework": "torchtitan", "precision": "bf16-mixed"}, 1),  # the loss's upcast alone
    ({"framework": "hf", "precision": "fp32"}, 0),
], ids=["hf-bf16-mixed", "hf-fp16-mixed", "hf-bf16", "torchtitan", "hf-fp32"])
def test_the_logits_copy_where_accelerate_makes_it(toy: str, flags: dict[str, object], copies: int) -> None:
    assert _copies(trace(toy, **{**_JOB, **flags})) == copies


def test_the_copy_moves_no_peak(toy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy takes the place of the loss's own upcast (freed by then, the same size): hf's peak and reserved
    are those of the same hf job without the wrapper (torchtitan's trace, the control before, now runs torchtitan's
    own loss after the forward: no shifted labels, no bound norm output)."""
    hf = trace(toy, **{**_JOB, "framework": "hf", "precision": "bf16-mixed"}).summary
    monkeypatch.setattr("memplan.trace.run.convert_outputs_to_fp32", lambda model, options: None)
    titan = trace(toy, **{**_JOB, "framework": "hf", "precision": "bf16-mixed"}).summary
    assert hf.peak_allocated_bytes == titan.peak_allocated_bytes
    assert hf.by_phase["forward"] == titan.by_phase["forward"]
    assert hf.reserved is not None and titan.reserved is not None
    assert hf.reserved.peak_reserved_bytes == titan.reserved.peak_reserved_bytes


def test_real_forward_returns_fp32_logits() -> None:
    """On real tensors: the same ModelOutput type, fp32 logits, the fp32 loss as it was."""
    import transformers

    from memplan.trace.run import convert_outputs_to_fp32
    from memplan.trace.setup import trace_setup

    values = dict(LLAMA_TOY)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), use_cache=False,
                                               **{**values, "num_hidden_layers": 1, "hidden_size": 64,
                                                  "intermediate_size": 128, "vocab_size": 128})
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    batch = {"input_ids": torch.randint(0, 128, (2, 8)), "labels": torch.randint(0, 128, (2, 8))}
    convert_outputs_to_fp32(model, trace_setup(seq=8, mbs=2, device="cpu", framework="hf"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(**batch)
    assert type(output).__name__ == "CausalLMOutputWithPast"
    assert output.logits.dtype == torch.float32 and output.loss.dtype == torch.float32
    plain = transformers.AutoModelForCausalLM.from_config(config).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain(**batch).logits.dtype == torch.bfloat16
