"""The ASGI application of ``memplan serve``: the JSON API under ``/v1`` and the web page under ``/``.

Stateless: every request carries its whole job, so any number of workers behind a load balancer
answer alike. Each request is bounded — its body (:attr:`ServeLimits.max_body_bytes`, uploads
:attr:`ServeLimits.max_upload_bytes`), its time (:attr:`ServeLimits.time_limit_s`, from the first byte
of its headers, with :mod:`memplan.serve.protocol`) and its memory: fit, placement, doctor, dataset and every
estimate whose model the body describes (``model_config``, a Hub id, a dialect file) run in a child
process that is killed at the time limit; an estimate of a shipped preset with flags only is bounded by
construction (at most 126 layers, every flag within the job's limits: milliseconds) and answered in a
thread, without a fork. Bad
input is a 4xx JSON answer ``{"error": {"status", "message", "field", "rule", "value"}}``; nothing a
request sends stops the server.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memplan.errors import ConfigError
from memplan.serve.isolate import Refusal, past_time_limit, refusal_of, run_isolated
from memplan.serve.protocol import FIRST_BYTE, LIMITS_ENV
from memplan.serve.reading import json_body

__all__ = ["LIMITS_ENV", "STATIC_DIR", "ServeLimits", "create_app", "create_app_from_environment"]

_log = logging.getLogger("memplan.serve")
#: The web page's files (no CDN: everything the page loads ships here).
STATIC_DIR = Path(__file__).parent / "static"


@dataclass(frozen=True, kw_only=True)
class ServeLimits:
    """What one request may use."""

    #: Largest JSON body, bytes.
    max_body_bytes: int = 1 << 20
    #: Largest ``/v1/doctor`` and ``/v1/dataset`` body (the snapshot, trace or dataset upload), bytes.
    max_upload_bytes: int = 256 << 20
    #: Seconds from the first byte of the request to the answer.
    time_limit_s: float = 30.0
    #: Address space of the child process that answers a request (estimate, fit, placement, doctor, dataset; None: no cap).
    memory_limit_bytes: int | None = 8 << 30
    #: Child processes one worker runs at once; later requests wait (their wait counts in their time).
    max_concurrent: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_upload_bytes", "max_concurrent"):
            if getattr(self, name) < 1:
                raise ConfigError(name.replace("_", "-"), "must be at least 1", getattr(self, name))
        if not self.time_limit_s > 0:
            raise ConfigError("time-limit", "must be a positive number of seconds", self.time_limit_s)


def create_app_from_environment() -> Starlette:
    """The app with the limits in ``$MEMPLAN_SERVE_LIMITS`` (what ``memplan serve --workers N`` sets for
    its worker processes; also usable as ``uvicorn --factory memplan.serve.app:create_app_from_environment``)."""
    raw = os.environ.get(LIMITS_ENV, "{}")
    try:
        values = json.loads(raw)
    except json.JSONDecodeError:
        raise ConfigError(LIMITS_ENV, "must be a JSON object of ServeLimits fields", raw) from None
    if not isinstance(values, dict) or not set(values) <= {f for f in ServeLimits.__dataclass_fields__}:
        raise ConfigError(LIMITS_ENV, f"must be a JSON object of ServeLimits fields "
                          f"({', '.join(ServeLimits.__dataclass_fields__)})", raw)
    return create_app(ServeLimits(**values))


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data), status_code=status, media_type="application/json")


def _refused(refusal: Refusal) -> Response:
    return _json(refusal.to_dict(), refusal.status)


#: The endpoints that take an upload (bounded by ``max_upload_bytes``, the others by ``max_body_bytes``).
_UPLOADS = ("/v1/doctor", "/v1/dataset")


class _BodyLimit:
    """ASGI middleware: a body over the limit (by its Content-Length, or as it streams in) is a 413."""

    def __init__(self, app: ASGIApp, limits: ServeLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_upload_bytes if scope["path"] in _UPLOADS else self.limits.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _refused(_too_large(limit, length.decode("latin-1")))(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _too_large(limit, f"more than {limit} bytes")
            return message

        await self.app(scope, counted, send)


def _too_large(limit: int, got: str) -> Refusal:
    return Refusal(413, f"body: must be at most {limit} bytes (got {got}); this server's limit is "
                   "--max-body / --max-upload", "body", f"at most {limit} bytes", got)


Handler = Callable[[Request], Awaitable[Any]]


def create_app(limits: ServeLimits | None = None) -> Starlette:
    """The application; ``limits`` bound each request (defaults: :class:`ServeLimits`)."""
    from memplan.documents import gpus_document, models_document
    from memplan.serve.openapi import openapi_document
    from memplan.serve.work import doctor_reply, estimate_reply, fit_reply, place_reply, preset_only

    limits = limits or ServeLimits()
    catalogue = {"models": models_document(), "gpus": gpus_document()}
    spec = openapi_document()
    slots = anyio.Semaphore(limits.max_concurrent)

    def endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            deadline = request.scope.get(FIRST_BYTE, time.monotonic()) + limits.time_limit_s
            request.state.deadline = deadline
            try:
                with anyio.fail_after(max(deadline - time.monotonic(), 0.0)):
                    return _json(await handler(request))
            except TimeoutError:
                return _refused(past_time_limit(limits.time_limit_s))
            except Exception as exc:  # noqa: BLE001 - every failure is an answer; the server keeps serving
                refusal = refusal_of(exc)
                if refusal.status >= 500 and not isinstance(exc, Refusal):
                    _log.exception("%s %s failed", request.method, request.url.path)
                return _refused(refusal)

        return answer

    async def in_thread(func: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(partial(func, *args), abandon_on_cancel=True)

    async def isolated(request: Request, func: Callable[..., Any], *args: Any) -> Any:
        async with slots:
            left = request.state.deadline - time.monotonic()
            return await in_thread(partial(run_isolated, func, args, seconds=max(left, 0.01),
                                           memory_bytes=limits.memory_limit_bytes))

    async def estimate(request: Request) -> Any:
        body = await json_body(request)
        if preset_only(body):  # bounded by construction: a few ms, in this process (no fork)
            return await in_thread(estimate_reply, body)
        return await isolated(request, estimate_reply, body)

    async def fit(request: Request) -> Any:
        return await isolated(request, fit_reply, await json_body(request))

    async def place(request: Request) -> Any:
        return await isolated(request, place_reply, await json_body(request))

    async def doctor(request: Request) -> Any:
        from memplan.serve.reading import doctor_fields

        async with doctor_fields(request) as (fields, upload):
            return await isolated(request, doctor_reply, fields, upload)

    async def dataset(request: Request) -> Any:
        from memplan.serve.dataset import dataset_form, dataset_reply

        async with dataset_form(request) as (fields, uploads):
            return await isolated(request, dataset_reply, fields, uploads)

    async def models(request: Request) -> Any:
        return catalogue["models"]

    async def gpus(request: Request) -> Any:
        return catalogue["gpus"]

    async def openapi(request: Request) -> Any:
        return spec

    async def health(request: Request) -> Any:
        return {"status": "ok"}

    async def page(request: Request) -> Response:
        index = STATIC_DIR / "index.html"
        if not index.is_file():
            raise HTTPException(404, "the web page is not installed with this package")
        return FileResponse(index, headers={"Cache-Control": "no-cache"})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        detail = getattr(exc, "detail", "")
        rule = {404: "no such endpoint (GET /v1/openapi.json lists them)",
                405: f"method {request.method} is not allowed here"}.get(status, str(detail))
        return _refused(Refusal(status, f"{request.url.path}: {rule}", request.url.path, rule))

    routes = [
        Route("/", page, methods=["GET"]),
        Route("/healthz", endpoint(health), methods=["GET"]),
        Route("/v1/openapi.json", endpoint(openapi), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/gpus", endpoint(gpus), methods=["GET"]),
        Route("/v1/estimate", endpoint(estimate), methods=["POST"]),
        Route("/v1/fit", endpoint(fit), methods=["POST"]),
        Route("/v1/place", endpoint(place), methods=["POST"]),
        Route("/v1/doctor", endpoint(doctor), methods=["POST"]),
        Route("/v1/dataset", endpoint(dataset), methods=["POST"]),
    ]
    if STATIC_DIR.is_dir():
        routes.append(Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"))
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.add_middleware(_BodyLimit, limits=limits)
    return app
