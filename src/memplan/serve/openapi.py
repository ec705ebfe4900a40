"""The OpenAPI 3.1 description of ``/v1``, generated from the job's own field declarations.

A job body's properties are the job-file fields (:func:`memplan.jobfile.job_file_fields`), each
with its flag's help text and choices (:mod:`memplan.jobflags`), so the description cannot drift
from what the server accepts.
"""

from __future__ import annotations

from typing import Any

from memplan import __version__

__all__ = ["openapi_document"]

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
_EXTRA_HELP = {
    "model": "Preset (GET /v1/models) or Hugging Face Hub id ORG/NAME[@REV]; never a server path.",
    "gpu": "GPU to check the fit against (GET /v1/gpus).",
    "fragmentation": "Assumed allocator fragmentation fraction, in [0, 1). (default: 0.10)",
}
_DIALECTS: dict[str, dict[str, Any]] = {
    "model_config": {"type": "object", "description": "A Hugging Face config.json's content (instead of model)."},
    "megatron_args": {"type": ["string", "object", "array"],
                      "description": "Megatron-LM launch command line (text), or a mapping / list of its flags."},
    "deepspeed_config": {"type": "object", "description": "A DeepSpeed JSON config."},
    "hf_args": {"type": ["object", "string"],
                "description": "Hugging Face TrainingArguments JSON, or the training script's command line."},
    "peft_config": {"type": "object", "description": "A PEFT adapter_config.json."},
    "torchtitan_config": {"type": "string", "description": "A torchtitan training TOML (its text)."},
}
_FIT_EXTRA: dict[str, dict[str, Any]] = {
    "margin": {"type": "number", "minimum": 0, "exclusiveMaximum": 1,
               "description": "Share of usable GPU memory kept free. (default: 0.05)"},
    "gpus_per_node": {"type": "integer", "minimum": 1, "description": "GPUs per node. (default: 8)"},
    "top": {"type": "integer", "minimum": 1, "description": "Candidates listed. (default: 10)"},
    "all": {"type": "boolean", "description": "List every fitting candidate and rejected family."},
    "max_mbs": {"type": "boolean", "description": "The largest micro-batch of one layout."},
    "max_seq": {"type": "boolean", "description": "The longest sequence of one layout."},
    "methods": {"type": "boolean", "description": "Compare full fine-tuning, 8-bit AdamW, LoRA and QLoRA."},
}


def _job_schema() -> dict[str, Any]:
    from memplan.jobfile import EXTRA_FIELDS
    from memplan.jobflags import job_flags

    props: dict[str, Any] = {}
    for flag in job_flags():
        prop: dict[str, Any] = {"type": _JSON_TYPES[flag.kind], "description": flag.help_text}
        if flag.choices:
            prop["enum"] = list(flag.choices)
        props[flag.name] = prop
    for name, kind in EXTRA_FIELDS.items():
        if name not in _DIALECTS and name not in props:
            props[name] = {"type": _JSON_TYPES[kind], "description": _EXTRA_HELP.get(name, "")}
    props.update(_DIALECTS)
    return {"type": "object", "additionalProperties": False, "properties": props,
            "description": "A job: the fields of a memplan job file (flag names without '--'; '-' or '_'); "
                           "dialect fields hold the file's content."}


def _error_schema() -> dict[str, Any]:
    return {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "status": {"type": "integer"}, "message": {"type": "string"}, "field": {"type": ["string", "null"]},
        "rule": {"type": ["string", "null"]}, "value": {}}}}}


def _post(summary: str, schema: dict[str, Any] | None, *, form: dict[str, Any] | None = None) -> dict[str, Any]:
    content: dict[str, Any] = {} if schema is None else {"application/json": {"schema": schema}}
    if form is not None:
        content["multipart/form-data"] = {"schema": form}
    errors = {str(code): {"description": text, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
              for code, text in ((400, "Bad input: the message names the field, the rule and the value"),
                                 (413, "Body over the server's limit"), (415, "Wrong content type"),
                                 (422, "Valid input that memplan does not model"),
                                 (503, "Past the server's time or memory limit per request"))}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": content},
                     "responses": {"200": {"description": "The command's --json document",
                                           "content": {"application/json": {"schema": {"type": "object"}}}},
                                   **errors}}}


