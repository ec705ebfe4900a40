"""Whose model code runs the layers: what torchtitan's own models keep that transformers' modules do not.

``--framework torchtitan`` prices torchtitan's training loop (FSDP2, its per-op checkpointing, fused
AdamW). With a model given by flags that loop runs transformers' modules (what ``memplan trace
--framework torchtitan MODEL`` runs); a job read from a torchtitan TOML (``--torchtitan-config``)
runs torchtitan's own ``model.py`` and ``parallelize.py`` (``Job.torchtitan_model``), which differ
in what they save for the backward. Each difference is a field here, with its source (torchtitan
0.2.2, the JobConfig of commit 238fa99; torch 2.13).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.frozen import frozen_dataclass

if TYPE_CHECKING:
    from memplan.job import Job

__all__ = ["HF_MODEL_CODE", "TORCHTITAN_MODEL_CODE", "ModelCode", "model_code", "model_code_notes", "sdpa_attention"]

#: SDPA backends that take fp32 inputs: cuDNN and flash take fp16/bf16 only (their dtype checks in
#: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; memplan.trace.cuda.sdpa follows them).
_FP32_BACKENDS = ("efficient", "math")


@frozen_dataclass(kw_only=True)
class ModelCode:
    """What one implementation of the decoder layers saves for the backward."""

    name: str
    #: The RMSNorm is ``nn.RMSNorm`` / ``F.rms_norm``: on CUDA ``rms_norm_symint``
    #: (aten/src/ATen/native/layer_norm.cpp) calls ``aten._fused_rms_norm``, whose autograd formula saves
    #: the input and an fp32 1/rms per token only (derivatives.yaml), also for a DTensor input (DTensor
    #: shards the fused op: ``rms_norm_single_dim_strategy`` in torch/distributed/tensor/_ops/_math_ops.py).
    #: False: transformers' reference RMSNorm (an fp32 copy of the input and the normalized tensor).
    fused_rms_norm: bool
    #: RoPE reads a precomputed table registered as a buffer (torchtitan's ``freqs_cis``, sliced as a
    #: view each step): no cos/sin tables are made per forward. False: transformers' rotary embedding
    #: returns new cos/sin tables every forward, saved by the layers.
    rope_buffer: bool
    #: The SDPA backends the model lets PyTorch choose from. torchtitan's
    #: ``ScaledDotProductAttentionWrapper`` (torchtitan/models/attention.py) runs SDPA under
    #: ``sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, MATH])``: no memory-efficient kernel.
    sdpa_backends: tuple[str, ...]
    #: Under tensor parallelism with sequence parallelism the linear layers save the all-gathered,
    #: whole-sequence input: torchtitan's plan (``PrepareModuleInput`` redistributes the norm's
    #: ``Shard(1)`` output to ``Replicate`` before q/k/v and gate/up; DTensor's ``mm`` saves that tensor).
    #: False: Megatron's linear layers save their sequence shard and gather it again in the backward.
    sp_saves_gathered_input: bool
    #: The routed experts' gate and up weights are one stacked tensor (transformers' ``gate_up_proj``, which
    #: the grouped GEMM saves whole). False: torchtitan's ``GroupedExperts`` keeps ``w1``, ``w2`` and ``w3``.
    stacked_gate_up: bool


HF_MODEL_CODE = ModelCode(name="transformers", fused_rms_norm=False, rope_buffer=False,
                          sdpa_backends=("cudnn", "flash", "efficient", "math"), sp_saves_gathered_input=False,
                          stacked_gate_up=True)

TORCHTITAN_MODEL_CODE = ModelCode(name="torchtitan", fused_rms_norm=True, rope_buffer=True,
                                  sdpa_backends=("cudnn", "flash", "math"), sp_saves_gathered_input=True,
                                  stacked_gate_up=False)


def model_code(job: Job) -> ModelCode:
    """The model code ``job`` runs: torchtitan's own for a job read from a torchtitan TOML and priced
    as torchtitan (``--framework torchtitan``, the TOML's default)."""
    return TORCHTITAN_MODEL_CODE if job.torchtitan_model and job.framework == "torchtitan" else HF_MODEL_CODE


def sdpa_attention(code: ModelCode, attention: str, compute_bytes: int) -> str:
    """The attention kernel priced for ``--attention`` under ``code``: ``math`` where no allowed SDPA
    backend takes the activations' dtype but the math one (fp32 activations under torchtitan's wrapper:
    cuDNN and flash take 16-bit inputs only), else ``attention`` unchanged.

    >>> sdpa_attention(TORCHTITAN_MODEL_CODE, "flash", 4), sdpa_attention(TORCHTITAN_MODEL_CODE, "flash", 2)
    ('math', 'flash')
    """
    if attention == "eager" or compute_bytes < 4:
        return attention
    fp32 = [b for b in code.sdpa_backends if b in _FP32_BACKENDS]
    return "math" if fp32 == ["math"] else attention


def model_code_notes(code: ModelCode, attention: str, compute_bytes: int, sequence_parallel: bool) -> tuple[str, ...]:
    """The assumptions ``code`` adds to an estimate (none for transformers' modules)."""
    if not code.fused_rms_norm and not code.rope_buffer:
        return ()
    notes = [(f"{code.name}'s own model code: its RMSNorm is PyTorch's fused one (aten._fused_rms_norm on CUDA), "
              "which keeps its input and an fp32 1/rms per token; RoPE reads a precomputed buffer (freqs_cis), so no "
              "cos/sin tables are made per step")]
    if sequence_parallel and code.sp_saves_gathered_input:
        notes.append("sequence parallelism through DTensor (torchtitan's TP plan): the linear layers after each norm "
                     "keep their all-gathered whole-sequence input, not the shard")
    if sdpa_attention(code, attention, compute_bytes) == "math":
        notes.append(f"{code.name}'s SDPA wrapper allows {', '.join(code.sdpa_backends)} only and cuDNN and flash take "
                     "16-bit inputs: with fp32 activations the math kernel runs, which keeps the fp32 s x s softmax "
                     "per head and copies of q, k and v (per query head); per-op selective checkpointing keeps none "
                     "of it (the math composite's ops are not in torchtitan's save list)")
    return tuple(notes)
