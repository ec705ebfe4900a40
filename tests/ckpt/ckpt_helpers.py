"""Helpers for the ckpt tests: tiny GPT-2 models built from a config (no download), batches, a step and its
peak measured by the CPU meter."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()

N_LAYER = 4


def tiny_gpt2(*, dropout: float = 0.0, seed: int = 0) -> torch.nn.Module:
    """A 4-layer, 64-wide GPT-2 (about 0.2M parameters), in training mode."""
    config = GPT2Config(
        n_layer=N_LAYER, n_embd=64, n_head=4, vocab_size=256, n_positions=256, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).train()


def tokens(length: int, *, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed + length))


def train_step(model: torch.nn.Module, batch: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Forward + backward of a causal-LM batch; returns the detached loss."""

    def fn() -> torch.Tensor:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss.detach()

    return fn


def step_peak_bytes(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """The peak live bytes of one plain training step (model state and batch included), by the CPU meter;
    the gradients are dropped afterwards."""
    from memplan.ckpt.meter import CpuMeter
    from memplan.ckpt.model_state import state_tensors

    meter = CpuMeter()
    with meter:
        meter.adopt(state_tensors(model, None))
        meter.adopt([batch])
        train_step(model, batch)()
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes
