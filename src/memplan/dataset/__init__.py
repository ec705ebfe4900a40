"""The user's own data: token lengths of a real dataset, batched as the trainer batches, priced per step.

Example::

    >>> from memplan.dataset import DatasetRequest, Batching, Fields, analyze    # doctest: +SKIP
    >>> peaks = analyze(loaded, DatasetRequest(path="train.jsonl", fields=Fields(messages="messages"),
    ...                 tokenizer="tok/", batching=Batching(rule="hf", micro_batch_size=8)))
    >>> peaks.worst.seq_length, peaks.steps_over_gpu

Steps: :mod:`~memplan.dataset.lengths` (read with ``datasets``, tokenize with ``tokenizers``, cache),
:mod:`~memplan.dataset.batching` (each trainer's sampler and collator), :mod:`~memplan.dataset.peaks`
(the estimator once per distinct shape). Known limitations: one GPU's view (with data parallelism each
micro-batch is one rank's step); images count as their tokens (:mod:`~memplan.dataset.images`),
not as vision-encoder work; Axolotl's packing order is a seeded stand-in (see :mod:`~memplan.dataset.multipack`).
"""

from __future__ import annotations

from dataclasses import field
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is imported only when the package is used
    from memplan.dataset.batching import Batching, StepShapes, plan_steps
    from memplan.dataset.lengths import Fields, token_lengths
    from memplan.dataset.peaks import DatasetPeaks, WorstStep, step_peaks
    from memplan.dataset.tokenizer import TokenizerFiles, find_tokenizer

from memplan.dataset.rules import RULES
from memplan.frozen import frozen_dataclass

_LAZY = {"Batching": "batching", "StepShapes": "batching", "plan_steps": "batching", "Fields": "lengths",
         "token_lengths": "lengths", "DatasetPeaks": "peaks", "WorstStep": "peaks", "step_peaks": "peaks",
         "TokenizerFiles": "tokenizer", "find_tokenizer": "tokenizer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"memplan.dataset.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'memplan.dataset' has no attribute {name!r}")


__all__ = ["RULES", "Batching", "DatasetPeaks", "DatasetRequest", "Fields", "StepShapes", "TokenizerFiles",
           "WorstStep", "analyze", "dataset_lengths", "find_tokenizer", "plan_steps", "step_peaks", "token_lengths"]


@frozen_dataclass(kw_only=True)
class DatasetRequest:
    """What ``--dataset`` and its options give."""

    path: str
    fields: Fields = field(default_factory=lambda: __getattr__("Fields")())
    #: ``--tokenizer`` (None: the model's own).
    tokenizer: str | None = None
    batching: Batching = field(default_factory=lambda: __getattr__("Batching")())
    #: ``--images-field``: the column of each example's image(s) (None: text only).
    images: str | None = None
    #: ``--vision-model``: the model whose processor counts image tokens (None: the model's own).
    vision_model: str | None = None


def dataset_lengths(loaded: object, request: DatasetRequest) -> tuple[object, bool]:
    """The examples' token lengths (numpy int64) for ``loaded``'s model and whether they came from the cache."""
    from dataclasses import replace

    from memplan.dataset.lengths import token_lengths
    from memplan.dataset.tokenizer import find_tokenizer

    tokenizer = find_tokenizer(request.tokenizer, getattr(loaded, "model_ref", None))
    fields = replace(request.fields, add_eos=request.batching.rule.startswith("trl"))
    model = getattr(loaded, "model")
    lengths, cached = token_lengths(request.path, fields, tokenizer, vocab_size=getattr(model, "vocab_size", None))
    if request.images is None:
        return lengths, cached
    from memplan.dataset.images import row_image_tokens

    extra, _ = row_image_tokens(request.path, fields, request.images,
                                request.vision_model or getattr(loaded, "model_ref", None))
    return lengths + extra, cached


def analyze(loaded: object, request: DatasetRequest, *, lengths: tuple[Any, bool] | None = None) -> DatasetPeaks:
    """Per-step peaks of training ``loaded`` (a :class:`memplan.inputs.LoadedJob`) on the dataset
    (``lengths``: what :func:`dataset_lengths` already returned for it)."""
    from memplan.dataset.batching import plan_steps
    from memplan.dataset.peaks import step_peaks
    from memplan.estimate.engine import DEFAULT_FRAGMENTATION
    from memplan.gpus import get_gpu

    lengths, cached = lengths if lengths is not None else dataset_lengths(loaded, request)
    shapes = plan_steps(lengths, request.batching)
    gpu_name = getattr(loaded, "gpu")
    fragmentation = getattr(loaded, "fragmentation")
    limit = request.batching.effective_max_length
    shown = lengths if limit is None else lengths.clip(max=limit)  # type: ignore[attr-defined]
    return step_peaks(getattr(loaded, "model"), getattr(loaded, "job"), shapes, shown, rule=request.batching.rule,
                      gpu=get_gpu(gpu_name) if gpu_name else None,
                      fragmentation=DEFAULT_FRAGMENTATION if fragmentation is None else fragmentation,
                      from_cache=cached)
