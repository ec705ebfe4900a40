"""Reading request bodies: strict JSON (no duplicate keys, no NaN), and ``POST /v1/doctor``'s two forms —
JSON (a message and/or a job), or a multipart form with a file.

The form's parts are the JSON body's fields (``message``, ``gpu``, ``capacity``, ``alloc_conf``;
``job`` as JSON text) plus one file part, ``file``: a snapshot pickle
(``torch.cuda.memory._dump_snapshot``) or a memplan trace. The file is saved into a folder of its
own for the request's lifetime; a pickle is only ever read through memplan's restricted unpickler
(:func:`memplan.alloc.snapshot.safe_loads`), which refuses any object a snapshot does not hold.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from starlette.datastructures import UploadFile
from starlette.requests import Request

from memplan.bounds import parse_json
from memplan.errors import ConfigError
from memplan.serve.bodies import take_fields
from memplan.serve.isolate import Refusal
from memplan.serve.work import DOCTOR_FIELDS

__all__ = ["doctor_fields", "json_body"]

#: Largest text part of the form (the OOM message, the job), bytes.
MAX_FIELD_BYTES = 1 << 20


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise Refusal(400, f"{key}: is given twice in the body", key, "is given twice in the body")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise Refusal(400, f"body: {name} is not a JSON number", "body", "must be standard JSON", name)


async def json_body(request: Request) -> Any:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise Refusal(415, f"body: must be sent as application/json (got {kind or 'no content type'!r})",
                      "content-type", "must be application/json", kind or None)
    raw = await request.body()
    try:
        return parse_json(raw.decode("utf-8"), field="body", object_pairs_hook=_unique, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise Refusal(400, f"body: is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", "body",
                      "must be valid JSON") from None
    except UnicodeDecodeError:
        raise Refusal(400, "body: is not UTF-8 text", "body", "must be UTF-8 JSON") from None


@asynccontextmanager
async def doctor_fields(request: Request) -> AsyncIterator[tuple[dict[str, Any], str | None]]:
    """The doctor's fields and the saved upload's path (None without a file), for the request's lifetime."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        body = await json_body(request)
        yield _checked(body), None
        return
    if kind != "multipart/form-data":
        raise Refusal(415, "body: must be application/json (a message, a job) or multipart/form-data (with a "
                      f"snapshot or trace as the part 'file'), got {kind or 'no content type'!r}", "content-type",
                      "must be application/json or multipart/form-data", kind or None)
    async with form_parts(request, len(DOCTOR_FIELDS), {"file": "upload"}, "the doctor's form (send the snapshot "
                          "or trace as 'file')") as (raw, saved):
        fields = _checked(raw)
        upload = saved.get("file")
        if upload is not None and upload.stat().st_size == 0:
            raise ConfigError("file", "is empty (expected a snapshot pickle or a memplan trace)")
        yield fields, None if upload is None else str(upload)


@asynccontextmanager
async def form_parts(request: Request, max_fields: int, files: dict[str, str] | Callable[[str, str], str],
                     what: str, *, max_files: int = 1) -> AsyncIterator[tuple[dict[str, Any], dict[str, Path]]]:
    """A multipart form's text parts (``job`` parsed as JSON) and its file parts, each saved into a folder of its
    own for the request's lifetime. ``files`` names the file parts and the name each is saved as (or a function
    of the part and the client's file name giving it); another file part is refused as not one of ``what``."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        raise Refusal(415, f"body: must be multipart/form-data ({what}), got {kind or 'no content type'!r}",
                      "content-type", "must be multipart/form-data", kind or None)
    from starlette.formparsers import MultiPartException

    try:
        form = await request.form(max_files=max_files, max_fields=max_fields + 1, max_part_size=MAX_FIELD_BYTES)
    except MultiPartException as exc:
        raise Refusal(400, f"body: is not a valid form: {exc.message}", "body", "must be a valid multipart form") \
            from None
    folder = Path(tempfile.mkdtemp(prefix="memplan-upload-"))
    try:
        raw: dict[str, Any] = {}
        saved: dict[str, Path] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                name = _file_name(files, key, value.filename or "", what)
                if key in saved:
                    raise ConfigError(key, "is given twice in the form")
                saved[key] = folder / name
                await anyio.to_thread.run_sync(_save, value, saved[key])
            elif key in raw:
                raise ConfigError(key, "is given twice in the form")
            else:
                raw[key] = _form_value(key, value)
        yield raw, saved
    finally:
        await form.close()
        shutil.rmtree(folder, ignore_errors=True)


def _file_name(files: dict[str, str] | Callable[[str, str], str], key: str, client_name: str, what: str) -> str:
    if callable(files):
        return files(key, client_name)
    if key not in files:
        raise ConfigError(key, f"is not a file part of {what}")
    return files[key]


def _save(upload: UploadFile, path: Path) -> None:
    with open(path, "wb") as out:
        shutil.copyfileobj(upload.file, out)


def _form_value(key: str, value: str) -> Any:
    if key == "job":
        try:
            return parse_json(value, field="job")
        except json.JSONDecodeError as exc:
            raise ConfigError("job", f"must be a JSON object of job-file fields: {exc.msg} at column {exc.colno}",
                              value[:80]) from None
    return value


def _checked(body: Any) -> dict[str, Any]:
    return take_fields(body, DOCTOR_FIELDS, others=f"is not a doctor field ({', '.join(DOCTOR_FIELDS)}, and the "
                       "file part 'file')")
