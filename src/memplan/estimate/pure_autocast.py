"""accelerate's autocast over a 16-bit model: ``--precision bf16`` / ``fp16`` under the Hugging Face Trainer.

memplan's hf ``bf16`` is the Trainer's ``--bf16`` with the model loaded in bfloat16 (frameworks/hf_args.py). accelerate
sets ``native_amp`` from the trainer's ``mixed_precision``, not from the weights' dtype (``Accelerator.__init__``,
accelerate/accelerator.py; not under DeepSpeed), and ``prepare_model`` wraps ``model.forward`` in its
``torch.autocast`` context (beside ``convert_outputs_to_fp32``): the forward of a 16-bit model runs under autocast too.
The linears find their weights and inputs 16-bit already, so autocast makes no weight copies; but every op on CUDA
autocast's fp32 lists returns fp32 from 16-bit inputs (aten/src/ATen/autocast_mode.cpp: ``layer_norm``, ``pow``,
``softmax`` / ``log_softmax`` without a dtype through ``fp32_set_opt_dtype``...): GPT-2's LayerNorms and its
``gelu_new`` chain (``pow``) keep fp32 tensors, its eager softmax an fp32 output and its cast. The estimate prices
them as it prices ops under autocast on a 16-bit frozen base: the activation shape's ``autocast_ops``
(:func:`memplan.estimate.context.activation_shape`), switched here by the engine's profile
(``FrameworkProfile.autocast_16bit_weights``: a ``--zero`` job runs DeepSpeed's engine, which has none).
An eager LayerNorm's fp32 copy then replaces its 16-bit input (``norm_copy_replaces_input``: priced as the excess).
Witness: ``memplan trace`` runs the same autocast (benchmarks/tracefid18_witness.py). Full training only; not modelled:
fine-tuning at pure bf16/fp16 under the Trainer (adapters and frozen bases under this autocast), which both engines
still run without it (:meth:`memplan.profiles.framework.FrameworkProfile.pure_autocast`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memplan.job import Job
    from memplan.profiles.framework import FrameworkProfile

__all__ = ["applies", "note"]


def applies(job: Job, profile: FrameworkProfile) -> bool:
    """A 16-bit precision without an fp32 master whose trainer still runs the forward under ``torch.autocast``
    (:meth:`FrameworkProfile.pure_autocast`; full training only)."""
    return profile.pure_autocast(job)


def note(job: Job) -> str:
    """The sentence of :func:`applies`."""
    dtype = job.precision.compute_dtype
    return (f"{dtype} weights under the trainer's --{dtype} (accelerate's native_amp): the forward still runs under "
            f"torch.autocast({dtype}), so ops on CUDA autocast's fp32 lists (layer_norm, pow, softmax without a "
            f"dtype) return fp32 from {dtype} inputs; no weight copies (the weights are {dtype} already)")
