"""auto_checkpoint on a real peft LoRA model (issue 12 point 8): a tiny Llama built from its config,
wrapped with peft.get_peft_model, its decoder layers (holding the adapters) found through
PeftModel's base_model.model nesting and checkpointed under a budget."""

from __future__ import annotations

import copy

import pytest
import torch
from ckpt_helpers import step_peak_bytes, train_step
from transformers import LlamaConfig, LlamaForCausalLM

from memplan.ckpt import auto_checkpoint
from memplan.ckpt.blocks import find_blocks
from memplan.ckpt.model_state import model_state_bytes

peft = pytest.importorskip("peft")

N_LAYERS = 4
VOCAB = 256


def _lora_llama(seed: int = 0) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, bos_token_id=0,
                         eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    base = LlamaForCausalLM(config)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights="gaussian"))
    return model.train()


def _tokens(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))




def _adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_the_blocks_are_the_decoder_layers_inside_the_peft_wrapper() -> None:
    model = _lora_llama()
    blocks, stacks = find_blocks(model)
    assert len(blocks) == N_LAYERS
    assert stacks[0].name == "base_model.model.model.layers"
    inner = {id(m) for b in blocks for m in b.modules()}
    lora = [m for n, m in model.named_modules() if n.endswith("lora_A.default")]
    assert lora and all(id(m) in inner for m in lora)  # the adapters are inside the checkpointed blocks


def test_the_budget_check_counts_gradients_of_the_adapters_only() -> None:
    model = _lora_llama()
    states = model_state_bytes(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    adapter_bytes = sum(p.numel() * p.element_size() for p in _adapters(model).values())
    assert states.grad_bytes == adapter_bytes
    assert states.optimizer_bytes == 2 * adapter_bytes  # assumed: AdamW moments of the adapters


def test_lora_trains_under_auto_checkpoint_within_budget_with_the_plain_models_gradients() -> None:
    model = _lora_llama()
    plain = copy.deepcopy(model)
    budget = step_peak_bytes(copy.deepcopy(model), _tokens(40))  # long batches must checkpoint some blocks
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.1)
    opt_plain = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.1)
    wrapped = auto_checkpoint(model, budget, optimizer=opt)
    ctl = wrapped.memplan_ckpt
    ctl.warm_up([train_step(wrapped, _tokens(n)) for n in (4, 8, 12, 16)])
    before = {n: p.detach().clone() for n, p in _adapters(wrapped).items()}
    for n in (20, 48, 33, 64):
        batch = _tokens(n)
        torch.testing.assert_close(ctl.step(train_step(wrapped, batch)), train_step(plain, batch)())
        for (name, p), q in zip(_adapters(wrapped).items(), _adapters(plain).values()):
            assert p.grad is not None, name  # the adapters receive gradients under checkpointing
            torch.testing.assert_close(p.grad, q.grad)
        assert all(p.grad is None for p in wrapped.parameters() if not p.requires_grad)  # frozen: none
        opt.step(), opt_plain.step()
        opt.zero_grad(set_to_none=True), opt_plain.zero_grad(set_to_none=True)
    stats = ctl.stats()
    assert stats.recomputed_forwards > 0
    assert stats.max_peak_bytes <= budget and stats.over_budget_steps == 0
    assert all(not torch.equal(before[n], p) for n, p in _adapters(wrapped).items() if "lora_B" in n)


def test_hugging_face_checkpointing_enabled_through_the_peft_wrapper_is_refused() -> None:
    from memplan.errors import ConfigError

    model = _lora_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ConfigError, match="Hugging Face gradient checkpointing"):
        auto_checkpoint(model, "1GiB")


def test_lora_in_a_plain_loop_finds_its_optimizer_and_keeps_the_math() -> None:
    from memplan.ckpt import controller_of
    from memplan.ckpt.bench_meter import StepMeter

    model, plain = _lora_llama(), _lora_llama()
    wrapped = auto_checkpoint(model, step_peak_bytes(copy.deepcopy(plain), _tokens(40)))  # no optimizer=
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (wrapped, plain)]
    budget = controller_of(wrapped).budget_bytes
    for n in (12, 20, 28, 16, 48, 64):
        peaks = []
        for m, opt in zip((wrapped, plain), opts):
            judge = StepMeter()
            with judge:
                judge.start(m, opt, _tokens(n))
                train_step(m, _tokens(n))()
                opt.step()
                opt.zero_grad(set_to_none=True)
            peaks.append(judge.stop())
        assert peaks[0] <= budget * 1.02
    for p, q in zip(_adapters(wrapped).values(), _adapters(plain).values()):
        torch.testing.assert_close(p, q)
    stats = controller_of(wrapped).stats()
    assert stats.optimizer_states == "measured" and stats.optimizer_steps == 6
