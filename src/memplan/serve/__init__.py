"""``memplan serve``: the estimator, fit, placement and the doctor over HTTP, and the web page.

Needs the ``serve`` extra (``pip install 'memplan[serve]'``: starlette, uvicorn, python-multipart)::

    from memplan.serve import ServeLimits, create_app

    app = create_app(ServeLimits(time_limit_s=10))   # any ASGI server runs it

Endpoints (``GET /v1/openapi.json`` describes them): ``POST /v1/estimate``, ``/v1/fit``, ``/v1/place``,
``/v1/doctor``; ``GET /v1/models``, ``/v1/gpus``; the page at ``/``. See docs/serve.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeLimits", "create_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from memplan.errors import MissingDependencyError

        try:
            from memplan.serve import app
        except ImportError as exc:
            if exc.name and exc.name.split(".")[0] in ("starlette", "uvicorn", "multipart", "python_multipart"):
                raise MissingDependencyError(exc.name.split(".")[0], feature="memplan serve", extra="serve") from None
            raise
        return getattr(app, name)
    raise AttributeError(name)
