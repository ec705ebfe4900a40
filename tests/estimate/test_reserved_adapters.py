"""A LoRA adapter's forward in a checkpointed layer of the reserved schedule (session 13, resv13): peft's fp32
copy of the input, lora_A's 16-bit copy, lora_B's output, the scaled product and the sum beside the base result.
The schedule made none of them (a fine-tuned layer's forward laid out only what it keeps), so it reserved no
segment of their sizes: qwen2.5-7b cut to 4 layers, LoRA all-linear, full recompute, s4096 was 7.8% under the
trace's simulated reserved, now 0.6%."""

from __future__ import annotations

from memplan.estimate.reserved_adapters import STEPS, adapter_step
from memplan.estimate.reserved_replay import Replay
from tests.estimate.test_reserved_mechanics import _schedule

LORA = {"framework": "hf", "recompute": "full", "seq": 4096, "peft": "lora", "lora_targets": "all-linear"}


def _first_forward(model: str, flags: dict[str, object]) -> list[int]:
    """The sizes the schedule's first forward takes (before the loss's forward)."""
    log = _schedule(model, flags)
    end = log.index(("moment", "forward"))
    return [int(size) for kind, size in log[:end] if kind == "take"]  # type: ignore[call-overload]


def test_a_checkpointed_lora_layers_forward_makes_the_adapters_tensors() -> None:
    # qwen2.5-7b: down_proj's input (4096 x 18944) cast to the fp32 adapters (peft _cast_input_dtype), 296 MiB,
    # once per layer; a trace makes it as aten._to_copy in mlp.down_proj
    taken = _first_forward("qwen2.5-7b", LORA)
    assert taken.count(4096 * 18944 * 4) == 28
    # gate_proj and up_proj: base result, lora_B's output, the scaled product and the sum (148 MiB each), beside
    # the MLP's own gate, up, act and product
    assert taken.count(4096 * 18944 * 2) >= 28 * (4 + 2 * 4)


def test_without_checkpointing_the_forward_keeps_its_layout() -> None:
    # a fine-tuned layer that is not recomputed: the schedule lays out what it keeps (adapters not laid out)
    taken = _first_forward("qwen2.5-7b", {**LORA, "recompute": "none"})
    assert 4096 * 18944 * 4 not in taken


def test_an_adapters_steps_free_what_peft_frees() -> None:
    # one adapter under autocast: base result 10, fp32 input 8, 16-bit copy 4, lora_A's output 1, lora_B's 10,
    # scaled 10, sum 10: at most the base result, the fp32 input and two outputs alive; nothing left after the sum
    replay = Replay()
    temps: dict[int, object] = {}
    steps = {name: i for i, name in enumerate(STEPS)}
    for size, name in ((10, "base"), (8, "cast"), (4, "copy"), (1, "lora_a"), (10, "lora_b"), (10, "scaled"),
                       (10, "sum")):
        adapter_step(replay, size, steps[name], temps)  # type: ignore[arg-type]
    assert replay.requested == 0
    assert replay.peak_requested == 10 + 8 + 10 + 10
    assert not temps
