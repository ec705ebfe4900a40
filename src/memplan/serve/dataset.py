"""``POST /v1/dataset``: every step's peak on the user's own data, sent as an upload.

A multipart form: ``file`` (the dataset: JSON/JSONL, Parquet, CSV or Arrow, its type from the file
name's suffix), ``job`` (the job body as JSON text, as for ``/v1/estimate``), the tokenizer as uploads
— ``tokenizer`` (a ``tokenizer.json``) and optionally ``tokenizer_config`` (its
``tokenizer_config.json``: the special tokens, maybe the chat template) and ``chat_template`` (a
``chat_template.jinja``) — or none, for a model whose tokenizer
is in the server's Hub cache, and the text parts of ``memplan estimate --dataset``'s options
(``text_field``, ``messages_field``, ``batching``, ``max_length``, ``seed`` ...). The server reads no
path a request names: the dataset, the tokenizer and a ``save_to_disk`` folder are never taken by name,
and ``--images-field`` (whose images would be files of the server) is refused.

The answer is ``memplan estimate --dataset ... --json``'s document: the worst step's estimate and its
``dataset`` section. The work runs in a child process (:mod:`memplan.serve.isolate`) under the time and
memory limits; the token-length cache and ``datasets``' own cache live in the request's folder and go
with it, so one request's data never reaches another's answer.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from starlette.requests import Request

from memplan.errors import ConfigError
from memplan.serve.bodies import take_fields

__all__ = ["DATASET_FIELDS", "dataset_form", "dataset_reply"]

#: The options of ``--dataset`` a form may give (``memplan estimate``'s, less those naming files).
_NOT_SERVED = ("dataset", "tokenizer", "images_field", "vision_model", "plot")
#: The file parts and the names they are saved as (the dataset's keeps its suffix: it decides the reader).
TOKENIZER_PARTS = {"tokenizer": "tokenizer.json", "tokenizer_config": "tokenizer_config.json",
                   "chat_template": "chat_template.jinja"}


def _fields() -> dict[str, type]:
    from memplan.dataset.options import dataset_fields

    return {name: kind for name, kind in dataset_fields().items() if name not in _NOT_SERVED}


#: The form's text parts beside ``job``, with their types.
DATASET_FIELDS: dict[str, type] = _fields()


def _saved_name(part: str, client_name: str) -> str:
    from memplan.dataset.source import BUILDERS

    if part == "file":
        suffix = Path(client_name).suffix.lower()
        if suffix not in BUILDERS:
            raise ConfigError("file", f"must be a dataset file named with one of {', '.join(sorted(BUILDERS))} (a "
                              "save_to_disk folder: send its Arrow file)", client_name or None)
        return "dataset" + suffix
    if part not in TOKENIZER_PARTS:
        raise ConfigError(part, f"is not a file part of the dataset form (file, {', '.join(TOKENIZER_PARTS)})")
    return TOKENIZER_PARTS[part]


@asynccontextmanager
async def dataset_form(request: Request) -> AsyncIterator[tuple[dict[str, Any], dict[str, str]]]:
    """The form's fields (typed) and the saved uploads' paths by part, for the request's lifetime."""
    from memplan.serve.reading import form_parts

    async with form_parts(request, len(DATASET_FIELDS) + 1, _saved_name, "the dataset form",
                          max_files=1 + len(TOKENIZER_PARTS)) as (raw, saved):
        fields = {**_typed_form(raw), "job": raw.get("job")}
        if "file" not in saved:
            raise ConfigError("file", "is required: the dataset file (JSON/JSONL, Parquet, CSV or Arrow)")
        for part in TOKENIZER_PARTS:
            if part in saved and "tokenizer" not in saved:
                raise ConfigError(part, "needs the tokenizer part (its tokenizer.json)")
        for part, path in saved.items():
            if path.stat().st_size == 0:
                raise ConfigError(part, "is empty")
        yield fields, {part: str(path) for part, path in saved.items()}


def _typed_form(raw: dict[str, Any]) -> dict[str, Any]:
    """The text parts as the option types (``max_length=512`` → 512, ``drop_last=true`` → True)."""
    from memplan.dataset.options import FLAG_IMAGES

    if "images_field" in raw or "vision_model" in raw:
        raise ConfigError("images_field" if "images_field" in raw else "vision_model",
                          f"is not served: {FLAG_IMAGES} reads image files, which the server never takes by name; "
                          "price images with memplan estimate on your machine")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if key == "job":
            continue
        if name not in DATASET_FIELDS:
            raise ConfigError(key, f"is not a field of the dataset form (job, {', '.join(DATASET_FIELDS)}, and the "
                              f"file parts file, {', '.join(TOKENIZER_PARTS)})")
        out[name] = _typed(key, value, DATASET_FIELDS[name])
    return out


def _typed(key: str, value: str, kind: type) -> Any:
    if kind is bool:
        if value.strip().lower() not in ("true", "false"):
            raise ConfigError(key, "must be true or false", value)
        return value.strip().lower() == "true"
    if kind is int:
        try:
            return int(value.strip())
        except ValueError:
            raise ConfigError(key, "must be an integer", value) from None
    return value


def dataset_reply(fields: dict[str, Any], uploads: dict[str, str]) -> dict[str, Any]:
    """``POST /v1/dataset``: ``memplan estimate --dataset ... --json``'s document for the uploaded data."""
    from memplan.dataset.options import estimate_with_dataset
    from memplan.inputs import load_job
    from memplan.serve.bodies import job_body
    from memplan.serve.work import request_folder

    _import_readers()
    dataset = Path(uploads["file"])
    with request_folder(dataset) as folder:
        if fields.get("job") is None:
            raise ConfigError("job", "is required: the job body (JSON text), as for /v1/estimate")
        checked = take_fields({"job": fields["job"]}, {"job": dict})
        loaded = load_job(job_body(checked["job"], folder, where="job").request)
        flags = {k: v for k, v in fields.items() if k != "job"}
        flags["dataset"] = str(dataset)
        if "tokenizer" in uploads:
            flags["tokenizer"] = uploads["tokenizer"]
        with _caches_in(folder.path / "cache"):
            _, document, _ = estimate_with_dataset(loaded, flags)
        return document


def _import_readers() -> None:
    """Import what reads the data before the request's guard is on: their imports open files of their own
    (``dill`` opens ``/dev/null``), which the guard would refuse; the request's reads stay guarded."""
    import datasets  # noqa: F401
    import tokenizers  # noqa: F401
    from transformers.utils import chat_template_utils  # noqa: F401


@contextmanager
def _caches_in(where: Path) -> Iterator[None]:
    """Keep this request's caches (token lengths, ``datasets``' Arrow files) in its own folder, removed with it.

    It sets the process's environment, which is safe because :func:`dataset_reply` runs only in the request's
    own child process (:func:`memplan.serve.isolate.run_isolated`), never in a server thread."""
    import datasets.config

    before = {name: os.environ.get(name) for name in ("MEMPLAN_CACHE", "HF_DATASETS_CACHE")}
    previous = datasets.config.HF_DATASETS_CACHE
    os.environ["MEMPLAN_CACHE"] = str(where)
    os.environ["HF_DATASETS_CACHE"] = str(where / "datasets")
    datasets.config.HF_DATASETS_CACHE = where / "datasets"
    try:
        yield
    finally:
        datasets.config.HF_DATASETS_CACHE = previous
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
