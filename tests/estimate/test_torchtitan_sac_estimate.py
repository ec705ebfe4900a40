"""torchtitan's per-op selective checkpointing in the estimator (``--framework torchtitan --recompute selective``).

Which op outputs the policy keeps on real layers is checked against the tracer's run of the same
policy in tests/trace/test_torchtitan_sac_trace.py; here: the rule on op lists, and what the estimate makes of it.
"""

from __future__ import annotations

from dataclasses import replace

from memplan.estimate import estimate
from memplan.estimate.activations import ActivationShape, Term
from memplan.estimate.sac import OpOutput, layer_op_outputs, sac_kept
from memplan.job import Batch, Job, Recompute
from memplan.model import load_model

SHAPE = ActivationShape(seq=2048, kv_seq=2048, micro_batch=1, hidden=2048, tp=1, sequence_parallel=False,
                        act_bytes=2, residual_bytes=2, attention="flash", dropout=False, kernels="eager")


def _op(op: str, name: str) -> OpOutput:
    return OpOutput(op, Term(name, 1, "tp", "body"))  # type: ignore[arg-type]


def test_every_second_mm_is_dropped_and_other_listed_ops_are_not_counted() -> None:
    ops = [_op("mm", "1"), _op("addmm", "a"), _op("mm", "2"), _op("other", "x"), _op("bmm", "b"), _op("mm", "3"),
           _op("attention", "s"), _op("mm", "4")]
    assert [o.term.name for o in sac_kept(ops)] == ["1", "a", "b", "3", "s"]


def test_moe_and_mla_layers_are_not_listed() -> None:
    assert layer_op_outputs(load_model("qwen3-30b-a3b").layers[0], SHAPE) is None
    assert layer_op_outputs(load_model("llama-3.2-1b").layers[0], SHAPE) is not None


def _job(framework: str, mode: str) -> Job:
    return Job(framework=framework, recompute=Recompute(mode=mode),  # type: ignore[arg-type]
               batch=Batch(micro_batch_size=1, seq_length=2048), attention="flash")


def test_torchtitan_selective_keeps_a_third_and_megatron_selective_is_unchanged() -> None:
    model = load_model("llama-3.2-1b")
    acts = {(fw, mode): estimate(model, _job(fw, mode)).stages[0].forward_activations_bytes
            for fw in ("torchtitan", "megatron") for mode in ("none", "selective", "full")}
    tt_none, tt_sel, tt_full = (acts["torchtitan", m] for m in ("none", "selective", "full"))
    assert tt_full < tt_sel < 0.4 * tt_none
    # Megatron's selective recompute drops only the attention core: with flash attention (no s x s
    # scores) nearly everything stays.
    assert acts["megatron", "selective"] > 0.9 * acts["megatron", "none"]


def test_per_layer_bytes_are_the_input_and_the_kept_outputs() -> None:
    """llama-3.2-1b (h 2048, 32 heads, 8 kv heads of 64, f 8192), bf16, flash: a layer keeps its input
    (h), q (h), v (512), the attention output (h) and log-sum-exp (fp32 per head), gate (f), down (h)."""
    model = load_model("llama-3.2-1b")
    selective, full = (estimate(model, _job("torchtitan", m)).stages[0] for m in ("selective", "full"))
    tokens, layers = 2048, model.num_layers
    per_layer_outputs = tokens * (2 * (2048 + 512 + 2048 + 8192 + 2048) + 4 * 32)
    assert selective.forward_activations_bytes - full.forward_activations_bytes == \
        layers * per_layer_outputs


def test_assumptions_say_what_is_kept() -> None:
    model = load_model("llama-3.2-1b")
    text = " ".join(estimate(model, _job("torchtitan", "selective")).assumptions)
    assert "per-op selective activation checkpointing" in text and "every second mm" in text
    moe = " ".join(estimate(load_model("qwen3-30b-a3b"), replace(_job("torchtitan", "selective"))).assumptions)
    assert "MoE/MLA layers are not modelled op by op" in moe


def test_step_time_recomputes_the_dropped_matmuls_not_the_attention() -> None:
    """fit's step time: torchtitan's selective recomputes k, o and up (36% of a Llama layer's linear
    FLOPs), more than Megatron's selective (the attention core), less than full recompute."""
    from memplan.estimate.sac import recomputed_linear_fraction
    from memplan.fit import HARDWARE
    from memplan.fit.steptime import step_time

    model = load_model("llama-3.2-1b")
    h, f, kv = 2048, 8192, 512
    assert recomputed_linear_fraction(model.layers[0], h) == (h * kv + h * h + h * f) / (2 * h * h + 2 * h * kv + 3 * h * f)
    hw = next(iter(HARDWARE.values()))
    seconds = {(fw, m): step_time(model, _job(fw, m), hw).recompute_s
               for fw in ("torchtitan", "megatron") for m in ("selective", "full")}
    assert seconds["megatron", "selective"] < seconds["torchtitan", "selective"] < seconds["torchtitan", "full"]


def test_sequence_parallel_keeps_the_row_parallel_reduce_scatter_outputs() -> None:
    layer = load_model("llama-3.2-1b").layers[0]
    tp = replace(SHAPE, tp=2, sequence_parallel=True)
    names = [o.term.name for o in sac_kept(layer_op_outputs(layer, tp) or [])]
    assert "output projection reduce-scatter output" in names and "down projection reduce-scatter output" in names
    assert not any("reduce-scatter" in o.term.name for o in layer_op_outputs(layer, replace(tp, sequence_parallel=False)) or [])
