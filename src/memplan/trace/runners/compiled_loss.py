"""``--compile`` with a compiled loss: the model's cross-entropy runs as AOT autograd's partitioned graphs.

torchtitan compiles its loss with the model by default, and a Hugging Face causal LM computes its loss
(``ForCausalLMLoss``: ``logits.float()``, then ``cross_entropy``) inside the forward the Trainer compiles
(:mod:`memplan.estimate.compiled_loss`). Here the model's ``loss_function`` is replaced by the same function
traced by ``aot_function`` with inductor's decompositions and partitioner, as the decoder layers are
(:mod:`memplan.trace.runners.partitioner`): the step keeps the partitioner's saved set from the loss's
forward to its backward, recorded under ``"loss"`` beside the layers'.

Modelled: the saved set. Not modelled: inductor's fused kernels (the graphs run operator by operator, so
the loss's forward and backward hold logits-sized fp32 transients a fused kernel does not).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from memplan.errors import UnsupportedError
from memplan.trace.runners.partitioner import CompiledLayers, Quiet, boxed_compiler, recording_partition, warm_up

__all__ = ["LOSS_PATH", "compile_chunk_cross_entropy", "compile_loss"]

#: The key of the loss's saved set in :class:`~memplan.trace.runners.partitioner.CompiledLayers`.
LOSS_PATH = "loss"


def compile_loss(model: torch.nn.Module, record: CompiledLayers, *, quiet: Quiet | None = None) -> None:
    """Make ``model.loss_function`` (transformers' causal-LM loss) run as its partitioned graphs."""
    if not hasattr(model, "loss_function"):
        raise UnsupportedError("--compile-loss: the model has no loss_function (transformers' causal LM) to compile")
    loss = model.loss_function
    graphs: dict[Any, dict[str, Any]] = {}

    def compiled(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            raise UnsupportedError("--compile-loss: the traced loss takes no tensor beside the logits and labels")
        key = (tuple(logits.shape), logits.dtype, tuple(labels.shape), vocab_size, repr(sorted(kwargs.items())))
        state = graphs.get(key)
        if state is None:
            state = graphs[key] = {}
            state["fn"] = _traced(loss, vocab_size, kwargs, state)
            with quiet() if quiet is not None else contextlib.nullcontext():
                warm_up(state["fn"], [], [logits, labels])
        record.saved[LOSS_PATH] = state["saved"]
        return state["fn"](logits, labels)[0]

    model.loss_function = compiled


def _traced(loss: Any, vocab_size: int, kwargs: dict[str, Any], state: dict[str, Any]) -> Any:
    """The loss as a function of (logits, labels), compiled by ``aot_function``; the saved set goes to ``state``."""
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.decomposition import select_decomp_table

    def fn(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor]:
        return (loss(logits, labels, vocab_size, **kwargs),)

    return aot_function(fn, fw_compiler=boxed_compiler, bw_compiler=boxed_compiler, decompositions=select_decomp_table(),
                        partition_fn=recording_partition(lambda saved: state.__setitem__("saved", saved)))


def compile_chunk_cross_entropy(loss: Any, record: CompiledLayers, *, quiet: Quiet | None = None) -> None:
    """Make the chunked loss's per-chunk cross-entropy (``loss.cross_entropy``: torchtune compiles only
    ``compute_cross_entropy``) run as its partitioned graphs, one pair per chunk shape (equal chunks share it)."""
    function = loss.cross_entropy
    graphs: dict[Any, dict[str, Any]] = {}

    def compiled(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        key = (tuple(logits.shape), logits.stride(), logits.dtype, tuple(labels.shape))
        state = graphs.get(key)
        if state is None:
            state = graphs[key] = {}
            state["fn"] = _traced_pair(function, state)
            with quiet() if quiet is not None else contextlib.nullcontext():
                warm_up(state["fn"], [], [logits, labels])
        record.saved[LOSS_PATH] = state["saved"]
        return state["fn"](logits, labels)[0]

    loss.cross_entropy = compiled


def _traced_pair(function: Any, state: dict[str, Any]) -> Any:
    """``function(logits, labels)`` compiled by ``aot_function``; the saved set goes to ``state``."""
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.decomposition import select_decomp_table

    def fn(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor]:
        return (function(logits, labels),)

    return aot_function(fn, fw_compiler=boxed_compiler, bw_compiler=boxed_compiler, decompositions=select_decomp_table(),
                        partition_fn=recording_partition(lambda saved: state.__setitem__("saved", saved)))
