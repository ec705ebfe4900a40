"""``memplan serve``: the JSON API and the web page on one port (:mod:`memplan.serve`, uvicorn)."""

from __future__ import annotations

from typing import Annotated, Any

from memplan.commands.common import Command, app, handle_errors, option

__all__ = ["serve_command"]

_SERVER, _LIMITS = "Server", "Limits per request"
_EPILOG = """\
Examples:

  memplan serve

  memplan serve --host 0.0.0.0 --port 8080 --time-limit 20

  curl -s localhost:8000/v1/estimate -H 'content-type: application/json' \\
       -d '{"model": "llama-3.1-8b", "gpus": 8, "tp": 2, "gpu": "h100-80gb"}'

Open http://127.0.0.1:8000/ for the page; GET /v1/openapi.json describes the API. Several
workers behind a load balancer: see docs/serve.md. Needs pip install 'memplan\\[serve]'.
Exit codes: 0 stopped, 1 the server could not start, 2 invalid input.
"""


@app.command("serve", cls=Command, epilog=_EPILOG)
def serve_command(
    host: Annotated[str, option("--host", help="Address to listen on (0.0.0.0: every interface). (default: 127.0.0.1)",
                                panel=_SERVER)] = "127.0.0.1",
    port: Annotated[int, option("--port", help="TCP port. (default: 8000)", panel=_SERVER)] = 8000,
    workers: Annotated[int, option("--workers", help="Worker processes on the port (each answers any request: the "
                                   "server is stateless). (default: 1)", panel=_SERVER)] = 1,
    max_body: Annotated[str, option("--max-body", help="Largest JSON body. (default: 1MiB)", panel=_LIMITS,
                                    metavar="BYTES")] = "1MiB",
    max_upload: Annotated[str, option("--max-upload", help="Largest snapshot or trace upload to /v1/doctor. "
                                      "(default: 256MiB)", panel=_LIMITS, metavar="BYTES")] = "256MiB",
    time_limit: Annotated[float, option("--time-limit", help="Seconds one request may take, its body's arrival "
                                        "included. (default: 30)", panel=_LIMITS)] = 30.0,
    memory_limit: Annotated[str, option("--memory-limit", help="Address space of the process answering one fit, "
                                        "placement or doctor request; 0: no cap. (default: 8GiB)", panel=_LIMITS,
                                        metavar="BYTES")] = "8GiB",
    log_level: Annotated[str, option("--log-level", help="uvicorn's log level. (default: info)", panel=_SERVER)] = "info",
) -> None:
    """Serve the estimator, fit, placement and the doctor as a JSON API, and the web page at /.

    Needs the serve extra: pip install 'memplan\\[serve]'.
    """
    with handle_errors():
        from memplan.errors import ConfigError
        from memplan.serve import ServeLimits, create_app
        from memplan.units import parse_bytes

        if not 0 <= port <= 65535:
            raise ConfigError("--port", "must be in 0..65535", port)
        if workers < 1:
            raise ConfigError("--workers", "must be at least 1", workers)
        memory = parse_bytes(memory_limit, field="--memory-limit")
        limits = ServeLimits(max_body_bytes=parse_bytes(max_body, field="--max-body"),
                             max_upload_bytes=parse_bytes(max_upload, field="--max-upload"),
                             time_limit_s=time_limit, memory_limit_bytes=memory or None)
        try:
            import uvicorn
        except ImportError:
            from memplan.errors import MissingDependencyError

            raise MissingDependencyError("uvicorn", feature="memplan serve", extra="serve") from None
        import dataclasses
        import json
        import os

        from memplan.serve.app import LIMITS_ENV

        # the limits travel in the environment: uvicorn starts each of several workers from an import string,
        # and the header deadline (GuardedProtocol, imported by name) reads its time limit there
        os.environ[LIMITS_ENV] = json.dumps(dataclasses.asdict(limits))
        if workers == 1:
            application: Any = create_app(limits)
            factory = False
        else:
            application, factory = "memplan.serve.app:create_app_from_environment", True
    uvicorn.run(application, host=host, port=port, log_level=log_level, server_header=False, workers=workers,
                factory=factory, http="memplan.serve.protocol:GuardedProtocol")
