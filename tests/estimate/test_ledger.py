"""The estimator's ledger (issue 24): contributions, the peak moment, explanations from the same
branch as the numbers, the attention-kind registry, and the provenance an Estimate carries."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from memplan import Job, Parallelism, estimate, load_model
from memplan.estimate.context import run_context, stage_context
from memplan.estimate.layout import pipeline_layout
from memplan.estimate.ledger import ACTIVATIONS, INPUT, PARAMETERS, TEMPORARY, Contribution, Ledger
from memplan.estimate.stage import stage_estimate
from memplan.jobflags import build_job
from memplan.model.attention_kinds import ATTENTION_KINDS, attention_kind
from memplan.settings import InputSetting

ESTIMATE_DIR = Path(__file__).resolve().parents[2] / "src" / "memplan" / "estimate"


def test_the_peak_is_the_moment_with_the_most_weighed_bytes() -> None:
    ledger = Ledger(("backward", "optimizer step", "loss"))
    ledger.add(Contribution(PARAMETERS, 1000),
               Contribution(ACTIVATIONS, 300, ("backward", "loss")),
               Contribution(TEMPORARY, 50, ("backward",)),
               Contribution(TEMPORARY, 340, ("optimizer step",)))
    peak = ledger.peak()
    assert peak.phase == "backward"
    assert peak.allocated == 1000 + 300 + 50
    assert peak[ACTIVATIONS] == 300 and peak[TEMPORARY] == 50


def test_a_tie_goes_to_the_first_moment_and_the_batch_does_not_choose() -> None:
    ledger = Ledger(("loss", "backward", "optimizer step"))  # order given does not matter: PHASES' does
    ledger.add(Contribution(TEMPORARY, 100, ("backward",)),
               Contribution(TEMPORARY, 100, ("optimizer step",)),
               # counted at the peak, not in choosing it: the backward still wins the tie
               Contribution(INPUT, 70, ("loss",), weighs=False),
               Contribution(ACTIVATIONS, 100, ("loss",)))
    peak = ledger.peak()
    assert peak.phase == "backward" and peak.allocated == 100


def test_a_moment_the_stage_does_not_have_is_never_the_peak() -> None:
    ledger = Ledger(("backward",))
    ledger.add(Contribution(ACTIVATIONS, 10, ("backward",)), Contribution(ACTIVATIONS, 99, ("forward",)))
    assert ledger.peak().phase == "backward"
    assert ledger.peak().allocated == 10


def test_notes_are_the_contributions_sentences_once_each() -> None:
    ledger = Ledger(("backward",))
    ledger.add(Contribution(PARAMETERS, 1, note="a"), Contribution(TEMPORARY, 2, ("backward",), note="b"),
               Contribution(ACTIVATIONS, 0, ("backward",), note="a"))
    assert ledger.notes() == ["a", "b"]


def _stage_notes(model: str, flags: dict) -> tuple[list, list[str]]:
    spec = load_model(model)
    job = build_job(flags)
    run = run_context(spec, job, 0.1)
    out = [stage_estimate(stage_context(run, layout))
           for layout in pipeline_layout(spec.num_layers, job.parallel, job.num_microbatches)]
    return [s for s, _ in out], [n for _, notes in out for n in notes]


def test_the_flex_buffer_and_its_sentence_come_from_one_branch() -> None:
    flags = {"gpus": 16, "ep": 8, "moe_dispatcher": "flex", "framework": "megatron"}
    stages, notes = _stage_notes("deepseek-v2-lite", flags)
    assert any(n.startswith("flex dispatcher: DeepEP's buffer") for n in notes)
    assert all(s.outside_allocator_bytes > 0 for s in stages if s.layers)
    # another framework has no flex buffers: neither the bytes nor the sentence
    stages, notes = _stage_notes("deepseek-v2-lite", {**flags, "framework": "torchtitan", "moe_dispatcher": "alltoall"})
    assert not any(n.startswith("flex dispatcher") for n in notes)
    assert all(s.outside_allocator_bytes == 0 for s in stages)


def test_every_assumption_is_listed_once_and_fragmentation_last() -> None:
    est = estimate(load_model("llama-3.1-8b"), Job(parallel=Parallelism(world_size=8, pp=2)))
    assert len(est.assumptions) == len(set(est.assumptions))
    assert est.assumptions[0].startswith("framework profile 'megatron'")
    assert est.assumptions[-1].startswith("reserved = allocated / (1 - 0.10)")


def test_fsdp_param_offload_says_it_offloads_the_optimizer_state() -> None:
    job = build_job({"gpus": 8, "fsdp": "full", "framework": "torchtitan", "offload_params": True})
    est = estimate(load_model("llama-3.1-8b"), job)
    assert job.offload.optimizer
    assert any("under FSDP --offload-params offloads the optimizer state too" in a for a in est.assumptions)


def test_attention_kinds_are_registry_entries() -> None:
    assert set(ATTENTION_KINDS) == {"mha", "gqa", "mla"}
    llama, gpt2, deepseek = (load_model(m).layers[0].attention for m in ("llama-3.1-8b", "gpt2", "deepseek-v2-lite"))
    assert attention_kind(llama).name == "gqa" and attention_kind(llama).grouped_kv
    assert attention_kind(gpt2).name == "mha" and attention_kind(gpt2).input_projections(gpt2) == 1
    kind = attention_kind(deepseek)
    assert kind.name == "mla" and kind.latent and not kind.per_op_sac and kind.input_projections(deepseek) == 2


def test_the_estimate_carries_the_unmodelled_settings() -> None:
    read = (InputSetting(source="--hf-args", key="torch_compile", value=True, effect="not-modelled",
                         note="not modelled (eager kernels priced)"),
            InputSetting(source="--hf-args", key="learning_rate", value=1e-4, effect="no-memory-effect"))
    est = estimate(load_model("gpt2"), Job(framework="hf"), settings=read)
    assert est.settings == read
    assert est.unmodelled_settings == ("--hf-args torch_compile = true: not modelled (eager kernels priced)",)
    data = est.to_dict()
    assert data["unmodelled_settings"] == list(est.unmodelled_settings)
    assert [s["key"] for s in data["input_settings"]] == ["torch_compile", "learning_rate"]
    assert estimate(load_model("gpt2"), Job(framework="hf")).unmodelled_settings == ()


_FRAMEWORK_NAME = re.compile(
    r"""(framework|profile\.name)\s*(==|!=|in\b|not in\b)|["'](megatron|deepspeed|torchtitan|hf)["']""")


@pytest.mark.parametrize("path", sorted(ESTIMATE_DIR.glob("*.py")), ids=lambda p: p.name)
def test_estimate_compares_no_framework_name(path: Path) -> None:
    """Framework facts live in the profiles (memplan.profiles.framework): estimate/ asks their fields."""
    code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith(("#", '"', "'"))]
    assert not [line for line in code if _FRAMEWORK_NAME.search(line.split("#")[0])]


