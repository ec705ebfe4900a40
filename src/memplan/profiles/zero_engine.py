"""The engine a ZeRO stage runs on: a framework whose ``--zero`` hands the model to another framework's engine.

The Hugging Face Trainer runs ZeRO only through its DeepSpeed integration (``TrainingArguments(deepspeed=...)``:
DeepSpeed's engine holds the 16-bit weights, the fp32 master weights and moments, the 16-bit gradients and its
reduce buckets; the Trainer's own AMP and DDP are not used), so ``--framework hf --zero N`` is priced as
``--framework deepspeed --zero N`` (the profile's ``zero_framework``), as memplan's TrainingArguments reader reads a
``--deepspeed`` run and as the doctor's ZeRO fix names it. This is the one place the estimator moves such a job.

The engine owns the model states and its buffers only: the Trainer still runs the HF model's forward and its own loop,
so what they decide stays the user's framework's (:data:`MODEL_CODE_FACTS`). The engine's parameter cast does reach
the model: DeepSpeed casts every parameter to the 16-bit dtype below ZeRO-3 (``_cast_module_mixed_precision``, the
routers that transformers keeps in fp32 too) and accelerate turns ``native_amp`` (autocast) off under DeepSpeed
(accelerate/accelerator.py), so a ``*-mixed`` job runs its 16-bit weights without autocast, as the runner prices it.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

from memplan.errors import JobConfigError
from memplan.profiles.framework import FrameworkProfile, get_profile

__all__ = ["MODEL_CODE_FACTS", "engine_profile", "zero_engine"]

#: The profile facts the model's code and the training loop decide, which the user's framework keeps when another
#: framework's engine runs its ZeRO stage: transformers' forward keeps ``inputs_embeds`` bound; HF's TP plan keeps
#: the vocabulary whole; the loop's ``save_on_cpu`` offloads tensor by tensor; ``torch.compile`` of the Trainer's
#: model compiles the loss the HF causal LM computes inside its forward.
MODEL_CODE_FACTS = ("binds_embedding_output", "vocab_parallel", "activation_offload", "compiles_loss")


@lru_cache(maxsize=None)
def engine_profile(framework: str) -> FrameworkProfile:
    """The profile a ``--zero`` job of ``framework`` is priced under: its ``zero_framework``'s (the engine's states,
    buffers and defaults) with ``framework``'s :data:`MODEL_CODE_FACTS`."""
    own = get_profile(framework)
    runner = get_profile(own.zero_framework or framework)
    return dataclasses.replace(runner, **{fact: getattr(own, fact) for fact in MODEL_CODE_FACTS})


def zero_engine(job: Any) -> tuple[Any, str | None]:
    """(``job`` as the engine that runs its ZeRO stage sees it, the sentence saying so; None when it runs on its own
    framework). ``job`` is a :class:`memplan.job.Job` (this layer sits below it); a setting that engine refuses is a
    ``JobConfigError`` naming ``--zero``, the framework and the rule."""
    sharding = job.sharding
    if not sharding.zero or sharding.fsdp != "none":  # --zero 3 --fsdp: PyTorch FSDP's
        return job, None
    runner = get_profile(job.framework).zero_framework
    if runner is None:
        return job, None
    named = f"--framework {job.framework} --zero {job.sharding.zero}"
    if job.recompute.mode == "selective":  # the alias means the user's framework's policy, not the runner's
        own = get_profile(job.framework).selective_policy
        if own not in get_profile(runner).activation_policies:
            raise JobConfigError("--zero", f"{job.sharding.zero} under --framework {job.framework} runs {runner}'s "
                                 f"engine (as --framework {runner}), which cannot run --recompute selective as "
                                 f"{job.framework} means it ({own})", job.sharding.zero)
    try:
        moved = dataclasses.replace(job, framework=runner)
    except JobConfigError as exc:
        raise JobConfigError("--zero", f"{job.sharding.zero} under --framework {job.framework} runs {runner}'s engine "
                             f"(as --framework {runner}), which refuses this job ({exc})", job.sharding.zero) from None
    return moved, (f"{named}: the Hugging Face Trainer runs ZeRO through its DeepSpeed integration, so the step is "
                   f"priced as --framework {runner} --zero {job.sharding.zero} ({runner}'s engine: its 16-bit weights "
                   "and gradients, fp32 master weights and moments, reduce buckets; not the Trainer's autocast), with "
                   f"{job.framework}'s model code and loop (the bound inputs_embeds, HF's TP plan, save_on_cpu per "
                   "tensor, the loss compiled inside the forward)")
