"""A fixed corpus of estimator jobs and a fingerprint of every prediction: the refactor witness.

A refactor of the estimator must leave every number of every job unchanged. This script builds a
corpus that exercises every mechanic (every preset; a seeded random walk over the job flags, valid
and refused; the shipped Megatron-LM cases; the agreement and fine-tuning grid cells; the shipped
benchmark configs and torchtitan TOML), estimates each job and records, per job, a SHA-256 of the
numbers of ``Estimate.to_dict()`` (every field but the assumption sentences), a SHA-256 of the
assumption sentences, and the peak allocated bytes. A refused job records its one-line error.

    python benchmarks/estimate_golden.py --write             # record (before a refactor)
    python benchmarks/estimate_golden.py                     # check: exit 1 on any changed number
    python benchmarks/estimate_golden.py --dump DIR          # full to_dict() per job, to diff two trees

Every estimate is also checked for what none may say (:func:`violations`: a negative figure, parts that do not
add up to the peak, reserved below allocated); any such job fails the run, with or without ``--write``.

The corpus is fixed by the seed and the files it reads; the record is
``benchmarks/results/estimate_golden.json``. Changing a prediction on purpose means writing the
record again in the same commit, and saying so in its message.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_RECORD = HERE / "results" / "estimate_golden.json"
REFERENCE = HERE.parents[1] / "shared" / "reference" / "megatron_ci_h100.json"
SEED = 20261206
RANDOM_JOBS = 3000

#: The flag values the random walk draws from (each flag left at its default half the time).
CHOICES: dict[str, tuple[Any, ...]] = {
    "gpus": (1, 2, 4, 8, 16, 64),
    "tp": (1, 2, 4, 8),
    "pp": (1, 2, 4),
    "vpp": (1, 2),
    "cp": (1, 2),
    "ep": (1, 2, 8),
    "sequence_parallel": (True,),
    "zero": (0, 1, 2, 3),
    "fsdp": ("full", "hybrid"),
    "distributed_optimizer": (True,),
    "mbs": (1, 2, 4),
    "seq": (512, 2048, 8192),
    "gbs": (64, 256),
    "packing": (True,),
    "precision": ("fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed"),
    "fp8": ("hybrid", "e4m3"),
    "fp8_params": (True,),
    "optimizer": ("adamw", "adam", "sgd", "adafactor", "adam8bit", "adamw8bit", "paged-adamw8bit",
                  "paged-adamw", "lion", "lion8bit", "paged-lion8bit", "muon"),
    "optimizer_impl": ("foreach", "fused", "for-loop"),
    "optimizer_in_backward": (True,),
    "recompute": ("selective", "full", "megatron-selective", "attention-core", "attention-module",
                  "torchtitan-sac", "memory-budget"),
    "recompute_method": ("block",),
    "recompute_layers": (1, 2, 4),
    "recompute_modules": ("core_attn", "mlp", "core_attn,mlp", "layernorm,moe_act", "moe", "mla_up_proj"),
    "memory_budget": (0.5,),
    "partition_activations": (True,),
    "cpu_checkpointing": (True,),
    "attention": ("sdpa", "eager"),
    "loss": ("fp32-logits", "vocab-parallel", "fused", "chunked", "fused-linear"),
    "framework": ("megatron", "torchtitan", "deepspeed", "hf"),
    "mtp_layers": (1,),
    "moe_imbalance": (1.5,),
    "moe_dispatcher": ("allgather", "flex"),
    "moe_grouped_gemm": (True,),
    "offload_optimizer": (True,),
    "offload_params": (True,),
    "offload_activations": (True,),
    "peft": ("lora", "dora"),
    "lora_rank": (16, 64),
    "lora_targets": ("all-linear", "q_proj,v_proj"),
    "quantize_base": ("nf4", "fp4", "int8"),
    "trainable": ("norms",),
    "cuda_graph_impl": ("local", "transformer_engine"),
}

FIXED: tuple[tuple[str, dict[str, Any]], ...] = (
    ("llama-3.1-8b", {"gpus": 8}),
    ("llama-3.1-8b", {"gpus": 8, "tp": 2, "distributed_optimizer": True}),
    ("llama-3.1-70b", {"gpus": 64, "tp": 8, "pp": 4, "sequence_parallel": True, "distributed_optimizer": True,
                       "gbs": 512, "recompute": "selective"}),
    ("deepseek-v3", {"gpus": 1024, "tp": 2, "pp": 16, "ep": 8, "sequence_parallel": True,
                     "distributed_optimizer": True, "fp8": "hybrid", "mtp_layers": 1, "gbs": 1024,
                     "recompute": "full"}),
    ("llama-3.1-70b", {"gpus": 16, "framework": "deepspeed", "zero": 3, "offload_optimizer": True,
                       "offload_params": True, "recompute": "full"}),
    ("llama-3.1-8b", {"peft": "lora", "quantize_base": "nf4", "lora_rank": 64, "lora_targets": "all-linear",
                      "seq": 4096}),
    ("llama-3.1-8b", {"framework": "torchtitan", "fsdp": "full", "gpus": 16, "seq": 8192}),
    # session 12: dropout where the model code has its sites or not (Hugging Face), the two Megatron dropouts
    # apart (--attention-dropout), and --lora-targets auto on a model type whose peft default is not q_proj,v_proj
    ("llama-3.2-1b", {"framework": "hf", "attention": "eager", "dropout": 0.1, "precision": "bf16-mixed",
                      "seq": 2048}),
    ("llama-3.2-1b", {"framework": "hf", "attention": "eager", "dropout": 0.1, "attention_dropout": 0.0,
                      "seq": 2048}),
    ("llama-3.2-1b", {"framework": "hf", "attention": "sdpa", "dropout": 0.1, "seq": 2048}),
    ("gpt2", {"framework": "hf", "attention": "eager", "dropout": 0.1}),
    ("gpt2", {"framework": "hf", "attention": "eager", "dropout": 0.0, "attention_dropout": 0.1,
              "precision": "bf16"}),
    ("gpt2-xl", {"framework": "hf", "attention": "sdpa", "dropout": 0.1, "peft": "lora"}),
    ("mistral-7b", {"framework": "hf", "attention": "eager", "attention_dropout": 0.1, "peft": "lora",
                    "seq": 1024}),
    ("mixtral-8x7b", {"framework": "torchtitan", "attention": "eager", "dropout": 0.1, "gpus": 8, "fsdp": "full",
                      "seq": 2048}),
    ("qwen3-8b", {"framework": "torchtitan", "attention": "eager", "dropout": 0.1, "gpus": 8, "fsdp": "full",
                  "recompute": "selective"}),
    ("gemma-2-9b", {"framework": "hf", "attention": "eager", "dropout": 0.1, "peft": "lora", "seq": 2048}),
    ("llama-3.1-8b", {"framework": "megatron", "attention": "eager", "dropout": 0.1, "attention_dropout": 0.0,
                      "gpus": 8, "tp": 2}),
    ("llama-3.1-8b", {"framework": "megatron", "attention": "eager", "dropout": 0.0, "attention_dropout": 0.1,
                      "gpus": 8}),
    ("deepseek-v2-lite", {"framework": "megatron", "dropout": 0.1, "attention_dropout": 0.0, "gpus": 8, "ep": 8}),
    # session 13: torchtitan's FSDP2 under a pipeline schedule (gradients accumulated unsharded to the last
    # micro-batch): no job of the corpus had it
    ("llama-3.1-8b", {"framework": "torchtitan", "fsdp": "full", "gpus": 16, "pp": 2, "seq": 8192, "gbs": 64}),
)


def _presets() -> list[str]:
    from memplan.model.presets import preset_names

    return sorted(preset_names())


def random_jobs(seed: int = SEED, count: int = RANDOM_JOBS) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``count`` (key, model, flags) drawn by a seeded walk; each flag set with probability 0.15."""
    rng = random.Random(seed)
    presets = _presets()
    for index in range(count):
        flags = {name: rng.choice(values) for name, values in CHOICES.items() if rng.random() < 0.15}
        yield f"random/{index}", presets[index % len(presets)], _repair(flags, rng)