def test_every_activation_policy_is_one_entry_with_its_sentence() -> None:
    """Each policy name has one registry entry, and its sentence is the estimate's policy line."""
    from dataclasses import replace

    from memplan.estimate.run_notes import policy_note
    from memplan.policies import POLICY_KINDS, POLICY_NAMES

    assert set(POLICY_KINDS) == set(POLICY_NAMES)
    run = run_context(load_model("deepseek-v2-lite"), Job(), 0.0)
    sentences = set()
    for kind in POLICY_KINDS.values():
        policy = replace(run.policy, name=kind.name, memory_budget=0.5 if kind.budget else None,
                         modules=("core_attn",) if kind.drops_modules else ())
        assert policy.kind is kind
        sentences.add(policy_note(replace(run, policy=policy)))
    assert len(sentences) == len(POLICY_KINDS) and all(sentences)


def _long_functions(path: Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_the_estimator_stays_in_small_functions() -> None:
    """Issue 24's shape: no function in estimate/ over 60 lines (docstring included), engine.py under 250."""
    assert not [name for path in sorted(ESTIMATE_DIR.glob("*.py")) for name in _long_functions(path, 60)]
    assert len((ESTIMATE_DIR / "engine.py").read_text().splitlines()) < 250


def test_the_function_length_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    assert _long_functions(tmp_path / "long.py", 60) == ["long.py:long (62 lines)"]


def test_fine_tuning_under_pipelined_fsdp_says_it_is_priced_as_plain_fsdp() -> None:
    """Never silent: torchtitan's pipelined FSDP lifetime is modelled for full training only."""
    flags = {"gpus": 8, "pp": 2, "fsdp": "full", "framework": "torchtitan"}
    model = load_model("llama-3.1-8b")
    sentence = "fine-tuning under FSDP with pipeline parallelism is priced as plain FSDP"
    tuned = estimate(model, build_job({**flags, "peft": "lora", "lora_rank": 16}))
    full = estimate(model, build_job(flags))
    assert any(sentence in a for a in tuned.assumptions)
    assert not any(sentence in a for a in full.assumptions)
    assert tuned.to_dict()["peak_reserved_bytes"] > 0