def _dataset_form() -> dict[str, Any]:
    from memplan.dataset.rules import RULES
    from memplan.serve.dataset import DATASET_FIELDS, TOKENIZER_PARTS

    kinds = {int: "integer", bool: "boolean", str: "string"}
    binary = {"type": "string", "format": "binary"}
    return {"type": "object", "required": ["file", "job"], "properties": {
        "file": {**binary, "description": "The dataset: JSON/JSONL, Parquet, CSV or Arrow (by the file name's suffix)."},
        "job": {"type": "string", "description": "The job (the Job schema) as JSON text."},
        **{part: {**binary, "description": f"The tokenizer's {name} (default: the model's, from the server's Hub "
                  "cache)"} for part, name in TOKENIZER_PARTS.items()},
        **{name: {"type": kinds[kind]} for name, kind in DATASET_FIELDS.items()},
        "batching": {"type": "string", "enum": list(RULES), "default": "hf"}}}


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "JSON",
                                                              "content": {"application/json": {"schema": {}}}}}}}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document the server answers at ``GET /v1/openapi.json``."""
    job = {"$ref": "#/components/schemas/Job"}
    from memplan.fit.question import METHOD_FLAGS, SEARCHED_FLAGS

    fit = {"allOf": [job], "type": "object", "properties": _FIT_EXTRA,
           "description": "A job (the search chooses layout, sharding, micro-batch and recompute unless max_mbs / "
                          "max_seq fix the layout) and fit's settings. x-searched-fields: the job fields the "
                          "search chooses (refused without max_mbs / max_seq); x-method-fields: those methods "
                          "chooses (refused with methods).",
           "x-searched-fields": list(SEARCHED_FLAGS), "x-method-fields": list(METHOD_FLAGS)}
    gpu = {"type": "object", "required": ["id", "gpu"], "additionalProperties": False, "properties": {
        "id": {"type": "string"}, "gpu": {"type": "string", "description": "Catalogue name or GPU:MIG-PROFILE."},
        "total_bytes": {"type": "integer", "minimum": 1}, "free_bytes": {"type": "integer", "minimum": 0},
        "jobs": {"type": "array", "items": job, "description": "Jobs already on this GPU."}}}
    place = {"type": "object", "required": ["job", "gpus"], "additionalProperties": False, "properties": {
        "job": job, "gpus": {"type": "array", "items": gpu, "minItems": 1},
        "margin": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}}}
    doctor_props = {"message": {"type": "string", "description": "The text of a PyTorch OOM error (or a log)."},
                    "job": job, "gpu": {"type": "string"},
                    "capacity": {"type": ["string", "integer"], "description": "e.g. 78GiB or bytes."},
                    "alloc_conf": {"type": "string", "description": "The run's PYTORCH_CUDA_ALLOC_CONF."}}
    doctor = {"type": "object", "additionalProperties": False, "properties": doctor_props}
    doctor_form = {"type": "object", "properties": {
        **{k: {"type": "string"} for k in doctor_props},
        "file": {"type": "string", "format": "binary", "description": "A snapshot pickle or a memplan trace."}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "memplan", "version": __version__,
                 "description": "GPU memory of training jobs: estimate, fit, placement, doctor, datasets. Every POST answers "
                                "with the JSON document the same memplan command prints with --json."},
        "paths": {
            "/v1/estimate": _post("Per-GPU memory of a job (memplan estimate --json)", job),
            "/v1/fit": _post("Which layouts fit, the largest micro-batch / sequence, or fine-tuning methods "
                             "(memplan fit --json)", fit),
            "/v1/place": _post("Which offered GPUs can take a job, with their headroom", place),
            "/v1/doctor": _post("Why it ran out of memory and the cheapest verified fix (memplan doctor --json)",
                                doctor, form=doctor_form),
            "/v1/dataset": _post("Every step's peak on an uploaded dataset (memplan estimate --dataset --json)", None,
                                 form=_dataset_form()),
            "/v1/models": _get("The model presets (memplan models --json)"),
            "/v1/gpus": _get("The GPU catalogue (memplan gpus --json)"),
            "/v1/openapi.json": _get("This document"),
        },
        "components": {"schemas": {"Job": _job_schema(), "Error": _error_schema()}},
    }
