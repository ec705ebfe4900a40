"""What each endpoint computes: plain data in, the command's JSON document out.

Each function makes the request's own folder (for the dialect contents and the upload), turns the
body into the library's request (:mod:`memplan.serve.bodies`), and answers with the same function
the command line uses for ``--json`` — :func:`memplan.documents.estimate_document`,
:func:`memplan.fit.question.answer`, :meth:`memplan.doctor.DoctorReport.to_json` — under
:func:`~memplan.serve.guard.read_guard`. They run in a child process (:mod:`memplan.serve.isolate`),
killed at the request's time limit — but an estimate of a preset (:func:`preset_only`), bounded by
construction, runs in a worker thread — and raise memplan's own errors, which
:func:`~memplan.serve.isolate.refusal_of` turns into 4xx answers.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError
from memplan.serve.bodies import FIT_FIELDS, job_body, take_fields
from memplan.serve.guard import allowed_roots, read_guard

__all__ = ["DOCTOR_FIELDS", "PLACE_LIMITS", "doctor_reply", "estimate_reply", "fit_reply", "place_reply",
           "preset_only"]

#: The doctor's fields beside the upload (``memplan doctor``'s options), with their types.
DOCTOR_FIELDS: dict[str, type | tuple[type, ...]] = {"message": str, "job": dict, "gpu": str, "capacity": (str, int),
                                                     "alloc_conf": str}
#: The most GPUs one placement request may offer, and jobs already on one GPU.
PLACE_LIMITS = {"gpus": 4096, "jobs": 64}


class Folder:
    """A request's own folder, made on first use (most requests write nothing) and removed afterwards."""

    def __init__(self, location: Path) -> None:
        #: Where the folder is (or will be).
        self.location = location

    @property
    def path(self) -> Path:
        """The folder, made now if it is not there yet."""
        self.location.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.location

    def sub(self, name: str) -> Folder:
        """A folder inside this one, also made on first use."""
        return Folder(self.location / name)

    def remove(self) -> None:
        if self.location.exists():
            shutil.rmtree(self.location, ignore_errors=True)


@contextmanager
def request_folder(upload: Path | None = None) -> Iterator[Folder]:
    """A fresh folder for one request (removed afterwards), guarded: nothing outside it and the
    allowed roots can be opened inside the block; ``upload`` (a file saved by the server) may be read.

    The folder is made when a body first writes into it (:class:`Folder`); the path is reserved now.
    """
    folder = Folder(Path(tempfile.gettempdir()) / f"memplan-serve-{uuid.uuid4().hex}")
    extra = (folder.location,) if upload is None else (folder.location, upload.parent)
    try:
        with read_guard(allowed_roots(*extra)):
            yield folder
    finally:
        folder.remove()


def preset_only(body: Any) -> bool:
    """A job body whose model is a shipped preset and which names no file content: its estimate is bounded by
    construction (the presets' at most 126 layers, flags within the job's limits) and takes milliseconds."""
    from memplan.model.presets import preset_names

    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return False
    if any(str(key).replace("-", "_") in ("model_config", *_DIALECTS) for key in body):
        return False
    return body["model"].strip().lower() in preset_names()


_DIALECTS = ("megatron_args", "deepspeed_config", "hf_args", "peft_config", "torchtitan_config")


def estimate_reply(body: Any) -> dict[str, Any]:
    """``POST /v1/estimate``: the document ``memplan estimate --json`` prints for this job."""
    from memplan.documents import estimate_document
    from memplan.inputs import load_job

    with request_folder() as folder:
        return estimate_document(load_job(job_body(body, folder).request))[1]


#: Dialect fields ``memplan fit`` has no option for.
_NOT_FIT = ("megatron_args", "deepspeed_config", "fragmentation")


def fit_reply(body: Any) -> dict[str, Any]:
    """``POST /v1/fit``: the document ``memplan fit --json`` prints (also when nothing fits)."""
    from memplan.fit.question import FitQuestion, answer

    with request_folder() as folder:
        parsed = job_body(body, folder, extra=FIT_FIELDS)
        request, extras = parsed.request, parsed.extras
        for name in _NOT_FIT:
            if getattr(request, name) is not None:
                raise ConfigError(name, "is not a memplan fit setting (the search chooses the layout, sharding and "
                                  "recompute); price it with /v1/estimate", name)
        if request.model is None:
            raise ConfigError("model", "is required (a preset, a Hub id, or model_config)")
        given = {k: v for k, v in extras.items() if k != "all"}  # the rest keep FitQuestion's defaults (the CLI's)
        if request.gpu is not None:
            given["gpu"] = request.gpu
        if extras.get("all"):
            given["top"] = None
        question = FitQuestion(model=request.model, flags=dict(request.flags), hf_args=request.hf_args,
                               peft_config=request.peft_config, torchtitan_config=request.torchtitan_config, **given)
        return answer(question).document


