"""gpt-oss's experts' forward temporaries and backward op by op in the reserved schedule
(memplan.estimate.reserved_experts_backward): the order of a recorded trace, every temporary freed, the slots
given only to gpt-oss's experts."""

from __future__ import annotations

from memplan.estimate.context import run_context
from memplan.estimate.reserved_experts_backward import (
    EXPERT_TERMS,
    ExpertsPlan,
    experts_backward,
    experts_forward,
    experts_plan,
)
from memplan.estimate.reserved_mlp_backward import EXPERT_SLOT, op_slots
from memplan.estimate.reserved_replay import Replay
from memplan.estimate.terms import TermRole
from memplan.jobflags import build_job
from memplan.model import load_model, model_from_hf_config

#: The saved tensors' sizes in the unit tests (distinct, so that the log names each free).
_SAVED = (1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008)
#: The experts' backward of gpt-oss-20b (s4096 b1 bf16-mixed, no recompute), its last layer in the first step
#: of ``memplan trace`` (events of ``model.layers.23.mlp.experts`` over 1 MiB, the tensors written as the test's
#: sizes: 6 a routed-rows tensor, 12 a 2f-column one, 2 a clamp's mask, 3 a hidden-sized one, 100-103 the
#: gradients, 1001-1008 the saved tensors).
_TRACED = ("+6 +6 +6 -6 -6 +6 +6 -6 -6 -1008 +6 +100 -1007 +101 -6 +6 +6 -6 -1005 -1006 +6 +6 -6 -1003 +6 -6 -1004 "
           "+6 -6 +6 -6 -6 +2 +2 +6 -2 -2 -6 +2 +6 -2 -6 -1002 +12 -6 +12 -6 +12 -12 -12 +6 +102 -1001 +103 -12 "
           "+3 +3 -3 -6")


def _log(replay: Replay, start: int) -> str:
    return " ".join(f"{'+' if kind == 'take' else '-'}{size}" for kind, size in replay.log()[start:])


def test_the_backward_follows_the_traced_order() -> None:
    replay = Replay(repeat=False)
    slots = replay.take_all(list(_SAVED))
    plan = ExpertsPlan(rows=6, fc1=12, mask=2, hidden=3, grads=(0, 1, 2, 3))
    gathered = experts_backward(replay, plan, slots, lambda positions: [replay.take(100 + p) for p in positions])
    assert _log(replay, len(_SAVED)) == _TRACED
    assert gathered is not None and replay.ops[gathered] >> 8 == 3
    # alive after it: the four gradients and the gathered gradient, nothing else
    assert replay.requested == 100 + 101 + 102 + 103 + 3


def test_the_forward_frees_its_temporaries() -> None:
    replay = Replay(repeat=False)
    temps: dict[str, int | None] = {}
    blocks = [experts_forward(replay, index, size, temps) for index, size in enumerate(_SAVED)]
    assert [replay.ops[b] >> 8 for b in blocks if b is not None] == list(_SAVED)
    assert list(temps) == ["gathered"]
    assert replay.requested == sum(_SAVED) + _SAVED[-1]
    # the gate-up bias rows (fc1's size) before fc1; the clamped up and alpha x gate after the clamped gate
    assert _log(replay, 0).startswith("+1001 +1002 +1002 +1003 +1003 +1003 +1004 -1003")


def test_only_clamped_experts_get_the_slots() -> None:
    job = build_job({"seq": 512, "mbs": 1, "precision": "bf16", "attention": "eager", "framework": "hf"})
    small = {"model_type": "gpt_oss", "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 2048,
             "num_local_experts": 8, "num_experts_per_tok": 2}
    oss = run_context(model_from_hf_config(small, name="small-gpt-oss"), job, 0.0)
    assert op_slots(TermRole.EXPERT_FC2, 1, oss, True) == [EXPERT_SLOT + EXPERT_TERMS.index(TermRole.EXPERT_FC2)]
    assert op_slots(TermRole.EXPERT_FC2, 1, oss, False) is None
    qwen = run_context(load_model("qwen3-30b-a3b"), job, 0.0)
    assert op_slots(TermRole.EXPERT_FC2, 1, qwen, True) is None


def test_a_missing_slot_keeps_the_old_path() -> None:
    job = build_job({"seq": 512, "mbs": 1, "precision": "bf16", "attention": "eager", "framework": "hf"})
    run = run_context(load_model("qwen3-30b-a3b"), job, 0.0)
    assert experts_plan(run, [1, 2, None, 4, 5, 6, 7, 8], lambda block: 10, None) is None
    plan = experts_plan(run, list(range(8)), lambda block: 10, None)
    assert plan is not None and plan.grads is None and plan.mask == 10 // run.shape.expert_bytes
