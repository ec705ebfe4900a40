"""torchtitan's per-op selective checkpointing policy on real (small) Hugging Face models.

The policy runs under ``torch.utils.checkpoint``'s SAC on a real decoder layer; the outputs it
keeps are compared with the estimator's per-op list (:mod:`memplan.estimate.sac`), and the
checkpointed model must compute the same gradients as the plain one.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memplan.estimate.activations import ActivationShape
from memplan.estimate.sac import layer_op_outputs, sac_kept
from memplan.model.hf import model_from_hf_config
from memplan.trace.runners.sac import apply_torchtitan_sac, torchtitan_policy

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 8, 2
_BASE = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 64, "max_position_embeddings": 64}


def _model(model_type: str, attention: str = "sdpa", **extra: Any) -> Any:
    config = transformers.AutoConfig.for_model(model_type, **{**_BASE, **extra})
    config._attn_implementation = attention
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _kept_outputs(model: Any) -> list[tuple[str, int]]:
    """(op, output width; 0 for bmm) of every output the policy keeps in the first layer's forward."""
    policy = torchtitan_policy()
    kept: list[tuple[str, int]] = []

    def recording(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        decision = policy(ctx, func, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            name = func.__name__.split(".")[0]
            if name in ("mm", "addmm"):
                width = args[-1].shape[-1]
            elif name == "bmm":
                width = 0
            else:  # SDPA: heads x value head dim
                width = args[0].shape[1] * args[2].shape[-1]
            kept.append((name, int(width)))
        return decision

    layer = model.model.layers[0]
    forward = layer.forward
    layer.forward = lambda *a, **k: checkpoint(
        forward, *a, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, recording), **k)
    ids = torch.randint(0, 64, (BATCH, SEQ))
    model(ids, labels=ids, use_cache=False).loss.backward()
    return kept


def _estimated(model: Any, attention: str) -> list[str]:
    layer = model_from_hf_config(model.config.to_dict(), name="toy").layers[0]
    shape = ActivationShape(seq=SEQ, kv_seq=SEQ, micro_batch=BATCH, hidden=32, tp=1, sequence_parallel=False,
                            act_bytes=4, residual_bytes=4, attention=attention, dropout=False, kernels="eager")
    ops = layer_op_outputs(layer, shape)
    assert ops is not None
    return [o.term.name for o in sac_kept(ops)]


def test_policy_keeps_odd_mm_calls_and_every_listed_op() -> None:
    policy = torchtitan_policy()

    class Ctx:
        is_recompute = False

    mm, addmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    decisions = [policy(Ctx, op) for op in (mm, addmm, mm, torch.ops.aten.silu.default, mm, mm)]
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert decisions == [save, save, again, again, save, again]
    Ctx.is_recompute = True  # the recompute counts its own mm calls from 1
    assert policy(Ctx, mm) == save


def test_llama_layer_keeps_q_v_attention_gate_and_down_outputs() -> None:
    """7 mm calls (q, k, v, o, gate, up, down): the 1st, 3rd, 5th and 7th are kept, and the CPU
    flash kernel (stand-in of the CUDA one)."""
    model = _model("llama")
    kept = _kept_outputs(model)
    q, kv, f, h = 32, 16, 48, 32
    assert kept == [("mm", q), ("mm", kv), ("_scaled_dot_product_flash_attention_for_cpu", q), ("mm", f), ("mm", h)]
    assert _estimated(model, "sdpa") == ["q projection output", "v projection output", "attention output",
                                         "attention log-sum-exp", "gate projection output",
                                         "down projection output"]


def test_biased_projections_are_addmm_kept_and_not_counted() -> None:
    """Qwen2's q/k/v have biases (addmm: always kept, not counted): o is the 1st mm, down the 4th."""
    model = _model("qwen2")
    kept = _kept_outputs(model)
    assert [name for name, _ in kept] == ["addmm", "addmm", "addmm",
                                          "_scaled_dot_product_flash_attention_for_cpu", "mm", "mm"]
    assert [width for name, width in kept if name == "mm"] == [32, 48]  # o and up
    assert _estimated(model, "sdpa") == ["q projection output", "k projection output", "v projection output",
                                         "attention output", "attention log-sum-exp", "output projection output",
                                         "up projection output"]


def test_eager_attention_keeps_both_batched_matmuls() -> None:
    model = _model("llama", attention="eager", num_key_value_heads=4)
    kept = _kept_outputs(model)
    assert [name for name, _ in kept] == ["mm", "mm", "bmm", "bmm", "mm", "mm"]
    assert _estimated(model, "eager") == ["q projection output", "v projection output",
                                          "attention scores (q k^T)", "attention output (probabilities x v)",
                                          "gate projection output", "down projection output"]


def test_checkpointed_model_computes_the_same_gradients() -> None:
    plain, sac = _model("llama"), _model("llama")
    apply_torchtitan_sac(sac)
    ids = torch.randint(0, 64, (BATCH, SEQ))
    for model in (plain, sac):
        model(ids, labels=ids, use_cache=False).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), sac.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