def place_reply(body: Any) -> dict[str, Any]:
    """``POST /v1/place``: which offered GPUs can take the job, with their headroom."""
    from memplan.fit.placement import place
    from memplan.fit.results import FIT_MARGIN

    with request_folder() as folder:
        fields = take_fields(body, {"job": dict, "gpus": list, "margin": float},
                             others="is not a placement field (job, gpus, margin)")
        for name in ("job", "gpus"):
            if name not in fields:
                raise ConfigError(name, "is required")
        if len(fields["gpus"]) > PLACE_LIMITS["gpus"]:
            raise ConfigError("gpus", f"may offer at most {PLACE_LIMITS['gpus']} GPUs per request",
                              len(fields["gpus"]))
        new = _shared("job", fields["job"], folder)
        offered = [_offered(i, gpu, folder) for i, gpu in enumerate(fields["gpus"])]
        return place(new, offered, margin=fields.get("margin", FIT_MARGIN)).to_dict()


_GPU_FIELDS: dict[str, type] = {"id": str, "gpu": str, "total_bytes": int, "free_bytes": int, "jobs": list}


def _offered(index: int, raw: Any, folder: Folder) -> Any:
    from memplan.fit.placement import OfferedGPU

    where = f"gpus[{index}]"
    fields = take_fields(raw, _GPU_FIELDS, where=where,
                         others="is not a GPU field (id, gpu, total_bytes, free_bytes, jobs)")
    for name in ("id", "gpu"):
        if name not in fields:
            raise ConfigError(f"{where}.{name}", "is required")
    jobs = fields.get("jobs", [])
    if len(jobs) > PLACE_LIMITS["jobs"]:
        raise ConfigError(f"{where}.jobs", f"may list at most {PLACE_LIMITS['jobs']} jobs", len(jobs))
    shared = tuple(_shared(f"{where}.jobs[{j}]", job, folder) for j, job in enumerate(jobs))
    return OfferedGPU(id=fields["id"], gpu=fields["gpu"], total_bytes=fields.get("total_bytes"),
                      free_bytes=fields.get("free_bytes"), jobs=shared)


def _shared(name: str, raw: Any, folder: Folder) -> Any:
    """One job of a placement body, with errors naming where it is (``gpus[0].jobs[1]: tp``); its
    dialect files go in a sub-folder of that name (unique within the body)."""
    from memplan.fit.colocate import SharedJob
    from memplan.inputs import load_job

    try:
        loaded = load_job(job_body(raw, folder.sub(name), where=name).request)
    except ConfigError as exc:
        if exc.field.startswith(name):
            raise
        raise ConfigError(f"{name}: {exc.field.removeprefix('--')}", exc.rule, exc.value) from None
    return SharedJob.from_loaded(name, loaded)


def _upload_kind(saved: Path) -> str:
    """``pickle`` (protocol 2+, a snapshot) or ``trace``; an older pickle (protocol 0 or 1, which
    ``torch.cuda.memory._dump_snapshot`` never writes) is refused as one, not read as a trace."""
    import pickletools

    with open(saved, "rb") as handle:
        if handle.read(1) == b"\x80":
            return "pickle"
        handle.seek(0)
        if handle.read(1) in (b"{", b"\x89", b"\x1f"):  # a JSON-lines trace, a binary trace, gzip
            return "trace"
        handle.seek(0)
        try:  # opcodes are only decoded here, never run; a pickle ends with STOP
            last = None
            for last, _arg, _pos in pickletools.genops(handle):
                pass
        except Exception:  # noqa: BLE001 - not a pickle: the trace reader names what it is
            return "trace"
    if last is not None and last.name == "STOP":
        raise ConfigError("file", "is a pickle of protocol 0 or 1; a snapshot is the pickle "
                          "torch.cuda.memory._dump_snapshot writes (protocol 2 or later, starting with byte 0x80)")
    return "trace"


def doctor_reply(fields: dict[str, Any], upload: str | None) -> dict[str, Any]:
    """``POST /v1/doctor``: the document ``memplan doctor --json`` prints. ``fields`` are the form's or
    the JSON body's (:data:`DOCTOR_FIELDS`); ``upload`` the saved snapshot or trace, if any."""
    from memplan.doctor import diagnose
    from memplan.doctor.inputs import alloc_conf_settings, capacity_bytes

    saved = None if upload is None else Path(upload)
    with request_folder(saved) as folder:
        message = fields.get("message")
        if message is not None and not message.strip():
            message = None
        loaded = None
        if fields.get("job") is not None:
            from memplan.inputs import load_job

            loaded = load_job(job_body(fields["job"], folder, where="job").request)
        snapshot = trace = None
        if saved is not None:
            pickled = _upload_kind(saved) == "pickle"
            snapshot, trace = (str(saved), None) if pickled else (None, str(saved))
        if message is None and saved is None and loaded is None:
            raise ConfigError("body", "give an OOM message, a snapshot or trace upload, or a job", None)
        report = diagnose(message, snapshot=snapshot, trace=trace, job=loaded, gpu=fields.get("gpu"),
                          capacity_bytes=capacity_bytes(fields.get("capacity"), field="capacity"),
                          settings=alloc_conf_settings(fields.get("alloc_conf")))
        return report.to_json()
