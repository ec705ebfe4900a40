"""Megatron's ``--recompute-modules``: what each module's checkpoint drops, checked against the
bytes of the tensors Megatron's code discards (memplan.estimate.recompute_modules), and the
refusals (one line, exit 2)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memplan import Job, load_model
from memplan.cli import app
from memplan.errors import JobConfigError
from memplan.estimate import estimate
from memplan.estimate.engine import layer_activation_costs
from memplan.estimate.recompute_modules import recomputed_peak
from memplan.job import Batch, Recompute

S, B = 1024, 2
TOKENS = S * B
#: bf16 activations
C = 2


def _job(modules: str | None, **kwargs: object) -> Job:
    return Job(batch=Batch(micro_batch_size=B, seq_length=S), recompute=Recompute(mode="selective", modules=modules),
               **kwargs)  # type: ignore[arg-type]


def _kept(model_name: str, modules: str | None, layer: int = 0) -> int:
    return layer_activation_costs(load_model(model_name), _job(modules), layer)[0]


def _dropped(model_name: str, modules: str, layer: int = 0) -> int:
    """Bytes ``modules`` drop relative to recomputing nothing (``--recompute-modules ""``)."""
    return _kept(model_name, "", layer) - _kept(model_name, modules, layer)


# llama-3.2-1b: h 2048, 32 heads, FFN 8192 (SwiGLU), TE's fused norm-linear modules.
DENSE = "llama-3.2-1b"
H, HEADS, F = 2048, 32, 8192


def test_default_is_core_attn_and_equals_the_old_selective_recompute() -> None:
    assert _kept(DENSE, None) == _kept(DENSE, "core_attn")
    kept, full, _ = layer_activation_costs(load_model(DENSE), _job(None), 0)
    # flash attention's core saves only the fp32 log-sum-exp per head and token
    assert full - kept == 4 * HEADS * TOKENS


def test_dense_mlp_drops_the_norm_output_fc1_output_and_activation_output() -> None:
    assert _dropped(DENSE, "mlp") == C * TOKENS * (H + 2 * F + F)
    assert _dropped(DENSE, "core_attn,mlp") == C * TOKENS * (H + 3 * F) + 4 * HEADS * TOKENS


@pytest.mark.parametrize("modules", ["layernorm", "moe", "shared_experts", "moe,shared_experts"])
def test_modules_a_dense_te_model_lacks_are_no_ops_and_say_so(modules: str) -> None:
    assert _dropped(DENSE, modules) == 0
    lines = [a for a in estimate(load_model(DENSE), _job(modules)).assumptions if "--recompute-modules" in a]
    assert len(lines) == 1 and "no effect on this model" in lines[0]


# deepseek-v2-lite: MLA (16 heads, qk 128+64, v 128, kv latent 512, no q latent); layer 1 is MoE:
# 64 experts of FFN 1408, top-6, two shared experts as one FFN of 2816.
MOE = "deepseek-v2-lite"
MLA_HEADS, QK, V, KV_LATENT = 16, 192, 128, 512
EXPERTS, TOP_K, F_EXPERT, F_SHARED = 64, 6, 1408, 2816


def test_mla_up_proj_drops_q_k_v_and_the_kv_latent_norm_output() -> None:
    qkv = C * TOKENS * MLA_HEADS * (QK + QK + V)
    assert _dropped(MOE, "mla_up_proj", 1) == qkv + C * TOKENS * KV_LATENT


def test_layernorm_drops_mla_input_norm_and_moe_pre_mlp_norm_outputs() -> None:
    assert _dropped(MOE, "layernorm", 1) == 2 * C * TOKENS * H
    # the dense first layer: the MLP's norm is fused into fc1, only MLA's input norm is separate
    assert _dropped(MOE, "layernorm", 0) == C * TOKENS * H


def test_moe_act_and_shared_experts() -> None:
    assert _dropped(MOE, "moe_act", 1) == C * TOKENS * TOP_K * F_EXPERT
    assert _dropped(MOE, "shared_experts", 1) == C * TOKENS * 3 * F_SHARED
    assert _dropped(MOE, "moe_act", 0) == _dropped(MOE, "shared_experts", 0) == 0


def test_moe_drops_everything_of_the_moe_layer_but_its_input() -> None:
    routed = TOKENS * TOP_K
    expected = (TOKENS * EXPERTS * (4 + 4 + 1)  # router logits, scores, routing map
                + routed * (8 + 4)  # permutation indices, probabilities
                + C * routed * H  # dispatched tokens
                + C * routed * 3 * F_EXPERT  # experts' fc1 output and activation output
                # no weighted combine: Megatron scales inside the experts (fused weighted SwiGLU)
                + C * TOKENS * 3 * F_SHARED)  # shared experts
    assert _dropped(MOE, "moe", 1) == expected
    assert _dropped(MOE, "moe,moe_act,shared_experts", 1) == expected
    assert _dropped(MOE, "mlp", 1) == 0  # Megatron's mlp recompute skips MoE layers


def test_backward_holds_the_larger_blocks_recompute() -> None:
    assert recomputed_peak([(10, "core"), (5, "mla_up"), (12, "moe"), (1, "")], frozenset({"core", "mla_up", "moe"})) == 15
    assert recomputed_peak([(10, "core"), (12, "moe")], frozenset({"core"})) == 10
    model = load_model(MOE)
    base, light = estimate(model, _job("core_attn")), estimate(model, _job("core_attn,moe"))
    assert light.peak_allocated_bytes < base.peak_allocated_bytes


def test_more_modules_never_keep_more() -> None:
    model = load_model(MOE)
    everything = "core_attn,layernorm,mla_up_proj,moe,moe_act,shared_experts,mlp"
    peaks = [estimate(model, _job(m)).stages[0].activations_bytes for m in ("", "core_attn", "core_attn,moe", everything)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4


runner = CliRunner()


@pytest.mark.parametrize(("args", "says"), [
    (["llama-3.2-1b", "--recompute", "selective", "--recompute-modules", "core_attn,attn"], "must be a comma list of"),
    (["llama-3.2-1b", "--recompute", "selective", "--recompute-modules", "mhc"], "does not model"),
    (["llama-3.2-1b", "--recompute", "full", "--recompute-modules", "mlp"], "only applies with --recompute selective"),
    (["llama-3.2-1b", "--recompute-modules", "mlp"], "only applies with --recompute selective"),
    (["llama-3.2-1b", "--recompute", "selective", "--recompute-modules", "mla_up_proj"], "multi-latent attention"),
    (["llama-3.2-1b", "--recompute", "selective", "--recompute-modules", "moe_act"], "moe_act needs MoE layers"),
    *((["llama-3.2-1b", "--framework", fw, "--recompute", "selective", "--recompute-modules", "core_attn"],
       "a Megatron-LM policy the chosen framework does not have") for fw in ("hf", "torchtitan", "deepspeed")),
])
def test_bad_recompute_modules_are_one_line_exit_2(args: list[str], says: str) -> None:
    result = runner.invoke(app, ["estimate", *args], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --recompute-modules") and says in lines[0], result.stderr
    assert result.stdout == ""


def test_modules_are_canonicalised_and_the_empty_list_is_megatrons_too() -> None:
    assert Recompute(mode="selective", modules=" mlp, core_attn ,mlp").modules == "mlp,core_attn"
    assert Recompute(mode="selective", modules="").module_names == ()
    assert Recompute(mode="selective").module_names == ("core_attn",)
    with pytest.raises(JobConfigError):
        Recompute(mode="none", modules="core_attn")


def test_recomputed_eager_core_repeats_the_kv_heads_too() -> None:
    # core_attn's checkpoint keeps q, k, v (the 8 KV heads' keys and values) and its recompute copies them to all
    # 32 query heads again: the KV heads' share comes back beside the extra heads' (a trace of the agreement
    # grid's llama toy holds both full copies at the recomputed softmax backward); SDPA without a mask copies none
    from memplan.estimate.context import run_context
    from memplan.estimate.recompute_modules import recomputed_only_terms
    from memplan.jobflags import build_job

    model = load_model(DENSE)
    for attention, expected in (("eager", C * TOKENS * 8 * 2 * 64), ("sdpa", 0)):
        job = build_job({"seq": S, "mbs": B, "precision": "bf16", "attention": attention, "framework": "hf",
                         "recompute": "megatron-selective", "recompute_modules": "core_attn"})
        shape = run_context(model, job, 0.0).shape
        terms = recomputed_only_terms(model.layers[0], shape, ("core_attn",))
        assert sum(t.bytes for t in terms if t.site == "core") == expected, attention


def test_recomputed_norms_make_their_residual_dtype_output_again_under_autocast() -> None:
    # layernorm's output-discarding checkpoint on an eager norm under autocast: the norm's fp32 output (its GEMMs
    # save their own 16-bit casts of it, so no term counts it) comes back with the recompute and lives until the
    # norm's backward; under mlp it is the MLP checkpoint's input. A trace of the agreement grid's llama_v256 toy
    # (seq 512 x 2, bf16-mixed, SDPA, core_attn,layernorm,mlp) holds the pre-MLP norm's through the MLP's backward
    # (its peak) and the input norm's through the attention block's; in bf16 the output is the GEMMs' input itself
    from memplan.estimate.context import run_context
    from memplan.estimate.recompute_modules import recomputed_only_terms
    from memplan.jobflags import build_job

    model = load_model(DENSE)
    for precision, expected in (("bf16-mixed", 4 * TOKENS * H), ("bf16", 0)):
        job = build_job({"seq": S, "mbs": B, "precision": precision, "attention": "sdpa", "framework": "hf",
                         "recompute": "megatron-selective", "recompute_modules": "layernorm,mlp"})
        shape = run_context(model, job, 0.0).shape
        terms = recomputed_only_terms(model.layers[0], shape, ("layernorm", "mlp"))
        sites = {t.site: t.bytes for t in terms if "output in the residual dtype" in t.name}
        assert sites == ({"input_norm": expected, "pre_mlp_norm": expected} if expected else {}), precision
