"""Block detection: Hugging Face layer lists, plain containers, and a clear error when there are none."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import N_LAYER
from torch import nn

from memplan.ckpt.blocks import find_blocks, validate_blocks
from memplan.errors import ConfigError


def test_finds_the_decoder_layers_of_gpt2(model: nn.Module) -> None:
    blocks, stacks = find_blocks(model)
    assert list(blocks) == list(model.transformer.h)
    assert [s.name for s in stacks] == ["transformer.h"] and stacks[0].n_blocks == N_LAYER


def test_finds_a_sequential_of_identical_layers() -> None:
    net = nn.Sequential(nn.Embedding(10, 8), nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]), nn.Linear(8, 2))
    blocks, _ = find_blocks(net)
    assert list(blocks) == list(net[1])


def test_finds_both_stacks_of_an_encoder_decoder() -> None:
    class EncDec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.decoder = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    blocks, stacks = find_blocks(EncDec())
    assert len(blocks) == 5 and [s.name for s in stacks] == ["encoder", "decoder"]


def test_a_model_without_repeated_blocks_gets_told_to_pass_blocks() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ConfigError) as info:
        find_blocks(net)
    assert info.value.field == "blocks"
    assert "blocks=" in str(info.value)


def test_given_blocks_must_be_submodules(model: nn.Module) -> None:
    assert validate_blocks(model, model.transformer.h) == tuple(model.transformer.h)
    with pytest.raises(ConfigError, match="not a submodule"):
        validate_blocks(model, [nn.Linear(2, 2)])
    with pytest.raises(ConfigError, match="twice"):
        validate_blocks(model, [model.transformer.h[0], model.transformer.h[0]])
    with pytest.raises(ConfigError, match="at least one"):
        validate_blocks(model, [])
    with pytest.raises(ConfigError, match="not an nn.Module"):
        validate_blocks(model, [torch.zeros(1)])
