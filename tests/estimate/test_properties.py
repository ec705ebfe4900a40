"""Invariants of ``estimate()`` over random small models and valid jobs (hypothesis).

Models: 1-6 layers, hidden 64-256, MHA/GQA, gated or plain MLP, sometimes MoE, tied or not.
Jobs: every framework, precision, optimizer, recompute mode, ZeRO/FSDP/distributed optimizer,
tp/pp/vpp/cp/dp/ep layouts that ``validate_job_for_model`` accepts. Kept under a few seconds.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from memplan.estimate import Estimate, StageEstimate, estimate
from memplan.estimate.invariants import violations
from memplan.model import load_model
from memplan.job import Batch, Job, Optimizer, Parallelism, Precision, Recompute, Sharding
from memplan.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec

PROPERTY_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _divisors(n: int, limit: int = 64) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    hidden = draw(st.sampled_from([64, 128, 256]))
    heads = draw(st.sampled_from([2, 4, 8]))
    kv = draw(st.sampled_from(_divisors(heads)))
    attn = AttentionSpec(num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads, v_head_dim=hidden // heads)
    gated = draw(st.booleans())
    ffn = draw(st.sampled_from([2 * hidden, 4 * hidden, 3 * hidden + 64]))
    if draw(st.integers(0, 4)) == 0:
        experts = draw(st.sampled_from([2, 4, 8]))
        moe = MoESpec(num_experts=experts, top_k=draw(st.integers(1, 2)),
                      expert=MLPSpec(intermediate_size=hidden, gated=gated))
        layer = LayerSpec(attention=attn, moe=moe)
    else:
        layer = LayerSpec(attention=attn, mlp=MLPSpec(intermediate_size=ffn, gated=gated))
    return ModelSpec(
        name="random", model_type="llama", hidden_size=hidden, vocab_size=draw(st.integers(50, 700)),
        layers=(layer,) * draw(st.integers(1, 6)), tie_word_embeddings=draw(st.booleans()),
    )


@st.composite
def jobs(draw: st.DrawFn, model: ModelSpec) -> Job:
    heads, kv = model.num_heads, model.num_kv_heads
    tp = draw(st.sampled_from([t for t in _divisors(heads) if kv % t == 0 or t % kv == 0]))
    pp = draw(st.sampled_from([p for p in _divisors(model.num_layers) if p <= 4]))
    vpp_choices = [v for v in (1, 2, 3) if model.num_layers % (pp * v) == 0 and (v == 1 or pp > 1)]
    vpp = draw(st.sampled_from(vpp_choices))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 4]))
    ep = 1
    if model.is_moe:
        experts = next(layer.moe for layer in model.layers if layer.moe is not None).num_experts  # type: ignore[union-attr]
        ep = draw(st.sampled_from([e for e in _divisors(experts) if (dp * cp) % e == 0]))
    mbs = draw(st.integers(1, 3))
    microbatches = draw(st.integers(1, 4)) * (pp if vpp > 1 else 1)
    framework = draw(st.sampled_from(["megatron", "torchtitan", "deepspeed", "hf"]))
    zero = draw(st.integers(0, 3)) if framework != "torchtitan" else 0  # torchtitan shards with FSDP2 only
    # The sharding schemes that can be combined: FSDP is not DeepSpeed's (it shards with ZeRO), and
    # Megatron's distributed optimizer is its own ZeRO-1 (job validation refuses both contradictions).
    fsdp_choices = ["none"] if framework == "deepspeed" else ["none", "full", "hybrid"]
    fsdp = draw(st.sampled_from(fsdp_choices)) if zero in (0, 3) else "none"
    distributed_optimizer = draw(st.booleans()) if zero == 0 and framework == "megatron" else False
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed"]))
    opt_name = draw(st.sampled_from(["adamw", "adam", "sgd", "adafactor", "adam8bit"]))
    return Job(
        parallel=Parallelism(world_size=dp * tp * pp * cp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep,
                             sequence_parallel=draw(st.booleans())),
        sharding=Sharding(zero=zero, fsdp=fsdp, distributed_optimizer=distributed_optimizer),  # type: ignore[arg-type]
        batch=Batch(micro_batch_size=mbs, seq_length=draw(st.sampled_from([32, 64, 128])),
                    global_batch_size=mbs * dp * microbatches),
        precision=Precision(name=precision),  # type: ignore[arg-type]
        optimizer=Optimizer(name=opt_name, momentum=draw(st.sampled_from([0.0, 0.9])),  # type: ignore[arg-type]
                            implementation=draw(st.sampled_from(["auto", "foreach", "fused", "for-loop"]))),
        recompute=Recompute(mode=draw(st.sampled_from(  # type: ignore[arg-type]
            ["none", "full"] if _on_deepspeed(framework, zero, fsdp) else ["none", "selective", "full"]))),
        attention=draw(st.sampled_from(["flash", "sdpa", "eager"])),
        dropout=draw(st.sampled_from([0.0, 0.1])),
        loss=draw(st.sampled_from(["auto", "fp32-logits", "vocab-parallel", "fused", "chunked"])),
        framework=framework,  # type: ignore[arg-type]
    )


def _on_deepspeed(framework: str, zero: int, fsdp: str) -> bool:
    """``--framework hf --zero N`` without FSDP runs DeepSpeed's engine, which cannot run Hugging Face's selective
    policy (the attention module): refused by design (profiles.zero_engine), so not drawn."""
    return framework == "hf" and zero > 0 and fsdp == "none"


@st.composite
def cases(draw: st.DrawFn) -> tuple[ModelSpec, Job]:
    model = draw(models())
    return model, draw(jobs(model))


def _model_states(stage: StageEstimate) -> int:
    return stage.parameters_bytes + stage.gradients_bytes + stage.optimizer_bytes


def _with(job: Job, **changes: object) -> Job:
    return dataclasses.replace(job, **changes)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- properties


@PROPERTY_SETTINGS
@given(cases())
def test_byte_fields_are_non_negative_ints_and_parts_add_up(case: tuple[ModelSpec, Job]) -> None:
    est: Estimate = estimate(*case)
    assert isinstance(est.peak_allocated_bytes, int) and isinstance(est.peak_reserved_bytes, int)
    assert violations(est) == []


def test_the_invariants_name_what_breaks() -> None:
    """The checker itself: a stage whose parts miss its peak, a negative figure, reserved below allocated."""
    est = estimate(load_model("llama-3.2-1b"), Job())
    assert violations(est) == []
    stage = est.stages[0]
    short = dataclasses.replace(stage, other_bytes=stage.other_bytes - 1)
    negative = dataclasses.replace(stage, input_bytes=-5)
    low = dataclasses.replace(stage, peak_reserved_bytes=stage.peak_allocated_bytes - 1)
    assert violations(dataclasses.replace(est, stages=(short,))) == [
        f"stage 0: parts add up to {stage.peak_allocated_bytes - 1}, peak {stage.peak_allocated_bytes}"]
    assert violations(dataclasses.replace(est, stages=(negative,))) == ["stage 0 input_bytes = -5"]
    assert violations(dataclasses.replace(est, stages=(low,)))[0].startswith("stage 0: reserved")


@PROPERTY_SETTINGS
@given(cases())
def test_larger_micro_batch_never_decreases_activations(case: tuple[ModelSpec, Job]) -> None:
    model, job = case
    b = job.batch
    bigger = Batch(micro_batch_size=b.micro_batch_size + 1, seq_length=b.seq_length,
                   global_batch_size=(b.micro_batch_size + 1) * job.parallel.data_parallel * job.num_microbatches)
    small, large = estimate(model, job), estimate(model, _with(job, batch=bigger))
    for s, big in zip(small.stages, large.stages):
        assert big.activations_bytes >= s.activations_bytes
        assert big.transformer_layer_activations_bytes >= s.transformer_layer_activations_bytes


@PROPERTY_SETTINGS
@given(cases())
def test_recompute_full_le_selective_le_none(case: tuple[ModelSpec, Job]) -> None:
    model, job = case
    assume(not _on_deepspeed(job.framework, job.sharding.zero, job.sharding.fsdp))
    by_mode = {m: estimate(model, _with(job, recompute=Recompute(mode=m))) for m in ("none", "selective", "full")}
    for full, sel, none in zip(by_mode["full"].stages, by_mode["selective"].stages, by_mode["none"].stages):
        # A stage whose peak is the optimizer step holds no activations then: compare the others.
        if "optimizer step" in (full.peak_phase, sel.peak_phase, none.peak_phase):
            continue
        assert full.transformer_layer_activations_bytes <= sel.transformer_layer_activations_bytes
        assert sel.transformer_layer_activations_bytes <= none.transformer_layer_activations_bytes


@PROPERTY_SETTINGS
@given(cases())
def test_more_dp_with_zero3_never_increases_model_states(case: tuple[ModelSpec, Job]) -> None:
    model, job = case
    par = job.parallel
    # ZeRO-3, or FSDP2's full sharding where the framework has no ZeRO stages (torchtitan)
    sharded = _with(job, sharding=Sharding(fsdp="full") if job.framework == "torchtitan" else Sharding(zero=3))
    assume(not (_on_deepspeed(job.framework, 3, sharded.sharding.fsdp) and job.recompute.mode == "selective"))
    wider = _with(
        sharded,
        parallel=dataclasses.replace(par, world_size=par.world_size * 2, dp=par.data_parallel * 2),
        batch=dataclasses.replace(job.batch, global_batch_size=None),
    )
    narrow = _with(sharded, batch=dataclasses.replace(job.batch, global_batch_size=None))
    for s, w in zip(estimate(model, narrow).stages, estimate(model, wider).stages):
        assert _model_states(w) <= _model_states(s)
