"""Finding a model's repeated blocks: the layers that checkpointing wraps one by one.

A *block* is one element of the model's stack of identical layers: ``GPT2Model.h``, Llama's
``model.layers``, BERT's ``encoder.layer``, or any ``nn.ModuleList`` / ``nn.Sequential`` of two or
more modules of one class that hold parameters. When several such stacks exist (an encoder and a
decoder), every stack holding at least a fifth of the largest stack's parameters is used, in
registration order; stacks nested inside another stack's blocks are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from memplan.errors import ConfigError

__all__ = ["BlockStack", "find_blocks", "validate_blocks"]

#: A stack is used when it holds at least this share of the largest stack's parameters.
_MIN_SHARE = 0.2


@dataclass(frozen=True)
class BlockStack:
    """A container of repeated blocks: its dotted name and how many blocks and parameters it holds."""

    name: str
    n_blocks: int
    n_params: int


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if any(_n_params(c) == 0 for c in children):
            continue
        found.append((name, module))
    # drop stacks that live inside a block of another stack
    outer = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o in outer)]


def find_blocks(model: nn.Module) -> tuple[tuple[nn.Module, ...], tuple[BlockStack, ...]]:
    """The model's repeated blocks in forward (registration) order, and the stacks they came from.

    Raises :class:`~memplan.errors.ConfigError` (field ``blocks``) when there is none.
    """
    stacks = _stacks(model)
    if not stacks:
        raise ConfigError(
            "blocks",
            f"no repeated blocks found in {type(model).__name__} (looked for an nn.ModuleList or "
            "nn.Sequential of two or more layers of one class)",
            hint="pass them yourself, e.g. auto_checkpoint(model, budget, blocks=list(model.layers))",
        )
    sized = [(name, module, _n_params(module)) for name, module in stacks]
    largest = max(p for _, _, p in sized)
    chosen = [(n, m, p) for n, m, p in sized if p >= _MIN_SHARE * largest]
    blocks = tuple(child for _, module, _ in chosen for child in module.children())
    info = tuple(BlockStack(name=n or "<model>", n_blocks=len(list(m.children())), n_params=p) for n, m, p in chosen)
    return blocks, info


def validate_blocks(model: nn.Module, blocks: Iterable[object]) -> tuple[nn.Module, ...]:
    """Check user-given ``blocks``: distinct submodules of ``model``, at least one."""
    given = tuple(blocks)
    if not given:
        raise ConfigError("blocks", "must name at least one submodule of the model", [])
    members = {id(m) for m in model.modules()}
    for i, block in enumerate(given):
        if not isinstance(block, nn.Module):
            raise ConfigError("blocks", f"item {i} is not an nn.Module", type(block).__name__)
        if id(block) not in members or block is model:
            raise ConfigError(
                "blocks", f"item {i} ({type(block).__name__}) is not a submodule of the model",
                hint="pass modules taken from the model itself, e.g. list(model.transformer.h)",
            )
    if len({id(b) for b in given}) != len(given):
        raise ConfigError("blocks", "lists a module twice")
    return tuple(b for b in given if isinstance(b, nn.Module))
