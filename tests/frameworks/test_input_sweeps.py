"""Input settings do what memplan says they do (benchmarks/sweep_modelled.py, benchmarks/sweep_settings.py): a
Megatron flag it models changes the answer or is refused; each torchtitan TOML field, Hugging Face
TrainingArguments field and modelled DeepSpeed key acts as its reported effect says (modelled changes the answer,
no-memory-effect leaves every figure, not-modelled is listed; none is left unreported). And what the sweeps found:
Megatron's own refusals of launches memplan accepted in silence, Megatron's two dropouts, ``bf16: false`` in
TrainingArguments (Trainer's fp32) priced as bf16-mixed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from memplan import estimate
from memplan.errors import MemplanError
from memplan.inputs import JobRequest, load_job

REPO = Path(__file__).resolve().parents[2]


def _benchmark(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sweep_modelled = _benchmark("sweep_modelled")
sweep_settings = _benchmark("sweep_settings")


def test_every_modelled_flag_changes_the_answer_or_is_refused() -> None:
    rows = sweep_modelled.sweep()
    bad = [row for row in rows if row["verdict"] not in sweep_modelled.GOOD]
    assert bad == []
    assert len(rows) >= 116  # one row per MODELLED flag at least


def test_every_setting_does_what_its_effect_says() -> None:
    rows = sweep_settings.sweep()
    assert [row for row in rows if row["verdict"] not in sweep_settings.GOOD] == []
    tried = [row for row in rows if row["verdict"] != "skipped"]
    assert len(tried) >= 280  # the libraries' own field lists, not a sample
    assert {row["dialect"] for row in tried} == {"torchtitan", "torchtitan pp2", "hf", "deepspeed"}


def _load(tmp_path: Path, base: str = "dense", **changes: Any) -> Any:
    args = {**sweep_modelled.BASES[base], **{f"--{k.replace('_', '-')}": v for k, v in changes.items()}}
    path = tmp_path / "launch.sh"
    path.write_text(sweep_modelled._command(args))
    return load_job(JobRequest(megatron_args=str(path), flags={"gpus": 8}))


def test_hidden_and_attention_dropout_are_read_apart(tmp_path: Path) -> None:
    """Megatron's two dropouts were one (the larger): --attention-dropout 0 with unfused attention kept the s x s
    mask and output of every layer."""
    both = _load(tmp_path, hidden_dropout=0.1, attention_dropout=0.1, attention_backend="unfused", use_flash_attn=None)
    no_attention = _load(tmp_path, hidden_dropout=0.1, attention_dropout=0.0, attention_backend="unfused",
                         use_flash_attn=None)
    no_hidden = _load(tmp_path, hidden_dropout=0.0, attention_dropout=0.1, attention_backend="unfused",
                      use_flash_attn=None)
    assert (both.job.dropout, both.job.attention_dropout) == (0.1, None)
    assert (no_attention.job.dropout, no_attention.job.attention_dropout) == (0.1, 0.0)
    assert (no_hidden.job.dropout, no_hidden.job.attention_dropout) == (0.0, 0.1)
    peaks = [estimate(j.model, j.job).stages[0].transformer_layer_activations_bytes
             for j in (both, no_attention, no_hidden)]
    b, s, heads, h = 1, 4096, 16, 2048
    # per layer: the 1-byte mask and the 2-byte output of the s x s probabilities; the two 1-byte residual masks
    assert peaks[0] - peaks[1] == 8 * (1 + 2) * b * heads * s * s
    assert peaks[0] - peaks[2] == 8 * 2 * b * s * h


def test_attention_dropout_is_refused_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(MemplanError, match="--attention-dropout: must be in"):
        _load(tmp_path, attention_dropout=1.5)


@pytest.mark.parametrize("changes, flag", [
    ({"moe_enable_deepep": True}, "--moe-enable-deepep: needs --moe-token-dispatcher-type flex"),
    ({"moe_enable_deepep": True, "moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep"},
     "--moe-enable-deepep: cannot be combined with --moe-flex-dispatcher-backend hybridep"),
    ({"moe_router_enable_expert_bias": True}, "--moe-router-enable-expert-bias: needs --moe-router-score-function"),
])
def test_megatron_raises_so_memplan_refuses(tmp_path: Path, changes: dict[str, Any], flag: str) -> None:
    with pytest.raises(MemplanError, match=flag):
        _load(tmp_path, "moe", **changes)


def test_expert_bias_with_sigmoid_routing_is_read(tmp_path: Path) -> None:
    loaded = _load(tmp_path, "moe", moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    assert all(layer.moe.router_bias and layer.moe.router_bias_is_buffer for layer in loaded.model.layers)


@pytest.mark.parametrize("changes, message", [
    ({"num_layers": 7}, "--pipeline-model-parallel-size: must divide the 7 layers"),
    ({"num_layers": 8, "account_for_loss_in_pipeline_split": True},
     r"must divide the 8 layers \+ 1 \(--account-for-loss-in-pipeline-split\)"),
    ({"decoder_first_pipeline_num_layers": 3, "account_for_loss_in_pipeline_split": True},
     "--decoder-first-pipeline-num-layers: cannot be combined with --account-for-loss-in-pipeline-split"),
    ({"pipeline_model_parallel_layout": "Et*4|t*4L", "decoder_last_pipeline_num_layers": 4},
     "--pipeline-model-parallel-layout: cannot be combined with --decoder-last-pipeline-num-layers"),
])
def test_megatron_pipeline_split_rules(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    """Megatron asserts these; memplan split 7 layers 4 + 3 (and 8 + loss as 5 + 3) without a word."""
    with pytest.raises(MemplanError, match=message):
        _load(tmp_path, "pp", **changes)


def test_megatron_uneven_splits_it_accepts(tmp_path: Path) -> None:
    loaded = _load(tmp_path, "pp", num_layers=7, account_for_loss_in_pipeline_split=True)
    assert [stage.layers for stage in estimate(loaded.model, loaded.job).stages] == [4, 3]
    loaded = _load(tmp_path, "pp", num_layers=7, decoder_first_pipeline_num_layers=3)
    assert [stage.layers for stage in estimate(loaded.model, loaded.job).stages] == [3, 4]
