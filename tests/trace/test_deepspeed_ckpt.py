"""DeepSpeed activation checkpointing run for real (memplan.trace.runners.ds_checkpoint): DeepSpeed's own
``deepspeed.checkpointing.checkpoint`` on each decoder layer gives the plain model's losses and gradients,
the fake-tensor trace's activations agree with ``memplan estimate`` of the same job, and what the tracer
cannot run is refused (exit 2). Skipped where deepspeed is not installed (``memplan[deepspeed]``)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import MissingDependencyError
from memplan.trace import trace
from memplan.trace.compare import compare_with_estimate
from memplan.trace.runners.ds_checkpoint import import_checkpointing
from memplan.trace.runners.policies import apply_policy
from memplan.trace.setup import trace_setup

transformers = pytest.importorskip("transformers")
#: The tests that run DeepSpeed's code; the refusals and the missing extra run without it.
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install 'memplan[deepspeed]')")

#: The switch sets, as job flags (``--cpu-checkpointing`` alone is refused: DeepSpeed's async engine).
SWITCHES: dict[str, dict[str, Any]] = {
    "full": {},
    "partition": {"partition_activations": True},
    "partition+cpu": {"partition_activations": True, "cpu_checkpointing": True},
    "partition+contiguous": {"partition_activations": True, "contiguous_checkpoints": 4},
    "partition+cpu+contiguous": {"partition_activations": True, "cpu_checkpointing": True,
                                 "contiguous_checkpoints": 4},
}
#: Llama shaped, 4 layers, sizes that make activations a visible part of the step.
TOY = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
       "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 2048, "max_position_embeddings": 2048,
       "tie_word_embeddings": False}


def _policy(flags: dict[str, Any]) -> Any:
    return trace_setup(framework="deepspeed", recompute="full", precision="fp32", device="cuda", **flags).policy


@needs_deepspeed
@pytest.mark.parametrize("name", list(SWITCHES))
def test_losses_and_gradients_equal_the_plain_model(name: str) -> None:
    """Real CPU tensors, two steps (contiguous buffers are dropped and made again by each backward)."""
    config = transformers.AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                               num_key_value_heads=4, num_hidden_layers=4, vocab_size=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).float()
    wrapped = copy.deepcopy(plain)
    apply_policy(wrapped, _policy(SWITCHES[name]))
    calls: list[int] = []
    checkpointing = import_checkpointing()
    function = checkpointing.CheckpointFunction
    original = function.forward
    function.forward = staticmethod(lambda *args: calls.append(1) or original(*args))  # type: ignore[method-assign]
    try:
        for step in range(2):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
            losses = []
            for model in (plain, wrapped):
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1])
            for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad)
    finally:
        function.forward = original  # type: ignore[method-assign]
    assert len(calls) == 2 * 4  # DeepSpeed's checkpoint ran every layer of both steps


#: Contiguous buffers for more checkpoints than the 4 layers: two unused ones stay until the backward.
SPARE_BUFFERS = {"partition_activations": True, "contiguous_checkpoints": 6}
#: Only the first 2 layers checkpointed (the others keep everything), their inputs on the host.
BLOCK = {"recompute_method": "block", "recompute_layers": 2, "partition_activations": True,
         "cpu_checkpointing": True, "contiguous_checkpoints": 2}


@needs_deepspeed
@pytest.mark.parametrize(("name", "tp"), [*((name, 1) for name in SWITCHES), ("spare buffers", 1), ("block", 1), ("partition", 2),
                                          ("partition+cpu", 2), ("spare buffers", 2)])
def test_trace_activations_agree_with_the_estimate(tmp_path: Path, name: str, tp: int) -> None:
    """Measured 2026-12-03: every cell within 0.1% (docs/trace.md, activation policies). At tp 2 the
    partitions are 1/2 of each layer input and the backward all-gathers them over the simulated ranks.
    What the switches move is far above the tolerance (cpu: half of the activations, partition at tp 2:
    a quarter, two spare buffers at tp 1: a fifth), so a trace that ignored them would fail."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TOY), encoding="utf-8")
    result = trace(str(path), seq=512, mbs=2, precision="bf16", attention="sdpa", device="cuda", iterations=2,
                   framework="deepspeed", recompute="full", tp=tp, gpus=tp,
                   **SWITCHES.get(name, BLOCK if name == "block" else SPARE_BUFFERS))
    rows = {r.category: r for r in compare_with_estimate(str(path), result.options, result.summary).rows}
    activation = rows["activation"]
    assert abs(activation.relative) <= 0.03, activation


@pytest.mark.parametrize(("flags", "flag"), [
    (["--cpu-checkpointing", "--framework", "deepspeed", "--recompute", "full"], "--cpu-checkpointing"),
    (["--partition-activations", "--recompute", "full"], "--partition-activations"),
    (["--partition-activations", "--framework", "deepspeed", "--recompute", "selective"], "--recompute"),
    (["--framework", "deepspeed", "--recompute", "full", "--precision", "bf16-mixed"], "--precision"),
    (["--framework", "deepspeed", "--recompute", "full", "--zero", "1"], "--zero"),
    (["--framework", "deepspeed", "--recompute", "full", "--checkpoint-reentrant"], "--checkpoint-reentrant"),
    (["--framework", "deepspeed", "--recompute", "full", "--peft", "lora"], "--peft"),
    (["--framework", "deepspeed", "--recompute", "full", "--fsdp", "full", "--gpus", "2"], "--fsdp"),
    (["--partition-activations", "--cpu-checkpointing", "--framework", "deepspeed", "--recompute", "full",
      "--device", "cpu"], "--cpu-checkpointing"),
])
def test_what_cannot_run_is_refused(tiny_llama: str, flags: list[str], flag: str) -> None:
    precision = [] if "--precision" in flags else ["--precision", "bf16"]
    result = CliRunner().invoke(app, ["trace", tiny_llama, "--seq", "64", *precision, *flags])
    assert result.exit_code == 2, result.output
    assert flag in result.output


def test_missing_deepspeed_names_the_extra(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without deepspeed (hidden here when installed) the trace exits 1 naming the extra."""
    for module in ["deepspeed", *(m for m in sys.modules if m.startswith("deepspeed."))]:
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingDependencyError, match=r"memplan\[deepspeed\]"):
        import_checkpointing()
    result = CliRunner().invoke(app, ["trace", tiny_llama, "--seq", "64", "--precision", "bf16", "--framework",
                                      "deepspeed", "--recompute", "full"])
    assert result.exit_code == 1, result.output
    assert "memplan[deepspeed]" in result.output


@needs_deepspeed
def test_a_one_rank_trace_after_a_tensor_parallel_one_forgets_its_ranks(tmp_path: Path) -> None:
    """DeepSpeed's ``configure(None)`` keeps an earlier call's ``mpu`` (and its rank count): a one-rank trace
    after a ``--tp 2`` one in the same process (the server, a notebook) read the destroyed two-rank group and
    failed with ``Group ... is not registered`` (seen under pytest-xdist, where the order of tests changes)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TOY), encoding="utf-8")
    flags = {"seq": 128, "mbs": 1, "precision": "bf16", "attention": "sdpa", "device": "cuda", "iterations": 1,
             "framework": "deepspeed", "recompute": "full", "partition_activations": True}
    trace(str(path), tp=2, gpus=2, **flags)
    assert import_checkpointing().mp_size == 2
    one = trace(str(path), tp=1, gpus=1, **flags)
    assert import_checkpointing().mp_size == 1 and import_checkpointing().mpu is None
    assert one.summary.peak_allocated_bytes > 0
