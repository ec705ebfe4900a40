"""What a framework cannot run is refused from its profile's data (:mod:`memplan.profiles`): its
activation policies and the framework-specific options of :data:`memplan.profiles.rules.FEATURES`.
One line naming the flag, the framework and the rule, exit 2, whichever way the job arrives: a
``Job``, flags, a job file, the Megatron and DeepSpeed dialects, the server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import JobConfigError
from memplan.job import (
    CommOverlap,
    CudaGraphs,
    FineTuning,
    Job,
    Offload,
    Parallelism,
    Recompute,
    Sharding,
)
from memplan.policies import POLICY_NAMES
from memplan.profiles import PROFILES
from memplan.profiles.rules import FEATURES

runner = CliRunner()

#: A job part that turns each framework-specific option on.
FEATURE_JOBS: dict[str, dict[str, Any]] = {
    "partition-activations": {"recompute": Recompute(mode="full", partition_activations=True)},
    "cpu-checkpointing": {"recompute": Recompute(mode="full", cpu_checkpointing=True)},
    "tp-comm-overlap": {"overlap": CommOverlap(tp=True)},
    "delay-wgrad": {"overlap": CommOverlap(delay_wgrad=True)},
    "early-attn-release": {"overlap": CommOverlap(early_attn_release=True)},
    "experts-wgrad-overlap": {"overlap": CommOverlap(experts_wgrad_overlap=True)},
    "shared-expert-overlap": {"overlap": CommOverlap(shared_expert_overlap=True)},
    "ep-a2a-overlap": {"overlap": CommOverlap(ep_a2a=True)},
    "cuda-graphs": {"cuda_graphs": CudaGraphs(impl="local")},
    "fine-offload": {"offload": Offload(modules="core_attn")},
    "local-transformer-impl": {"transformer_impl": "local"},
    "zero-stages": {"parallel": Parallelism(world_size=8), "sharding": Sharding(zero=2)},
    "distributed-optimizer": {"parallel": Parallelism(world_size=8), "sharding": Sharding(distributed_optimizer=True)},
}


def test_every_feature_is_tested_and_run_by_some_framework() -> None:
    assert set(FEATURE_JOBS) == {feature.name for feature in FEATURES}
    run = set().union(*(profile.features for profile in PROFILES.values()))
    assert run == set(FEATURE_JOBS)


@pytest.mark.parametrize("framework", sorted(PROFILES))
@pytest.mark.parametrize("feature", FEATURES, ids=lambda feature: feature.name)
def test_an_option_the_framework_does_not_run_is_refused(framework: str, feature: Any) -> None:
    profile = PROFILES[framework]
    has = [name for name, p in PROFILES.items() if feature.name in p.features]  # the profiles' order
    try:
        Job(framework=framework, **FEATURE_JOBS[feature.name])  # type: ignore[arg-type]
    except JobConfigError as exc:
        refused = str(exc)
    else:
        refused = None
    if feature.name in profile.features:
        # runs here: at most one of the framework's own rules on the rest of the job applies
        assert refused is None or "use --framework" not in refused
    else:
        assert refused is not None and refused.startswith(f"{feature.flag}: {feature.what}; use --framework ")
        assert refused.endswith(" or ".join(has)) or " or ".join(has) + " (got" in refused
        assert f"--framework {framework}" in refused


@pytest.mark.parametrize("framework", sorted(PROFILES))
def test_a_policy_the_framework_does_not_have_is_refused(framework: str) -> None:
    profile = PROFILES[framework]
    for policy in POLICY_NAMES:
        if policy in profile.activation_policies:
            assert Job(framework=framework, recompute=Recompute(mode=policy)).recompute.mode == policy
            continue
        with pytest.raises(JobConfigError) as caught:
            Job(framework=framework, recompute=Recompute(mode=policy))
        assert caught.value.field == "--recompute"
        assert str(caught.value).startswith(f"--recompute: {policy} is not an activation policy of --framework "
                                            f"{framework} (it has {', '.join(profile.activation_policies)};")


def test_a_policy_priced_for_full_training_only_is_refused_with_adapters() -> None:
    lora = FineTuning(peft="lora")
    with pytest.raises(JobConfigError, match="megatron-selective on --framework hf is priced for full training only .*"
                       "use attention-module or full with fine-tuning"):
        Job(framework="hf", recompute=Recompute(mode="megatron-selective"), finetune=lora)
    assert Job(framework="hf", recompute=Recompute(mode="attention-module"), finetune=lora)
    assert Job(framework="megatron", recompute=Recompute(mode="megatron-selective"), finetune=lora)


def _refused(args: list[str], flag: str, framework: str) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.output
    assert flag in line and f"--framework {framework}" in line, line
    assert line.count("(got ") == 1, line  # said once (a job file once repeated the rule's tail)
    return line


def test_refused_from_flags() -> None:
    _refused(["estimate", "llama-3.2-1b", "--framework", "hf", "--recompute", "torchtitan-sac"], "--recompute", "hf")
    line = _refused(["estimate", "llama-3.2-1b", "--framework", "torchtitan", "--cuda-graph-impl", "local"],
                    "--cuda-graph-impl", "torchtitan")
    assert "use --framework megatron" in line
    _refused(["estimate", "llama-3.2-1b", "--framework", "megatron", "--recompute", "full",
              "--partition-activations"], "--partition-activations", "megatron")


def test_refused_from_a_job_file(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("model: llama-3.2-1b\nframework: deepspeed\nrecompute: attention-module\n")
    line = _refused(["estimate", "--job", str(job)], "recompute", "deepspeed")
    assert line.startswith(f"error: {job}: recompute: attention-module is not an activation policy")


def test_refused_from_the_megatron_and_deepspeed_dialects(tmp_path: Path) -> None:
    launch = tmp_path / "train.sh"
    launch.write_text("torchrun pretrain_gpt.py --num-layers 2 --hidden-size 256 --num-attention-heads 4 "
                      "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 1 --bf16 "
                      "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap "
                      "--vocab-size 1024\n")
    line = _refused(["estimate", "--megatron-args", str(launch), "--gpus", "2", "--framework", "torchtitan"],
                    "--tp-comm-overlap", "torchtitan")
    assert "use --framework megatron" in line
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                              "bf16": {"enabled": True}}))
    _refused(["estimate", "llama-3.2-1b", "--gpus", "2", "--deepspeed-config", str(ds), "--recompute",
              "torchtitan-sac"], "--recompute", "deepspeed")


def test_refused_by_the_server() -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from memplan.serve import create_app

    with TestClient(create_app()) as client:
        for body, flag, framework in (
            ({"model": "llama-3.2-1b", "framework": "hf", "recompute": "torchtitan-sac"}, "--recompute", "hf"),
            ({"model": "llama-3.2-1b", "framework": "hf", "offload_modules": "core_attn"}, "--offload-modules", "hf"),
        ):
            response = client.post("/v1/estimate", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]  # the server names the body's field, not the flag
            assert error["field"] == flag.removeprefix("--"), error
            assert f"--framework {framework}" in error["message"], error
            assert "\n" not in error["message"]


# --- the other registries (issue 24): attention kinds, PEFT methods, quantized-base formats ---------------

def _one_line_exit_2(args: list[str], *words: str) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.output, result.output
    for word in words:
        assert word in line, line
    return line


@pytest.mark.parametrize("framework", sorted(PROFILES))
@pytest.mark.parametrize("model", ["llama-3.2-1b", "deepseek-v2-lite"])  # grouped-query and latent attention
def test_every_framework_runs_every_attention_kind(framework: str, model: str) -> None:
    """No profile rules an attention kind out, so none is refused for its framework (a kind's own rules,
    such as TP keeping whole kv heads, apply everywhere)."""
    from memplan import load_model
    from memplan.jobcheck import validate_job_for_model

    validate_job_for_model(Job(framework=framework), load_model(model))  # type: ignore[arg-type]


def test_an_attention_kind_rule_and_an_unknown_kind_are_one_line(tmp_path: Path) -> None:
    _one_line_exit_2(["estimate", "qwen2.5-7b", "--gpus", "14", "--tp", "14"], "--tp", "key/value heads")
    config = json.loads(Path(__file__).resolve().parents[2].joinpath(
        "src/memplan/model/presets/llama-3.2-1b.json").read_text())
    config["num_key_value_heads"] = 3
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _one_line_exit_2(["estimate", str(path)], "num_key_value_heads", "must divide")


def test_a_peft_method_or_format_that_is_not_one_is_one_line(tmp_path: Path) -> None:
    _one_line_exit_2(["estimate", "llama-3.2-1b", "--peft", "ia3"], "peft")
    _one_line_exit_2(["estimate", "llama-3.2-1b", "--peft", "lora", "--quantize-base", "int4"], "quantize-base")
    _one_line_exit_2(["estimate", "llama-3.2-1b", "--double-quant"], "double-quant", "nf4")
    job = tmp_path / "job.yaml"
    job.write_text("model: llama-3.2-1b\npeft: lora\nquantize_base: fp8\n")
    _one_line_exit_2(["estimate", "--job", str(job)], "quantize-base", "nf4, fp4, int8")
    script = tmp_path / "sft.sh"
    script.write_text("python sft.py --model_name_or_path meta-llama/Llama-3.2-1B --use_peft --load_in_4bit "
                      "--bnb_4bit_quant_type int4\n")
    _one_line_exit_2(["estimate", "llama-3.2-1b", "--hf-args", str(script)], "bnb_4bit_quant_type", "nf4 or fp4")


def test_an_optimizer_or_policy_refused_with_adapters_from_every_dialect(tmp_path: Path) -> None:
    """Entries that rule out fine-tuning (Muon's full-training rule; a policy priced for full training
    only) refuse a PEFT job from flags, a job file and the server, naming the flag and the rule."""
    _one_line_exit_2(["estimate", "llama-3.2-1b", "--framework", "megatron", "--optimizer", "muon", "--peft",
                      "lora"], "--optimizer", "full training only")
    job = tmp_path / "job.yaml"
    job.write_text("model: llama-3.2-1b\nframework: hf\nrecompute: megatron-selective\npeft: dora\n")
    _one_line_exit_2(["estimate", "--job", str(job)], "recompute", "--framework hf", "full training only")
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from memplan.serve import create_app

    with TestClient(create_app()) as client:
        for body, field in (
            ({"model": "llama-3.2-1b", "framework": "megatron", "optimizer": "muon", "peft": "lora"}, "optimizer"),
            ({"model": "llama-3.2-1b", "peft": "lora", "quantize_base": "int4"}, "quantize_base"),
            ({"model": "llama-3.2-1b", "muon_tp_mode": "distributed"}, "muon_tp_mode"),
        ):
            response = client.post("/v1/estimate", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["field"].replace("-", "_").removeprefix("__") == field, error
            assert "\n" not in error["message"]
