"""``--loss fused-linear`` / ``chunked``: cross-entropy fused with the output head, chunk by chunk.

The algorithm of Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction`` (the fine-tuners' fused
linear cross-entropy), on PyTorch operators so it runs on fake tensors: the tokens are cut into
chunks of ``next_pow2(ceil(tokens / ceil(vocab / hidden)))``; for each chunk the forward computes
its logits (compute dtype, chunk x vocab), turns them into their gradient in place (Liger's Triton
kernel; here no allocation), writes the chunk's input gradient into a ``tokens x hidden`` buffer
and accumulates the head weight's gradient into a buffer shaped like the weight. The whole logits
never exist; the backward only scales the two saved gradients. The head's weight gradient is then
handed to autograd as the weight's ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memplan.errors import UnsupportedError

__all__ = ["FusedLinearCrossEntropy", "chunk_tokens", "decoder_call", "decoder_call_and_loss", "fused_linear_cross_entropy"]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's chunk size: ``next_power_of_2(ceil(tokens / ceil(vocab / hidden)))``."""
    return _next_pow2(-(-tokens // -(-vocab // hidden)))


class FusedLinearCrossEntropy(torch.autograd.Function):
    """``sum(CE(hidden @ weight.T, labels)) / n``, gradients computed in the forward per chunk."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tokens, width = hidden.shape
        vocab = weight.shape[0]
        w = weight.to(hidden.dtype)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        losses = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        size = chunk_tokens(tokens, vocab, width)
        for start in range(0, tokens, size):
            part = hidden[start:start + size]
            logits = part @ w.t()  # becomes its own gradient in place (Liger's cross-entropy kernel)
            grad_hidden[start:start + size] = logits @ w
            if grad_weight is not None:
                grad_weight.add_(logits.t().to(grad_weight.dtype) @ part.to(grad_weight.dtype))
            del logits
        del w
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.labels_shape = labels.shape
        return losses.sum() / max(tokens, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden.mul_(grad)
        if grad_weight is not None:
            grad_weight.mul_(grad)
        return grad_hidden, grad_weight, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss of ``hidden`` (batch x seq x hidden) under the head ``weight``; labels shifted
    by padding (as transformers' ``ForCausalLMLoss``), so no copy of the hidden states is made."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return FusedLinearCrossEntropy.apply(flat, weight, labels.reshape(-1))


def decoder_call(model: torch.nn.Module, needs: str) -> tuple[Callable[..., Any], torch.nn.Module, torch.nn.Module]:
    """(what the step calls instead of ``model(**batch)``: its decoder, without labels; the transformers model under
    peft's wrapper; its output head) for a loss computed outside the model from the decoder's output; ``needs``:
    the refusal's sentence where the model has no decoder or head."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    decoder = base.get_decoder() if callable(getattr(base, "get_decoder", None)) else None
    head = base.get_output_embeddings() if callable(getattr(base, "get_output_embeddings", None)) else None
    if decoder is None or head is None:
        raise UnsupportedError(needs)

    def call(**batch: Any) -> Any:
        return decoder(**{k: v for k, v in batch.items() if k != "labels"})

    return call, base, head


def decoder_call_and_loss(model: torch.nn.Module) -> tuple[Callable[..., Any], Callable[[Any, Any], torch.Tensor]]:
    """What the step calls instead of ``model(**batch)`` (its decoder, without labels) and the loss
    computed from the decoder's output and the batch's labels; through peft's wrapper too."""
    needs = "--loss fused-linear needs a transformers causal LM with get_decoder() and an output head with a weight"
    call, _, head = decoder_call(model, needs)
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise UnsupportedError(needs)

    def loss(output: Any, batch: Any) -> torch.Tensor:
        labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
        return fused_linear_cross_entropy(output.last_hidden_state, head.weight, labels)

    return call, loss
