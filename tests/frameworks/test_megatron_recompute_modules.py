"""Megatron ``--recompute-modules`` (a space-separated list) mapped into ``Job.recompute.modules``,
with Megatron's own refusals."""

from __future__ import annotations

import pytest

from memplan.errors import JobConfigError, ModelConfigError
from memplan.estimate import estimate
from memplan.frameworks.megatron_args import from_megatron_args

DENSE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --swiglu --seq-length 1024 "
         "--tokenizer-type NullTokenizer --vocab-size 32000 --micro-batch-size 2 --bf16 ")
MOE = DENSE + "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 "


def _modules(args: str) -> tuple[str | None, tuple[str, ...]]:
    _, job = from_megatron_args(args, gpus=1)
    return job.recompute.modules, job.recompute.module_names


def test_module_list_is_mapped_in_order() -> None:
    assert _modules(DENSE + "--recompute-granularity selective --recompute-modules core_attn mlp") == (
        "core_attn,mlp", ("core_attn", "mlp"))
    assert _modules(DENSE + "--recompute-granularity selective --recompute-modules mlp") == ("mlp", ("mlp",))


def test_default_is_core_attn_and_the_flag_alone_is_an_empty_list() -> None:
    assert _modules(DENSE + "--recompute-activations") == (None, ("core_attn",))
    assert _modules(DENSE + "--recompute-granularity selective --recompute-modules") == ("", ())


def test_modules_are_ignored_without_selective_granularity_as_megatron_does() -> None:
    _, job = from_megatron_args(DENSE + "--recompute-granularity full --recompute-modules mlp", gpus=1)
    assert job.recompute.mode == "full" and job.recompute.modules is None
    _, job = from_megatron_args(DENSE + "--recompute-modules mlp", gpus=1)
    assert job.recompute.mode == "none" and job.recompute.modules is None


def test_deprecated_moe_layer_recompute_adds_moe() -> None:
    assert _modules(MOE + "--moe-layer-recompute") == ("core_attn,moe", ("core_attn", "moe"))
    with pytest.raises(ModelConfigError, match="--moe-layer-recompute"):
        from_megatron_args(MOE + "--moe-layer-recompute --recompute-granularity full", gpus=1)


def test_mapped_modules_change_the_estimate() -> None:
    model, core = from_megatron_args(DENSE + "--recompute-activations", gpus=1)
    _, mlp = from_megatron_args(DENSE + "--recompute-granularity selective --recompute-modules core_attn mlp", gpus=1)
    assert estimate(model, mlp).stages[0].activations_bytes < estimate(model, core).stages[0].activations_bytes


@pytest.mark.parametrize(("extra", "error", "says"), [
    ("--recompute-modules core_attn moe_act", ModelConfigError, "--moe-grouped-gemm"),
    ("--moe-shared-expert-intermediate-size 512 --moe-shared-expert-overlap --recompute-modules shared_experts",
     ModelConfigError, "--moe-shared-expert-overlap"),
    ("--recompute-modules core_attn gdn_norm_out", JobConfigError, "does not model"),
    ("--moe-grouped-gemm --fp8-format hybrid --recompute-modules layernorm", ModelConfigError, "delayed scaling"),
    ("--recompute-modules attn", JobConfigError, "must be a comma list of"),
])
def test_megatron_refusals(extra: str, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        from_megatron_args(MOE + "--recompute-granularity selective " + extra, gpus=1)


def test_mla_up_proj_on_a_model_without_mla_is_refused() -> None:
    model, job = from_megatron_args(DENSE + "--recompute-granularity selective --recompute-modules mla_up_proj",
                                    gpus=1)
    with pytest.raises(JobConfigError, match="multi-latent attention"):
        estimate(model, job)


def test_overriding_the_recompute_mode_drops_the_mapped_modules() -> None:
    from memplan.jobflags import build_job

    _, job = from_megatron_args(DENSE + "--recompute-granularity selective --recompute-modules core_attn mlp", gpus=1)
    assert build_job({"recompute": "full"}, job).recompute.modules is None
    assert build_job({"mbs": 4}, job).recompute.modules == "core_attn,mlp"


def test_fp8_with_a_recipe_other_than_delayed_may_recompute_norms() -> None:
    assert _modules(MOE + "--recompute-granularity selective --fp8-format hybrid --fp8-recipe tensorwise "
                    "--moe-grouped-gemm --recompute-modules layernorm moe_act")[0] == "layernorm,moe_act"
