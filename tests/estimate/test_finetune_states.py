"""Fine-tuning model states: bitsandbytes storage sizes (checked with bitsandbytes on the CPU) and the
estimator's frozen/trainable split."""

from __future__ import annotations

import pytest

from memplan import Job, estimate, load_model
from memplan.tuning.quant_formats import NF4, int8_bytes
from memplan.job import FineTuning


def _state_bytes(weight, state) -> int:  # type: ignore[no-untyped-def]
    total = weight.numel() * weight.element_size() + state.absmax.numel() * state.absmax.element_size()
    total += state.code.numel() * state.code.element_size()
    if state.nested:
        s2 = state.state2
        total += s2.absmax.numel() * s2.absmax.element_size() + s2.code.numel() * s2.code.element_size()
        total += state.offset.numel() * state.offset.element_size()
    return total


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", [(512, 1000), (64, 64), (2048, 8192 + 64)])
def test_4bit_storage_equals_bitsandbytes(shape: tuple[int, int], double_quant: bool) -> None:
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.zeros(shape, dtype=torch.bfloat16).normal_()
    packed, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
    assert NF4.weight_bytes(weight.numel(), 0, double_quant) == _state_bytes(packed, state)


def test_int8_storage_equals_bitsandbytes() -> None:
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    rows, cols = 512, 1000
    param = bnb.nn.Int8Params(torch.randn(rows, cols), requires_grad=False, has_fp16_weights=False).to("cpu")
    stored = param.numel() * param.element_size() + param.SCB.numel() * param.SCB.element_size()
    assert int8_bytes(rows * cols, rows) == stored


def test_lora_keeps_no_state_for_frozen_weights() -> None:
    model = load_model("llama-3.2-1b")
    full = estimate(model, Job(framework="hf")).stages[0]
    lora = estimate(model, Job(framework="hf", finetune=FineTuning(peft="lora"))).stages[0]
    adapters = 16 * 8 * ((2048 + 2048) + (2048 + 512))
    assert lora.gradients_bytes == 4 * adapters
    assert lora.parameters_bytes == 2 * model.total_parameters + 4 * adapters  # bf16 frozen base, fp32 adapters
    assert lora.optimizer_moments_bytes < full.optimizer_moments_bytes / 100


def test_qlora_base_is_about_half_a_byte_per_weight() -> None:
    model = load_model("llama-3.2-1b")
    ft = FineTuning(peft="lora", lora_targets="all-linear", lora_rank=64, quantize_base="nf4")
    est = estimate(model, Job(framework="hf", finetune=ft))
    embedding = model.vocab_size * model.hidden_size
    linear = model.total_parameters - embedding - model.hidden_size * (2 * model.num_layers + 1)
    base = est.stages[0].parameters_bytes - 4 * (est.trainable_params)
    assert 0.5 * linear + 2 * embedding < base < 0.53 * linear + 2 * embedding + 10**6
    assert est.trainable_params + est.frozen_params == model.total_parameters + est.trainable_params


def test_modules_to_save_copy_keeps_the_frozen_dtype() -> None:
    """peft deep-copies the module: a bf16 copy of the head with bf16 gradients and AdamW moments."""
    model = load_model("llama-3.2-1b")
    ft = FineTuning(peft="lora", modules_to_save="lm_head")
    stage = estimate(model, Job(framework="hf", finetune=ft)).stages[0]
    adapters = 16 * 8 * ((2048 + 2048) + (2048 + 512))
    head = model.vocab_size * model.hidden_size
    assert stage.parameters_bytes == 2 * model.total_parameters + 4 * adapters + 2 * head
    assert stage.gradients_bytes == 4 * adapters + 2 * head
    assert stage.optimizer_moments_bytes == 2 * 4 * adapters + 2 * 2 * head + 4 * (2 * 16 * 2 + 1)


@pytest.mark.parametrize("quantize", ["none", "nf4", "int8"])
def test_categories_add_up_to_the_peak(quantize: str) -> None:
    ft = FineTuning(peft="dora", lora_rank=16, lora_targets="all-linear", lora_dropout=0.1, quantize_base=quantize)
    est = estimate(load_model("qwen3-8b"), Job(framework="hf", finetune=ft))
    for stage in est.stages:
        assert sum(stage.by_category().values()) == stage.peak_allocated_bytes
    data = est.to_dict()
    assert isinstance(data["trainable_params"], int) and isinstance(data["frozen_params"], int)


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_offloaded_params_take_the_frozen_base_to_cpu_memory(quantize: str) -> None:
    """--offload-params with adapters (FSDP CPU offload / ZeRO-3 offload_param move every sharded weight,
    the frozen or quantized base included) and --offload-optimizer move what they say, not nothing."""
    from dataclasses import replace

    from memplan.job import Offload, Parallelism, Sharding

    model = load_model("llama-3.1-8b")
    base = Job(parallel=Parallelism(world_size=8), sharding=Sharding(fsdp="full"),
               finetune=FineTuning(peft="lora", quantize_base=quantize))
    kept = estimate(model, base).stages[0]
    params = estimate(model, replace(base, offload=Offload(params=True))).stages[0]
    assert kept.parameters_bytes > 0 and params.parameters_bytes == 0
    assert params.cpu_parameters_bytes == kept.parameters_bytes
    assert params.optimizer_bytes == 0 and params.cpu_optimizer_bytes > 0  # FSDP's policy moves the step too
    optimizer = estimate(model, replace(base, offload=Offload(optimizer=True))).stages[0]
    assert optimizer.parameters_bytes == kept.parameters_bytes
    assert optimizer.optimizer_bytes == 0 and optimizer.cpu_optimizer_bytes == kept.optimizer_bytes > 0
    zero3 = replace(base, framework="deepspeed", sharding=Sharding(zero=3), offload=Offload(params=True))
    assert estimate(model, zero3).stages[0].cpu_parameters_bytes > 0
