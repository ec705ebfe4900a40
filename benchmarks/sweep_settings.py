"""Each field of a torchtitan TOML and of Hugging Face TrainingArguments does what memplan says it does.

memplan reports every input setting with an effect: ``modelled``, ``no-memory-effect`` or ``not-modelled``. This
sweep takes the field lists from the libraries themselves (torchtitan's ``JobConfig`` as shipped in
``memplan/data/torchtitan_fields.json`` with each field's type and default; ``transformers.TrainingArguments``'
dataclass fields), changes one field at a time to a value of its type other than its default (a bool flipped, a
number doubled, a ``Literal``'s other choice), and estimates the base and the variant.

The rule, fixed before a run, for each field whose variant memplan accepts:

* the field is in the variant's ``input_settings`` (reported at all);
* ``modelled``: the answer (figures, job record, assumptions) differs from the base's, or the variant is refused
  in one sentence naming a flag or field;
* ``no-memory-effect``: every figure equals the base's;
* ``not-modelled``: the field is in ``unmodelled_settings``.

A traceback breaks the rule; a one-line refusal is allowed for any field (a value memplan or the library
refuses). Fields with no value of their type to try (free strings: paths, names) are counted as skipped.

    python benchmarks/sweep_settings.py [torchtitan|hf|deepspeed]   # all by default; exit 1 when one breaks the rule
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TORCHTITAN_BASE = REPO / "tests" / "data" / "torchtitan" / "llama3_8b.toml"
HF_BASE: dict[str, Any] = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "bf16": True,
                           "gradient_checkpointing": False, "optim": "adamw_torch", "max_steps": 10,
                           "output_dir": "out"}
HF_MODEL = "llama-3.2-1b"
GPUS = 8
#: Figures compared for ``no-memory-effect`` (the whole answer less the job record, sentences and settings).
_NOT_FIGURES = ("job", "assumptions", "input_settings", "unmodelled_settings", "model")


def changed_values(default: Any, type_text: str) -> list[Any]:
    """Values of ``type_text`` other than ``default`` (every other choice of a ``Literal``); none when there is no
    honest one to try (a free string: a path, a name)."""
    if type_text.startswith("Literal"):
        return [c for c in re.findall(r"'([^']*)'", type_text) if c != default]
    if isinstance(default, bool) or type_text.startswith("bool"):
        return [not default]
    if isinstance(default, int) and type_text.startswith(("int", "float | int")):
        return [default * 2 if default > 0 else 2]
    if isinstance(default, float):
        return [default * 2 if default > 0 else 0.5]
    if default is None and type_text.startswith("int"):
        return [2]
    if default is None and type_text.startswith("float"):
        return [0.5]
    return []


def _type_text(hint: Any) -> str:
    """``int``, ``bool | None``, or ``Literal['a', 'b']`` for an enum (transformers' ``OptimizerNames | str``)."""
    import enum
    import typing

    args = typing.get_args(hint) or (hint,)
    enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
    if enums:
        return "Literal[" + ", ".join(repr(str(m.value)) for m in enums[0]) + "]"
    return " | ".join(getattr(a, "__name__", str(a)) for a in args)


def _answer(runner: Any, app: Any, args: list[str]) -> tuple[int, Any]:
    result = runner.invoke(app, [*args, "--json"])
    if result.exit_code != 0:
        lines = result.output.strip().splitlines()
        ok = len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output
        return result.exit_code, lines[0] if ok else (repr(result.exception) + " " + result.output[-300:])
    return 0, json.loads(result.output)


def judge(name: str, base: Any, code: int, variant: Any) -> tuple[str, str]:
    if code != 0:
        return ("refused", variant[:150]) if isinstance(variant, str) and variant.startswith("error: ") else (
            "CRASHED", str(variant)[:200])
    reported = {s["key"]: s for s in variant["input_settings"]}
    setting = reported.get(name)
    if setting is None:
        return "NOT REPORTED", f"no input setting {name!r}"
    effect = setting["effect"]
    figures = {k: v for k, v in variant.items() if k not in _NOT_FIGURES}
    base_figures = {k: v for k, v in base.items() if k not in _NOT_FIGURES}
    if effect == "modelled":
        same = all(variant.get(k) == base.get(k) for k in base if k not in ("input_settings", "model"))
        return ("SILENT (modelled, same answer)", setting["note"][:120]) if same else ("modelled: changes", "")
    if effect == "no-memory-effect":
        moved = sorted(k for k in base_figures if base_figures[k] != figures.get(k))
        return ("NO-EFFECT BUT MOVED", ", ".join(moved)) if moved else ("no effect: same figures", "")
    listed = any(name in line for line in variant["unmodelled_settings"])
    return ("not modelled: listed", "") if listed else ("NOT LISTED", setting["note"][:120])


GOOD = ("modelled: changes", "no effect: same figures", "not modelled: listed", "refused", "skipped", "same run")


def _set(table: dict[str, Any], dotted: str, value: Any) -> None:
    """``table``'s dotted key set to ``value`` (sections made as needed); None removes the key."""
    *sections, key = dotted.split(".")
    for section in sections:
        table = table.setdefault(section, {})
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


def _estimate_file(runner: Any, app: Any, path: Path, text: str, args: list[str]) -> tuple[int, Any]:
    """``text`` written to ``path`` (its folder made), then ``memplan estimate`` with ``args`` naming it."""
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return _answer(runner, app, ["estimate", *args, str(path)])


def _toml(data: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")

    lines: list[str] = []

    def emit(prefix: str, table: dict[str, Any]) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        for k, v in table.items():
            if isinstance(v, dict):
                emit(f"{prefix}.{k}" if prefix else k, v)

    emit("", data)
    return "\n".join(lines) + "\n"


#: The torchtitan bases: the shipped Llama 3 8B TOML, and the same on two pipeline stages for the pipeline's
#: own fields (without stages they have no effect, and are reported so).
TORCHTITAN_BASES: dict[str, tuple[dict[str, Any], str]] = {
    "torchtitan": ({}, ""),
    "torchtitan pp2": ({"parallelism.pipeline_parallel_degree": 2, "training.local_batch_size": 4,
                        "training.global_batch_size": 16}, "parallelism.pipeline_parallel_"),
}
#: Modelled values that leave the base's answer as it is, with why.
EQUIVALENT = {
    ("parallelism.fsdp_reshard_after_forward", "'always'"): "the default reshards after forward without pipeline "
                                                           "stages: 'always' is the same run",
    ("parallelism.pipeline_parallel_first_stage_less_layers", "2"): (
        "32 layers + 2 + 1 weighted over 2 stages: 18 - 2 and 17 - 1, the default's 16 + 16 (torchtitan's "
        "generate_llm_fqn_per_model_part; memplan's weighted_split)"),
}


def torchtitan_rows(runner: Any, app: Any, folder: Path, dialect: str) -> list[dict[str, str]]:
    from memplan.frameworks.torchtitan_fields import field_defaults, field_list, field_types

    changes, prefix = TORCHTITAN_BASES[dialect]
    base_data = tomllib.loads(TORCHTITAN_BASE.read_text())
    for name, value in changes.items():
        _set(base_data, name, value)
    defaults, types = field_defaults(), field_types()

    def run(data: dict[str, Any], name: str) -> tuple[int, Any]:
        return _estimate_file(runner, app, folder / dialect.replace(" ", "_") / name / "job.toml", _toml(data),
                              ["--gpus", str(GPUS), "--torchtitan-config"])

    base_code, base = run(base_data, "base")
    assert base_code == 0, base
    rows = []
    for index, name in enumerate(sorted(field_list())):
        if not name.startswith(prefix) or name in changes:
            continue
        section, _, key = name.rpartition(".")
        current = base_data.get(section.split(".")[0], {}) if section else {}
        for part in section.split(".")[1:]:
            current = current.get(part, {}) if isinstance(current, dict) else {}
        default = current.get(key, defaults.get(name)) if isinstance(current, dict) else defaults.get(name)
        values = changed_values(default, types.get(name, ""))
        if not values:
            rows.append({"dialect": dialect, "field": name, "verdict": "skipped", "detail": "no value to try"})
        for number, new in enumerate(values):
            data = json.loads(json.dumps(base_data))
            _set(data, name, new)
            code, variant = run(data, f"v{index}_{number}")
            verdict, detail = judge(name, base, code, variant)
            if verdict.startswith("SILENT") and (name, repr(new)) in EQUIVALENT:
                verdict, detail = "same run", EQUIVALENT[(name, repr(new))]
            rows.append({"dialect": dialect, "field": name, "value": repr(new), "verdict": verdict,
                         "detail": detail})
    return rows


def hf_rows(runner: Any, app: Any, folder: Path) -> list[dict[str, str]]:
    import typing

    import transformers

    def run(data: dict[str, Any], name: str) -> tuple[int, Any]:
        return _estimate_file(runner, app, folder / name / "args.json", json.dumps(data),
                              [HF_MODEL, "--gpus", str(GPUS), "--hf-args"])

    base_code, base = run(HF_BASE, "hf_base")
    assert base_code == 0, base
    rows = []
    hints = typing.get_type_hints(transformers.TrainingArguments)
    for index, field in enumerate(dataclasses.fields(transformers.TrainingArguments)):
        if not field.init or field.name.startswith("_"):
            continue
        default = HF_BASE.get(field.name, field.default if field.default is not dataclasses.MISSING else None)
        choices = (field.metadata or {}).get("choices")
        type_text = ("Literal[" + ", ".join(repr(str(c)) for c in choices) + "]" if choices
                     else _type_text(hints[field.name]))
        values = changed_values(default, type_text)
        if not values:
            rows.append({"dialect": "hf", "field": field.name, "verdict": "skipped", "detail": "no value to try"})
        for number, new in enumerate(values):
            code, variant = run({**HF_BASE, field.name: new}, f"hf{index}_{number}")
            verdict, detail = judge(field.name, base, code, variant)
            rows.append({"dialect": "hf", "field": field.name, "value": repr(new), "verdict": verdict,
                         "detail": detail})
    return rows


#: DeepSpeed: its key list has no types, so the keys memplan models are changed by hand, each in a config where
#: it matters (the flags name the job; ``None`` removes a key).
DEEPSPEED_BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                  "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                                  "optimizer": {"type": "AdamW"}}
DEEPSPEED_FLAGS = ["llama-3.2-1b", "--framework", "deepspeed", "--gpus", str(GPUS), "--recompute", "full"]
DEEPSPEED_ROWS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("train_batch_size", {"gradient_accumulation_steps": None}, {"train_batch_size": 64}),
    ("train_micro_batch_size_per_gpu", {}, {"train_micro_batch_size_per_gpu": 4}),
    ("gradient_accumulation_steps", {}, {"gradient_accumulation_steps": 4}),
    ("zero_optimization.stage", {}, {"zero_optimization.stage": 3}),
    ("zero_optimization.offload_optimizer.device", {}, {"zero_optimization.offload_optimizer.device": "cpu"}),
    ("zero_optimization.offload_param.device", {"zero_optimization.stage": 3},
     {"zero_optimization.offload_param.device": "cpu"}),
    ("bf16.enabled", {}, {"bf16.enabled": False}),
    ("bfloat16.enabled", {"bf16": None, "bfloat16.enabled": True}, {"bfloat16.enabled": False}),
    ("fp16.enabled", {"bf16.enabled": False}, {"fp16.enabled": True}),
    ("communication_data_type", {}, {"communication_data_type": "fp32"}),
    ("optimizer.type", {}, {"optimizer.type": "SGD"}),
    ("optimizer.params.momentum", {"optimizer.type": "SGD", "optimizer.params.momentum": 0.9},
     {"optimizer.params.momentum": 0}),
    ("activation_checkpointing.partition_activations", {"activation_checkpointing.partition_activations": False},
     {"activation_checkpointing.partition_activations": True}),
    ("activation_checkpointing.cpu_checkpointing", {"activation_checkpointing.cpu_checkpointing": False},
     {"activation_checkpointing.cpu_checkpointing": True}),
    ("activation_checkpointing.contiguous_memory_optimization", {
        "activation_checkpointing.partition_activations": True, "activation_checkpointing.number_checkpoints": 16},
     {"activation_checkpointing.contiguous_memory_optimization": True}),
    ("activation_checkpointing.number_checkpoints", {
        "activation_checkpointing.partition_activations": True, "activation_checkpointing.number_checkpoints": 16,
        "activation_checkpointing.contiguous_memory_optimization": True},
     {"activation_checkpointing.number_checkpoints": 32}),
)


def _with(config: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(config))
    for dotted, value in changes.items():
        _set(out, dotted, value)
    return out


def deepspeed_rows(runner: Any, app: Any, folder: Path) -> list[dict[str, str]]:
    from memplan.frameworks.deepspeed_keys import KEYS

    def run(config: dict[str, Any], name: str) -> tuple[int, Any]:
        return _estimate_file(runner, app, folder / "deepspeed" / name / "ds.json", json.dumps(config),
                              [*DEEPSPEED_FLAGS, "--deepspeed-config"])

    rows = []
    modelled = sorted(key for key, (effect, _) in KEYS.items() if effect == "modelled")
    for index, (key, common, change) in enumerate(DEEPSPEED_ROWS):
        base_config = _with(DEEPSPEED_BASE, common)
        base_code, base = run(base_config, f"b{index}")
        if base_code != 0:
            rows.append({"dialect": "deepspeed", "field": key, "verdict": "BASE REFUSED", "detail": str(base)[:150]})
            continue
        code, variant = run(_with(base_config, change), f"v{index}")
        verdict, detail = judge(key, base, code, variant)
        rows.append({"dialect": "deepspeed", "field": key, "value": repr(change[key]) if key in change else "",
                     "verdict": verdict, "detail": detail})
    rows += [{"dialect": "deepspeed", "field": key, "verdict": "NO ROW", "detail": "a modelled key without a row"}
             for key in modelled if key not in {row[0] for row in DEEPSPEED_ROWS}]
    return rows


def sweep(which: tuple[str, ...] = ("torchtitan", "hf", "deepspeed")) -> list[dict[str, str]]:
    from typer.testing import CliRunner

    from memplan.cli import app

    runner, rows = CliRunner(), []
    with tempfile.TemporaryDirectory() as tmp:
        for dialect in TORCHTITAN_BASES:
            if "torchtitan" in which:
                rows += torchtitan_rows(runner, app, Path(tmp), dialect)
        if "hf" in which:
            rows += hf_rows(runner, app, Path(tmp))
        if "deepspeed" in which:
            rows += deepspeed_rows(runner, app, Path(tmp))
    return rows


def main() -> int:
    rows = sweep(tuple(sys.argv[1:]) or ("torchtitan", "hf", "deepspeed"))
    for row in rows:
        print(f"{row['verdict']:<32} {row['dialect']:<10} {row['field']:<52} {row.get('value', ''):<16} {row['detail']}")
    bad = [row for row in rows if row["verdict"] not in GOOD]
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    print(f"{len(rows)} fields: {counts}; {len(bad)} break the rule", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
