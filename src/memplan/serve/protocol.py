"""uvicorn's HTTP/1.1 protocol (h11) with a deadline on the request's headers.

uvicorn times out an idle keep-alive connection, but not a request whose headers arrive one byte a
second ("slow loris"): such a client holds its connection, and a few hundred of them every
connection the server has. :data:`GuardedProtocol` (uvicorn's httptools protocol, or h11 without
httptools) starts a clock at the first byte of each
request and closes the connection, with a ``408 Request Timeout``, when its headers are not complete
by :attr:`~memplan.serve.app.ServeLimits.time_limit_s`. The time of that first byte goes to the app in
the request's scope (``scope["memplan.first_byte"]``, :func:`time.monotonic`), so a request's time
limit runs from its first byte, headers and body included (docs/serve.md)::

    uvicorn.run(create_app(limits), http=guarded_protocol(limits.time_limit_s))

``memplan serve`` passes it; the module-level :data:`GuardedProtocol` reads the limit from
``$MEMPLAN_SERVE_LIMITS`` (for ``--workers N``, whose worker processes import it by name).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["FIRST_BYTE", "GuardedH11Protocol", "GuardedProtocol", "guarded_protocol"]

#: Environment variable holding the limits (JSON of ServeLimits fields) for worker processes.
LIMITS_ENV = "MEMPLAN_SERVE_LIMITS"
#: The scope key holding the monotonic time of the request's first byte.
FIRST_BYTE = "memplan.first_byte"
_RESPONSE_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                 b"content-length: %d\r\n\r\n%s")


def _limit_from_environment() -> float:
    try:
        value = json.loads(os.environ.get(LIMITS_ENV, "{}")).get("time_limit_s", 30.0)
    except (ValueError, AttributeError):
        value = 30.0
    return float(value)


class _HeaderClock:
    """The header deadline, for either of uvicorn's HTTP/1.1 protocols."""

    #: Seconds from a request's first byte to the end of its headers (None: from the environment).
    header_timeout_s: float | None = None
    _header_timer: asyncio.TimerHandle | None = None
    _first_byte = 0.0
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def _limit(self) -> float:
        return self.header_timeout_s if self.header_timeout_s is not None else _limit_from_environment()

    def _start_clock(self) -> None:
        if self._header_timer is None:
            self._first_byte = time.monotonic()
            self._header_timer = self.loop.call_later(self._limit(), self._headers_too_slow)

    def _stop_clock(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        limit = self._limit()
        body = json.dumps({"error": {"status": 408, "message": f"headers: must arrive within {limit:g} s of the "
                                     "request's first byte (this server's --time-limit)", "field": "headers",
                                     "rule": f"within {limit:g} s", "value": None}}).encode()
        self.transport.write(_RESPONSE_408 % (len(body), body))
        self.transport.close()


class GuardedH11Protocol(_HeaderClock, H11Protocol):  # type: ignore[misc]
    """h11 with the header deadline."""

    def data_received(self, data: bytes) -> None:
        if data and (self.cycle is None or self.cycle.response_complete):
            self._start_clock()
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not before:  # a request's headers are complete
            self.cycle.scope[FIRST_BYTE] = self._first_byte  # type: ignore[index]
            self._stop_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: h11 serves
    HttpToolsProtocol = None


if HttpToolsProtocol is not None:
    class GuardedHttpToolsProtocol(_HeaderClock, HttpToolsProtocol):  # type: ignore[misc, valid-type]
        """httptools (uvicorn's fast parser) with the header deadline."""

        def on_message_begin(self) -> None:  # the request's first byte
            super().on_message_begin()
            self._start_clock()
            self.scope[FIRST_BYTE] = self._first_byte  # type: ignore[literal-required]

        def on_headers_complete(self) -> None:
            self._stop_clock()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_clock()
            super().connection_lost(exc)

    #: The protocol ``memplan serve`` runs: httptools when installed (as uvicorn's "auto"), else h11.
    GuardedProtocol: type = GuardedHttpToolsProtocol
else:
    GuardedProtocol = GuardedH11Protocol


def guarded_protocol(seconds: float) -> type:
    """:data:`GuardedProtocol` with a header deadline of ``seconds``."""
    return type("GuardedProtocol", (GuardedProtocol,), {"header_timeout_s": float(seconds)})
