"""Every fix the doctor proposes, said in the job's framework and read back by memplan's reader of that dialect.

For a job read from each dialect (Megatron arguments, a DeepSpeed config, TrainingArguments, a torchtitan TOML),
every single change and every pair of changes to different settings the doctor tries is rendered by
:func:`memplan.frameworks.native_fix.native_change`; the base settings with the rendered ones are read back by the
same reader, and the job read back must be estimated exactly as the fix was priced, unless the rendering says
in its notes why the framework runs it otherwise. A setting the reader does not read, or reads to another job
without a note, fails the test.
"""

from __future__ import annotations

import json
import sys
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from memplan import Batch, Job, Parallelism, estimate, load_model
from memplan.doctor.job_fixes import _SETTINGS_OF_KEY, _changes, _combine
from memplan.errors import ConfigError, UnsupportedError
from memplan.frameworks.native_fix import NativeChange, native_change

MODEL = load_model("llama-3.2-1b")
GPUS = 8


def _megatron(settings: dict[str, Any], _: Path) -> Job:
    from memplan.frameworks.megatron_args import megatron_job

    return megatron_job(settings, MODEL, gpus=GPUS)


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.removeprefix("--").split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _deepspeed(settings: dict[str, Any], _: Path) -> Job:
    from memplan.frameworks.deepspeed_config import job_with_deepspeed

    return job_with_deepspeed(_nested(settings), Job(parallel=Parallelism(world_size=GPUS),
                                                     batch=Batch(seq_length=2048)))


def _hf(settings: dict[str, Any], _: Path) -> Job:
    from memplan.frameworks.hf_args import hf_args_job

    args = {key.removeprefix("--"): value for key, value in settings.items()}
    return hf_args_job(args, Job(framework="hf", parallel=Parallelism(world_size=GPUS),
                                 batch=Batch(seq_length=2048)))[0]


def _toml_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def _torchtitan(settings: dict[str, Any], folder: Path) -> Job:
    from memplan.frameworks.torchtitan_config import apply_torchtitan_config

    lines = []
    for section, table in _nested(settings).items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    path = folder / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    base = Job(framework="torchtitan", parallel=Parallelism(world_size=GPUS), batch=Batch(seq_length=2048))
    return apply_torchtitan_config(path, base, model=MODEL, model_given=True, typed={"gpus": GPUS})[0]


#: Per dialect: the reader, and the base job's settings (bf16 mixed, micro-batch 4, global batch 64).
DIALECTS = {
    "megatron": (_megatron, {"--micro-batch-size": 4, "--global-batch-size": 64, "--bf16": True, "--seq-length": 2048}),
    "deepspeed": (_deepspeed, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                               "bf16.enabled": True, "zero_optimization.stage": 0}),
    "hf": (_hf, {"--per_device_train_batch_size": 4, "--gradient_accumulation_steps": 2, "--bf16": True}),
    "torchtitan": (_torchtitan, {"--training.local_batch_size": 4, "--training.global_batch_size": 64,
                                 "--training.seq_len": 2048, "--parallelism.data_parallel_replicate_degree": GPUS,
                                 "--parallelism.data_parallel_shard_degree": 1}),
}


def _figures(job: Job) -> tuple[int, int]:
    est = estimate(MODEL, job)
    return est.peak_allocated_bytes, est.peak_reserved_bytes


def _doctor_changes(job: Job) -> list[Any]:
    singles = []
    for change in _changes(job):
        try:
            change.apply(job)
        except (ConfigError, UnsupportedError):
            continue  # refused by the framework: the doctor drops it too
        singles.append(change)
    pairs = []
    for group in combinations(singles, 2):
        settings = [name for c in group for name in _SETTINGS_OF_KEY.get(c.key, (c.key,))]
        if len(set(settings)) == len(settings):
            pairs.append(_combine(group))
    return singles + pairs


@pytest.mark.parametrize("framework", sorted(DIALECTS))
def test_every_fix_reads_back_as_priced_or_says_why(framework: str, tmp_path: Path) -> None:
    read, base_settings = DIALECTS[framework]
    base = read(base_settings, tmp_path)
    assert base.framework == framework
    checked = silent = 0
    for change in _doctor_changes(base):
        try:
            fixed = change.apply(base)
            priced = _figures(fixed)
        except (ConfigError, UnsupportedError):
            continue
        native = native_change(base, fixed)
        assert isinstance(native, NativeChange)
        assert native.settings or native.notes, f"{framework} {change.flags}: nothing said"
        back = read({**base_settings, **{s.key: s.value for s in native.settings}}, tmp_path)
        if _figures(back) != priced:
            assert native.notes, (f"{framework} {change.flags} -> {native.text()}: read back as another job "
                                  f"({_figures(back)} != {priced}) and no note says why")
        else:
            silent += not native.notes
        checked += 1
    assert checked >= 6
    assert silent >= 3, "most fixes are plain settings that read back exactly"