def _repair(flags: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Set what the drawn flags need (most of the time), so that most jobs run rather than being refused."""
    if rng.random() < 0.1:
        return flags
    needs = {"recompute_method": {"recompute": "full"}, "recompute_layers": {"recompute": "full"},
             "lora_rank": {"peft": "lora"}, "lora_targets": {"peft": "lora"}, "quantize_base": {"peft": "lora"},
             "fp8_params": {"fp8": "hybrid"}, "recompute_modules": {"recompute": "megatron-selective"},
             "memory_budget": {"recompute": "memory-budget", "framework": "torchtitan"},
             "partition_activations": {"recompute": "full", "framework": "deepspeed"},
             "cpu_checkpointing": {"recompute": "full", "framework": "deepspeed"},
             "offload_optimizer": {"distributed_optimizer": True}, "offload_params": {"fsdp": "full"}}
    for name, required in needs.items():
        if name in flags:
            flags.update(required)
    if flags.get("vpp", 1) > 1:
        flags["pp"] = max(flags.get("pp", 1), 2)
    if flags.get("framework") == "deepspeed" and flags.pop("fsdp", None):
        flags["zero"] = 3
    model_parallel = flags.get("tp", 1) * flags.get("pp", 1) * flags.get("cp", 1)
    flags["gpus"] = model_parallel * rng.choice((1, 2, 4, 8))
    return flags


def flag_jobs() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for model in _presets():
        yield f"preset/{model}", model, {}
    for index, (model, flags) in enumerate(FIXED):
        yield f"fixed/{index}", model, dict(flags)
    yield from random_jobs()
    sys.path.insert(0, str(HERE))
    import agreement_grid
    import finetune_grid

    for cell in agreement_grid.GRID:
        flags = {"seq": cell.seq, "mbs": cell.mbs, "precision": cell.precision, "attention": cell.attention,
                 "recompute": cell.recompute, "framework": cell.framework, "optimizer_impl": cell.optimizer_impl,
                 "gpus": cell.fsdp * cell.tp, "tp": cell.tp, **dict(cell.flags)}
        if cell.fsdp > 1:
            flags["fsdp"] = "full"
        yield f"agreement/{cell.key}", cell.model_ref, flags
    for ft in finetune_grid.grid():
        yield f"finetune/{ft.key}", ft.model, ft.flags()


#: Job fields added after jobs were first recorded, left out of the fingerprint at their default so those jobs
#: keep their fingerprints (a job that sets one is taken whole): ``compile`` and ``compile_loss`` (issue 25,
#: --compile, --compile-loss), ``reserved`` (issue 25, item 8), ``attention_dropout`` (session 11; None: the
#: same as ``dropout``); dotted, a section's field: the DeepSpeed ZeRO-3 buffer settings a DeepSpeed config gives
#: (session 14, None: DeepSpeed's defaults; the persistence thresholds and communication_data_type: helper ds3more14;
#: overlap_comm: the ZeRO-1/2 reduce buckets, lead).
FIELDS_AT_DEFAULT_LEFT_OUT: tuple[tuple[str, object], ...] = (
    ("compile", False), ("attention_dropout", None), ("compile_loss", "auto"), ("reserved", "auto"),
    *((f"sharding.{name}", None) for name in ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters",
                                              "max_reuse_distance", "sub_group_size", "contiguous_gradients",
                                              "param_persistence_threshold", "model_persistence_threshold",
                                              "communication_data_type", "overlap_comm")))


def _fingerprint(result: Any) -> dict[str, Any]:
    data = result.to_dict()
    assumptions = data.pop("assumptions", None)
    # The input settings the Estimate carries since issue 24 (empty here: the corpus estimates Jobs);
    # not predictions, so left out of the numbers' fingerprint as the assumption sentences are.
    data.pop("input_settings", None)
    data.pop("unmodelled_settings", None)
    job = data.get("job")
    if isinstance(job, dict):
        for field, default in FIELDS_AT_DEFAULT_LEFT_OUT:
            *section, name = field.split(".")
            where = job.get(section[0]) if section else job
            if isinstance(where, dict) and name in where and type(where[name]) is type(default) and where[name] == default:
                del where[name]
    numbers = json.dumps(data, sort_keys=True, default=str)
    words = json.dumps(assumptions, sort_keys=True, default=str)
    return {"numbers": hashlib.sha256(numbers.encode()).hexdigest()[:20],
            "assumptions": hashlib.sha256(words.encode()).hexdigest()[:20],
            "peak_allocated_bytes": data["peak_allocated_bytes"], "_full": data | {"assumptions": assumptions}}


def violations(result: Any) -> list[str]:
    """What no estimate may say (:func:`memplan.estimate.invariants.violations`, the property tests' invariants)."""
    from memplan.estimate.invariants import violations as broken

    return broken(result)


def _run(load: Any) -> dict[str, Any]:
    from memplan.errors import MemplanError
    from memplan.estimate import estimate

    try:
        loaded = load()
        result = estimate(loaded.model, loaded.job, gpu=loaded.gpu)
    except MemplanError as error:
        return {"error": str(error)}
    broken = violations(result)
    return {**_fingerprint(result), **({"_violations": broken} if broken else {})}


def corpus() -> Iterator[tuple[str, dict[str, Any]]]:
    from memplan.inputs import JobRequest, load_job

    for key, model, flags in flag_jobs():
        yield key, _run(lambda: load_job(JobRequest(model=model, flags=flags)))
    if REFERENCE.is_file():
        from memplan.frameworks.megatron_args import from_megatron_args

        for case in json.loads(REFERENCE.read_text())["cases"]:
            world = (case.get("nodes") or 1) * (case.get("gpus_per_node") or 8)

            def load(case: dict = case, world: int = world) -> Any:
                from types import SimpleNamespace

                model, job = from_megatron_args(case["model_args"], gpus=world)
                return SimpleNamespace(model=model, job=job, gpu=None)

            yield f"megatron/{case['name']}", _run(load)
    for path in sorted((HERE / "configs").iterdir()):
        if path.suffix == ".toml":
            yield f"toml/{path.name}", _run(lambda p=path: load_job(JobRequest(torchtitan_config=str(p),
                                                                              flags={"gpus": 8})))
        elif path.suffix == ".json" and path.name != "published_finetune.json":
            yield f"config/{path.name}", _run(lambda p=path: load_job(JobRequest(model=str(p), flags={"gpus": 8})))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, default=DEFAULT_RECORD)
    parser.add_argument("--write", action="store_true", help="write the record instead of checking it")
    parser.add_argument("--dump", type=Path, help="also write each job's full to_dict() under this folder")
    parser.add_argument("--assumptions", action="store_true", help="also fail on changed assumption sentences")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    broken: dict[str, list[str]] = {}
    for key, row in corpus():
        full = row.pop("_full", None)
        if "_violations" in row:
            broken[key] = row.pop("_violations")
        if args.dump is not None and full is not None:
            args.dump.mkdir(parents=True, exist_ok=True)
            name = hashlib.sha256(key.encode()).hexdigest()[:16]
            (args.dump / f"{name}.json").write_text(json.dumps({"key": key, **full}, indent=1, sort_keys=True))
        results[key] = row
    ok = sum("error" not in row for row in results.values())
    for key, what in list(broken.items())[:40]:
        print(f"impossible: {key}: {'; '.join(what)}")
    if broken:
        print(f"{len(broken)} of {ok} estimates say something impossible; nothing written")
        return 1
    if args.write:
        args.record.write_text(json.dumps(results, indent=0, sort_keys=True) + "\n")
        print(f"wrote {len(results)} jobs ({ok} estimated, {len(results) - ok} refused) to {args.record}")
        return 0
    record = json.loads(args.record.read_text())
    fields = ("numbers", "error") + (("assumptions",) if args.assumptions else ())
    changed = [key for key in sorted(set(record) | set(results))
               if {f: record.get(key, {}).get(f) for f in fields} != {f: results.get(key, {}).get(f) for f in fields}]
    for key in changed[:int(os.environ.get("GOLDEN_LIST", "40"))]:
        print(f"changed: {key}\n  was {record.get(key)}\n  now {results.get(key)}")
    print(f"{len(results)} jobs ({ok} estimated), {len(changed)} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
