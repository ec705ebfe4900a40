"""Optimizer states and temporaries (memplan.estimate.optimizers) against bitsandbytes' and torch's
real state tensors, built on CPU; paged states outside the allocator; optimizer-in-backward; losses."""

from __future__ import annotations

import inspect

import pytest

from memplan import Job, estimate, load_model
from memplan.estimate.extras import fused_linear_chunk_tokens
from memplan.estimate.optimizers import (
    BNB_BLOCK,
    MIN_8BIT_NUMEL,
    PAGED_MIN_NUMEL,
    SmallTensors,
    optimizer_states,
    small_tensors,
)
from memplan.job import Batch, Optimizer, Precision, Recompute

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")


def _state_bytes(opt: object) -> int:
    """Bytes of every per-parameter state tensor, the shared 256-entry quantization maps left out."""
    return sum(v.numel() * v.element_size() for st in opt.state.values()  # type: ignore[attr-defined]
               for k, v in st.items() if torch.is_tensor(v) and not k.startswith("qmap"))


def _stepped(opt_class: type, shapes: list[tuple[int, ...]]) -> object:
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    opt = opt_class(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


# A matrix whose size is no multiple of the 256-element block, and a vector under min_8bit_size.
SHAPES = [(1000, 513), (100,)]
NUMEL, SMALL = 1000 * 513 + 100, SmallTensors(below_8bit=100, below_paged=100, vectors=100)


@pytest.mark.parametrize("name, opt_class", [("adamw8bit", "AdamW8bit"), ("adam8bit", "Adam8bit"),
                                             ("lion8bit", "Lion8bit"), ("lion", "Lion")])
def test_bitsandbytes_states_match_real_tensors(name: str, opt_class: str) -> None:
    """uint8 states + fp32 absmax per 256-element block; the small tensor keeps fp32 states."""
    real = _stepped(getattr(bnb.optim, opt_class), SHAPES)
    job = Job(framework="hf", optimizer=Optimizer(name=name))
    assert optimizer_states(NUMEL, job, 4, 4096, SMALL).device_bytes == _state_bytes(real)


def test_thresholds_are_bitsandbytes_defaults() -> None:
    """min_8bit_size from the optimizer's signature; the paging threshold from get_state_buffer's source."""
    assert inspect.signature(bnb.optim.AdamW8bit).parameters["min_8bit_size"].default == MIN_8BIT_NUMEL
    assert "p.numel() < 1e5" in inspect.getsource(bnb.optim.optimizer.Optimizer8bit.get_state_buffer)
    assert PAGED_MIN_NUMEL == 100_000 and BNB_BLOCK == 256


def test_paged_states_are_outside_the_allocator() -> None:
    """Paged states of large tensors go to paged_optimizer_bytes, not the peaks; the small ones and
    every absmax stay in the allocator."""
    job = Job(framework="hf", optimizer=Optimizer(name="paged-adamw8bit"))
    big = SmallTensors(below_8bit=100, below_paged=100)
    states = optimizer_states(NUMEL, job, 4, 4096, big)
    blocks = -(-(NUMEL - 100) // BNB_BLOCK)
    assert states.paged_bytes == 2 * (NUMEL - 100)
    assert states.device_bytes == 2 * 4 * 100 + 2 * 4 * blocks
    model = load_model("llama-3.2-1b")
    base = Job(framework="hf", batch=Batch(seq_length=512))
    plain = estimate(model, Job(framework="hf", batch=Batch(seq_length=512), optimizer=Optimizer(name="adamw8bit")))
    paged = estimate(model, Job(framework="hf", batch=Batch(seq_length=512), optimizer=Optimizer(name="paged-adamw8bit")))
    assert paged.paged_optimizer_bytes > 0 and plain.paged_optimizer_bytes == 0
    assert plain.peak_allocated_bytes - paged.peak_allocated_bytes == pytest.approx(paged.paged_optimizer_bytes, rel=0.01)
    assert paged.to_dict()["paged_optimizer_bytes"] == paged.paged_optimizer_bytes
    assert paged.to_dict()["stages"][0]["paged_optimizer_bytes"] == paged.paged_optimizer_bytes
    assert any("unified memory" in a for a in paged.assumptions)
    assert estimate(model, base).paged_optimizer_bytes == 0


def test_paged_adamw_32bit_states() -> None:
    """paged-adamw: two fp32 states; only tensors of at least 1e5 elements are paged."""
    job = Job(framework="hf", optimizer=Optimizer(name="paged-adamw"))
    states = optimizer_states(NUMEL, job, 2, 4096, SMALL)
    assert states.device_bytes == 2 * 4 * 100
    assert states.paged_bytes == 2 * 4 * (NUMEL - 100)


def test_adafactor_matches_torch_for_a_square_matrix_and_a_vector() -> None:
    """torch.optim.Adafactor: a row and a column vector per matrix, a full second moment per vector."""
    hidden = 256
    real = _stepped(torch.optim.Adafactor, [(hidden, hidden), (hidden,)])
    moments = sum(v.numel() * v.element_size() for st in real.state.values()  # type: ignore[attr-defined]
                  for k, v in st.items() if torch.is_tensor(v) and k != "step")
    job = Job(framework="hf", optimizer=Optimizer(name="adafactor"))
    small = SmallTensors(below_8bit=hidden, below_paged=hidden, vectors=hidden)
    assert optimizer_states(hidden * hidden + hidden, job, 4, hidden, small).device_bytes == moments


def test_small_tensors_of_a_stage() -> None:
    """Norms of llama-3.2-1b (hidden 2048) are under min_8bit_size; its matrices are not."""
    model = load_model("llama-3.2-1b")
    small = small_tensors(model, tuple(range(model.num_layers)), has_head=True)
    norms = (2 * model.num_layers + 1) * model.hidden_size
    assert small.below_8bit == small.below_paged == small.vectors == norms


def test_optimizer_in_backward_lowers_the_gradient_term() -> None:
    """Each gradient is stepped and freed in the backward: at most the largest one is alive."""
    model = load_model("llama-3.2-1b")
    common = {"framework": "hf", "batch": Batch(seq_length=1024), "precision": Precision(name="bf16")}
    before = estimate(model, Job(**common, optimizer=Optimizer(name="adamw")))  # type: ignore[arg-type]
    after = estimate(model, Job(**common, optimizer=Optimizer(name="adamw", in_backward=True)))  # type: ignore[arg-type]
    largest = model.vocab_size * model.hidden_size
    assert after.stages[0].gradients_bytes <= 2 * largest + 2
    assert after.stages[0].gradients_bytes < before.stages[0].gradients_bytes / 4
    assert after.peak_allocated_bytes < before.peak_allocated_bytes
    assert any("optimizer in backward" in a for a in after.assumptions)


@pytest.mark.parametrize("loss", ["fused-linear", "chunked"])
def test_memory_saving_losses_lower_the_logits(loss: str) -> None:
    model = load_model("llama-3.2-1b")
    common = {"framework": "hf", "batch": Batch(seq_length=4096), "recompute": Recompute(mode="full")}
    plain = estimate(model, Job(**common, loss="fp32-logits")).stages[0]  # type: ignore[arg-type]
    saving = estimate(model, Job(**common, loss=loss)).stages[0]  # type: ignore[arg-type]
    assert saving.loss_logits_bytes < plain.loss_logits_bytes
    if loss == "fused-linear":
        # One chunk of tokens x vocab in bf16, plus the head weight's fp32 gradient (the head trains).
        chunk = fused_linear_chunk_tokens(4096, model.vocab_size, model.hidden_size)
        assert saving.loss_logits_bytes == 2 * chunk * model.vocab_size + 4 * model.vocab_size * model.hidden_size


def test_fused_linear_chunk_rule() -> None:
    """Liger: next power of two of tokens / ceil(vocab / hidden), at most the tokens."""
    assert fused_linear_chunk_tokens(4096, 128256, 4096) == 128  # ceil(4096 / 32) = 128
    assert fused_linear_chunk_tokens(1000, 128256, 2048) == 16  # ceil(1000 / 63) = 16
    assert fused_linear_chunk_tokens(8, 100, 4096) == 8


def test_packing_is_stated() -> None:
    est = estimate(load_model("llama-3.2-1b"), Job(framework="hf", batch=Batch(seq_length=1024, packing=True)))
    assert any("sequence packing" in a for a in est.assumptions)


@pytest.mark.parametrize("name, opt_class", [("adamw8bit", "AdamW8bit"), ("paged-adamw8bit", "PagedAdamW8bit"),
                                             ("lion8bit", "Lion8bit")])
def test_whole_model_states_match_bitsandbytes(name: str, opt_class: str) -> None:
    """A real transformers Qwen2 (q/k/v biases and norms under min_8bit_size) stepped by bitsandbytes on
    CPU: its state bytes equal the estimator's (paged ones included: on CPU bitsandbytes does not page)."""
    transformers = pytest.importorskip("transformers")
    from memplan.model import model_from_hf_config

    config = {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 512, "tie_word_embeddings": False}
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = getattr(bnb.optim, opt_class)(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    spec = model_from_hf_config(config, name="tiny-qwen2")
    est = estimate(spec, Job(framework="hf", batch=Batch(seq_length=64), optimizer=Optimizer(name=name))).stages[0]
    assert est.parameters_numel == sum(p.numel() for p in params)
    assert est.optimizer_moments_bytes + est.paged_optimizer_bytes == _state_bytes(opt)


def test_small_tensors_of_adapter_sizes() -> None:
    """LoRA rank 16 on a 4096-wide projection: each adapter has 65,536 elements — 8-bit, but never paged."""
    from memplan.estimate.optimizers import small_tensors_of_sizes

    small = small_tensors_of_sizes([16 * 4096, 4096 * 16, 100])
    assert small.below_8bit == 100 and small.below_paged == 2 * 65536 + 100
    job = Job(framework="hf", optimizer=Optimizer(name="paged-adamw8bit"))
    assert optimizer_states(2 * 65536 + 100, job, 4, 4096, small).paged_bytes == 0