def test_megatron_sharding_and_recompute_flags() -> None:
    base = _megatron(DIALECTS["megatron"][1], Path("."))
    from dataclasses import replace

    from memplan.job import Recompute

    zero3 = replace(base, sharding=replace(base.sharding, zero=3), recompute=Recompute(mode="full"))
    native = native_change(base, zero3)
    assert native is not None
    assert native.text() == ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
                             "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params")
    assert native.notes == ()


def test_a_change_no_dialect_rule_renders_is_named() -> None:
    base = _hf(DIALECTS["hf"][1], Path("."))
    from dataclasses import replace

    native = native_change(base, replace(base, compile=True))
    assert native is not None and native.settings == ()
    assert any("compile" in note for note in native.notes)


def test_text_quotes_values_with_spaces_and_writes_keys() -> None:
    base = _hf(DIALECTS["hf"][1], Path("."))
    from dataclasses import replace

    native = native_change(base, replace(base, sharding=replace(base.sharding, fsdp="full")))
    assert native is not None and native.text() == "--fsdp 'full_shard auto_wrap'"
    ds = _deepspeed(DIALECTS["deepspeed"][1], Path("."))
    native = native_change(ds, replace(ds, sharding=replace(ds.sharding, zero=2)))
    assert native is not None and native.text() == "zero_optimization.stage = 2"


@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "hf"])
def test_fit_s_layouts_read_back_as_priced(framework: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """memplan fit's ten fastest layouts of llama-3.1-8b on 8 GPUs, said in the framework's settings (as fit's
    output gives them) and read back by its reader: each estimates exactly as the search priced it. Partial
    recompute is searched only as the framework runs it (torchtitan: every N-th layer; hf: none)."""
    from memplan.fit.question import candidate_native
    from memplan.fit.search import fit

    model = load_model("llama-3.1-8b")
    monkeypatch.setattr(sys.modules[__name__], "MODEL", model)
    read, base_settings = DIALECTS[framework]
    base = read(base_settings, tmp_path)
    result = fit(model, gpus=GPUS, gpu="h100-80gb", base=base, top=10)
    assert len(result.candidates) >= 3
    for candidate in result.candidates:
        native = candidate_native(model, base, candidate.job)
        assert native is not None and native["notes"] == [], (candidate.label, native)
        back = read({**base_settings, **{s["key"]: s["value"] for s in native["settings"]}}, tmp_path)
        assert _figures(back) == _figures(candidate.job), (candidate.label, native["text"])
        if framework == "hf":
            assert candidate.job.recompute.method != "block" or candidate.job.recompute.num_layers is None


def test_dora_reads_back_through_trl_s_flags(tmp_path: Path) -> None:
    """DoRA is said with the flag that selects it in TRL / peft (use_dora) and reads back as the job priced."""
    from dataclasses import replace

    from memplan.job import FineTuning

    base = _hf(DIALECTS["hf"][1], tmp_path)
    dora = replace(base, finetune=FineTuning(peft="dora", lora_rank=16))
    native = native_change(base, dora)
    assert native is not None and "--use_dora" in native.text() and native.notes == ()
    back = _hf({**DIALECTS["hf"][1], **{s.key: s.value for s in native.settings}}, tmp_path)
    assert back.finetune.peft == "dora" and _figures(back) == _figures(dora)


@pytest.mark.parametrize("quantize", ["nf4", "fp4", "int8"])
def test_a_quantized_base_reads_back_through_trl_s_flags(quantize: str, tmp_path: Path) -> None:
    """QLoRA's base in TRL's bitsandbytes flags (4-bit type and nesting, or 8-bit), read back as priced."""
    from dataclasses import replace

    from memplan.job import FineTuning

    base = _hf(DIALECTS["hf"][1], tmp_path)
    qlora = replace(base, finetune=FineTuning(peft="lora", quantize_base=quantize))
    native = native_change(base, qlora)
    assert native is not None and native.notes == ()
    back = _hf({**DIALECTS["hf"][1], **{s.key: s.value for s in native.settings}}, tmp_path)
    assert _figures(back) == _figures(qlora)


def test_deepspeed_parameter_offload_reads_back(tmp_path: Path) -> None:
    """ZeRO-3 with the parameters and optimizer states offloaded, in DeepSpeed's offload keys, read back as priced;
    Megatron-LM, which has no parameter offload, says so."""
    from dataclasses import replace

    base = _deepspeed(DIALECTS["deepspeed"][1], tmp_path)
    off = replace(base, sharding=replace(base.sharding, zero=3),
                  offload=replace(base.offload, optimizer=True, params=True))
    native = native_change(base, off)
    assert native is not None and native.notes == ()
    assert "zero_optimization.offload_param.device" in native.text()
    back = _deepspeed({**DIALECTS["deepspeed"][1], **{s.key: s.value for s in native.settings}}, tmp_path)
    assert _figures(back) == _figures(off)
    mega = _megatron(DIALECTS["megatron"][1], tmp_path)
    said = native_change(mega, replace(mega, sharding=replace(mega.sharding, zero=3),
                                       offload=replace(mega.offload, params=True)))
    assert said is not None and any("parameters in CPU memory" in n for n in said.notes)
