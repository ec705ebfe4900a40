"""The estimate's allocated figure at one moment pinned to the trace's (issue 25, the reserved witness's two
allocated misses): the foreach step's temporaries in each tensor's state dtype, and autocast's cached
weight copies at the loss.

The traced figures are memplan trace runs of the agreement-grid cells (``benchmarks/reserved_witness.py``'s
cells, traced with the grid's own settings; ``benchmarks/results/agreement_reserved*.json`` and
docs/benchmarks.md "issue 25, estimator misses found by the reserved witness"). Tolerance: 1% of the
traced moment (both misses were 6-8% before).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest

from memplan import estimate, load_model
from memplan.estimate import ledger as ledger_module
from memplan.estimate.context import run_context, stage_context
from memplan.estimate.engine import _stages
from memplan.estimate.layout import pipeline_layout
from memplan.estimate.stage_states import model_states
from memplan.jobflags import build_job

MiB = 2**20
CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
TOLERANCE = 0.01

_LORA = {"seq": 4096, "framework": "hf", "precision": "bf16-mixed", "attention": "sdpa", "recompute": "full", "optimizer": "adamw",
         "optimizer_impl": "foreach", "peft": "lora", "lora_rank": 64, "lora_alpha": 16.0, "lora_dropout": 0.05,
         "lora_targets": "all-linear", "checkpoint_reentrant": True, "modules_to_save": "embed_tokens,lm_head"}
_TORCHTITAN = {"seq": 2048, "precision": "bf16-mixed", "attention": "sdpa", "recompute": "selective",
               "optimizer": "adamw", "optimizer_impl": "foreach", "framework": "torchtitan"}
#: The trace of qwen1-7b s4096 LoRA r64 all-linear, modules_to_save=embed_tokens,lm_head (the grid cell):
#: its optimizer states (two moments of the fp32 adapters and the bf16 copies; agreement_reserved_arch.json)
#: and its highest allocated figure in the optimizer step and over the step.
LORA_TRACED_STATES = 6_257_901_568
LORA_TRACED_STEP = 31_087_469_568
LORA_TRACED_PEAK = 33_474_078_720
#: The trace of llama-3.2-1b s2048 torchtitan selective (no FSDP, autocast): its highest allocated figure
#: in the forward, at the loss (``nll_loss_forward``).
TORCHTITAN_TRACED_LOSS = 21_233_519_104
#: The trace of llama-3.2-1b s1024 hf full recompute (autocast): its highest allocated figure in the forward.
HF_TRACED_LOSS = 18_778_749_440
#: The trace of the fine-tuning grid's qwen2.5-7b QLoRA NF4 r64 all-linear full recompute s512 cell: its
#: peak, in the forward at the loss (benchmarks/results/finetune_grid.json, re-traced 2026-12-06 16:18).
QLORA_TRACED_LOSS = 8_700_859_904


def _moments(model: str, flags: dict[str, object]) -> dict[str, int]:
    """Allocated bytes at each candidate moment of the (single) stage's ledger."""
    seen: dict[str, int] = {}
    real = ledger_module.Ledger.peak

    def peak(self):  # type: ignore[no-untyped-def]
        seen.update({p: self.allocated_at(p) for p in ledger_module.PHASES})
        return real(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ledger_module.Ledger, "peak", peak)
        _stages.cache_clear()
        estimate(load_model(model), build_job(flags))
    _stages.cache_clear()
    return seen


def _close(estimated: int, traced: int) -> bool:
    return abs(estimated - traced) <= TOLERANCE * traced


def test_the_foreach_step_makes_sqrt_v_in_each_dtype_groups_state_dtype() -> None:
    """torch's ``_multi_tensor_adam`` groups the tensors by dtype; each group's ``sqrt(exp_avg_sq)`` is in
    that group's state dtype and stays alive while the next group's is made (run here on the CPU)."""
    torch = pytest.importorskip("torch")
    params = [torch.nn.Parameter(torch.zeros(64, 32)), torch.nn.Parameter(torch.zeros(1000, 32, dtype=torch.bfloat16))]
    opt = torch.optim.AdamW(params, foreach=True)
    made: list[weakref.ref] = []
    alive_at_most = 0

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            nonlocal alive_at_most
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._foreach_sqrt.default:
                made.extend(weakref.ref(t) for t in out)
                alive_at_most = max(alive_at_most, sum(t().nbytes for t in made if t() is not None))
            return out

    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        with Watch():
            opt.step()
    state_bytes = sum(opt.state[p]["exp_avg_sq"].nbytes for p in params)
    assert opt.state[params[1]]["exp_avg_sq"].dtype == torch.bfloat16
    assert alive_at_most == state_bytes == 64 * 32 * 4 + 1000 * 32 * 2


def test_lora_copies_step_temporaries_are_their_bf16_states() -> None:
    """fp32 adapters beside bf16 ``modules_to_save`` copies: the step's temporaries are the traced
    ``exp_avg_sq`` bytes (half the traced states), not every trainable element in fp32."""
    model, job = load_model(str(CONFIGS / "qwen1-7b.json")), build_job(_LORA)
    run = run_context(model, job, 0.1)
    layout = pipeline_layout(model.num_layers, job.parallel, job.num_microbatches, run.profile.pipeline_split)[0]
    st = model_states(stage_context(run, layout))
    assert st.step_temp == LORA_TRACED_STATES // 2
    moments = _moments(str(CONFIGS / "qwen1-7b.json"), _LORA)
    assert _close(moments["optimizer step"], LORA_TRACED_STEP), moments["optimizer step"] / MiB
    assert _close(max(moments.values()), LORA_TRACED_PEAK)


def test_torchtitan_loss_holds_autocasts_cached_copies_of_checkpointed_layers() -> None:
    """torchtitan computes the loss inside ``maybe_enable_amp``: autocast's cache still holds the bf16
    copies of every layer's weights (per-op SAC saves none of them), beside the logits, their fp32 copy
    and the fp32 log-softmax (not yet the log-softmax backward's three fp32 tensors)."""
    moments = _moments("llama-3.2-1b", _TORCHTITAN)
    assert _close(moments["loss"], TORCHTITAN_TRACED_LOSS), moments["loss"] / MiB


def test_hf_loss_under_full_recompute_holds_every_layers_cached_copy() -> None:
    """The HF model computes its loss in the forward, inside autocast: under full recompute no layer saves
    its weight copies, but the cache holds them all at the loss."""
    flags = {"seq": 1024, "precision": "bf16-mixed", "attention": "sdpa", "recompute": "full",
             "optimizer": "adamw", "optimizer_impl": "foreach", "framework": "hf"}
    moments = _moments("llama-3.2-1b", flags)
    assert _close(moments["loss"], HF_TRACED_LOSS), moments["loss"] / MiB


def test_fp32_adapters_of_checkpointed_layers_are_cached_at_the_loss() -> None:
    """peft's fp32 lora_A / lora_B are linears under autocast: their bf16 copies are cached like the base
    weights' (QLoRA: the NF4 base itself is not a cast weight)."""
    flags = {"seq": 512, "mbs": 1, "precision": "bf16-mixed", "optimizer": "adamw", "attention": "sdpa",
             "framework": "hf", "recompute": "full", "peft": "lora", "lora_rank": 64, "lora_targets": "all-linear",
             "quantize_base": "nf4"}
    moments = _moments("qwen2.5-7b", flags)
    assert _close(moments["loss"], QLORA_TRACED_LOSS), moments["loss"] / MiB
