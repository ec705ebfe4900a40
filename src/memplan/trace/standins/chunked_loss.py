"""``--loss chunked``: torchtune's chunked-output cross-entropy (``CEWithChunkedOutputLoss``) on a causal LM.

The algorithm as torchtune runs it (torchtune/modules/loss/ce_chunked_output_loss.py and its decoder's
``num_output_chunks``): the final hidden states are cut into :data:`CHUNKS` pieces along the sequence
(``tensor_split``, views), the output head runs on each piece, so the model's output is a list of 16-bit
logits chunks; the loss cuts the labels the same way and, chunk by chunk, upcasts the chunk's logits to fp32
and takes a summed cross-entropy (``compute_cross_entropy``), then divides the total by the count of
labelled tokens. Gemma 2's final soft-capping runs on each chunk after the head, as the model's forward does
on the whole logits.

The head runs inside the model's forward (torchtune's ``TransformerDecoder.forward`` returns the chunks; its
recipes call the loss on them afterwards): the step calls the model itself with its forward, for that call, made
the decoder and the chunked head (:func:`chunked_call_and_loss`). So FSDP2's hooks on the root run around decoder
and head (the root's pre-forward first; its post-forward frees the forward's last all-gather output before the
loss), the head's unit (accelerate's and torchtitan's [final norm, head]) is all-gathered by its own hooks at its
first chunk, and the trace's module paths are the root's (the head's autocast copies are filed under the head).

``--compile``: torchtune compiles only ``compute_cross_entropy`` (its ``compile_loss`` calls the loss's
``apply_compile_strategy``); :func:`memplan.trace.runners.compiled_loss.compile_chunk_cross_entropy` replaces
:attr:`ChunkedOutputLoss.cross_entropy` with that function as its partitioned graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from memplan.trace.standins.fused_loss import decoder_call

__all__ = ["CHUNKS", "ChunkedOutputLoss", "chunk_cross_entropy", "chunked_call_and_loss"]

#: torchtune's default ``num_output_chunks`` (memplan.estimate.extras.CHUNKED_LOSS_CHUNKS).
CHUNKS = 8
_IGNORE = -100


def chunk_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One chunk's loss: its logits upcast to fp32, cross-entropy summed over its tokens."""
    return F.cross_entropy(logits.float(), labels, ignore_index=_IGNORE, reduction="sum")


class ChunkedOutputLoss:
    """The loss of a decoder output under a head run per chunk; ``cross_entropy`` is the per-chunk function
    (replaced by its compiled graphs under ``--compile``)."""

    def __init__(self, head: torch.nn.Module, softcap: float | None) -> None:
        self.head = head
        self.softcap = softcap
        self.cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = chunk_cross_entropy

    def logits(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """The model's output: the head on each sequence chunk of ``hidden`` (soft-capped when the model caps)."""
        out = []
        for piece in hidden.tensor_split(CHUNKS, dim=1):
            logits = self.head(piece)
            if self.softcap is not None:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            out.append(logits)
        return out

    def __call__(self, chunks: list[torch.Tensor], batch: Any) -> torch.Tensor:
        """The loss of the model's output (the chunks of :meth:`logits`)."""
        labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=_IGNORE)[..., 1:]
        count = (labels != _IGNORE).sum()
        pieces = [piece.reshape(-1) for piece in labels.tensor_split(CHUNKS, dim=1)]
        del labels
        total: Any = 0.0
        for logits, piece in zip(chunks, pieces, strict=True):
            total = total + self.cross_entropy(logits.reshape(-1, logits.shape[-1]), piece)
        del chunks
        return total / count


def chunked_call_and_loss(model: torch.nn.Module) -> tuple[Callable[..., Any], ChunkedOutputLoss]:
    """What the step calls instead of ``model(**batch)`` (the model, its forward for that call the decoder
    without labels and the chunked head) and the chunked loss of the model's output; through peft's wrapper too."""
    decoder, base, head = decoder_call(
        model, "--loss chunked needs a transformers causal LM with get_decoder() and an output head")
    softcap = getattr(getattr(base, "config", None), "final_logit_softcapping", None)
    loss = ChunkedOutputLoss(head, softcap)

    def forward(**batch: Any) -> list[torch.Tensor]:
        return loss.logits(decoder(**batch).last_hidden_state)

    def call(**batch: Any) -> list[torch.Tensor]:
        own = model.__dict__.get("forward")  # accelerate's fp32 wrapper, where set: not torchtune's output
        model.forward = forward  # type: ignore[method-assign]
        try:
            return model(**batch)
        finally:
            if own is None:
                del model.forward
            else:
                model.forward = own  # type: ignore[method-assign]

    return call, loss
