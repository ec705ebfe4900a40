"""The CUDA stream each traced allocation would be made on: FSDP2's side streams, emulated on CPU.

The caching allocator keeps one pool per stream: a block is cut from, and returns to, the pool of
the stream that was current when it was allocated, and a block cached on one stream is never
handed to another. FSDP2 (``torch/distributed/fsdp/_fully_shard``) allocates on four streams of
its own, created by ``FSDPCommContext.lazy_init``:

* ``all_gather_copy_in_stream`` (stream 1): ``foreach_all_gather`` allocates the all-gather input
  (the sharded parameters cast to ``param_dtype``) and the whole all-gather output buffer (the
  input is a view into it) under this stream in the forward and the backward prefetch;
* ``all_gather_stream`` (stream 2): the collective runs here (NCCL's buffers are not the
  allocator's);
* ``reduce_scatter_stream`` (stream 3): ``foreach_reduce`` allocates the reduce-scatter output
  here, and the sharded gradients are views of it (or its cast), so gradients live in this pool;
* ``all_reduce_stream`` (stream 4): HSDP's all-reduce and a user all-reduce hook.

The reduce-scatter *input* and the unsharded parameters (``FSDPParam.alloc_all_gather_outputs``,
copy-out) are allocated on the current (default) stream, stream 0. Explicit prefetches with
``async_op`` and the unshard in ``IDLE``/``POST_BACKWARD`` states use the current stream too
(``FSDPCommContext.get_all_gather_streams``).

Emulation: a trace runs FSDP2 with a fake process group on the CPU device, whose device handle is
``torch.cpu``. ``torch.cpu.Stream`` / ``torch.cpu.stream(...)`` / ``torch.cpu.current_stream()``
already follow the current stream the way ``torch.cuda`` does, only without any device work;
FSDP2 enters exactly the stream contexts it enters on a GPU. :class:`StreamIds` reads
``torch.cpu.current_stream()`` at each allocation and numbers it; :func:`fsdp_stream_ids`
gives FSDP2's four streams their fixed ids as ``lazy_init`` creates them. Any other stream a
traced script enters with ``torch.cpu.stream(s)`` gets the next id from
:data:`FIRST_OTHER_STREAM` on, in order of first use.

Not emulated: ``record_stream`` and the cross-stream wait before a freed block can be reused
(the simulator reuses a freed block at once); FSDP2 holds its cross-stream buffers by reference
until the consuming stream has waited, so its frees in program order match a GPU run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["DEFAULT_STREAM", "FIRST_OTHER_STREAM", "FSDP_STREAMS", "StreamIds", "fsdp_stream_ids", "stream_names"]

DEFAULT_STREAM = 0
#: FSDP2's streams (``FSDPCommContext`` attributes) and their ids in a trace.
FSDP_STREAMS: dict[str, int] = {
    "all_gather_copy_in_stream": 1, "all_gather_stream": 2, "reduce_scatter_stream": 3, "all_reduce_stream": 4,
}
#: The first id given to a stream that is not FSDP2's.
FIRST_OTHER_STREAM = 8


def stream_names(streams: set[int] | frozenset[int]) -> dict[int, str]:
    """Display names of stream ids: ``default``, FSDP2's attribute names, ``side stream N``."""
    known = {DEFAULT_STREAM: "default", **{sid: name.removesuffix("_stream") for name, sid in FSDP_STREAMS.items()}}
    return {sid: known.get(sid, f"side stream {sid}") for sid in sorted(streams)}


class StreamIds:
    """Numbers the emulated current stream (``torch.cpu.current_stream()``) of each allocation.

    Calling the instance returns the id of the stream current now. Streams are held (not by weak
    reference) so that an id is never reused for a new stream object at the same address.
    """

    def __init__(self) -> None:
        import torch

        self._handle: Any = torch.cpu
        self._ids: dict[int, tuple[int, Any]] = {}
        self._next = FIRST_OTHER_STREAM
        self.name(self._handle.current_stream(), DEFAULT_STREAM)

    def name(self, stream: Any, sid: int) -> None:
        """Give ``stream`` the id ``sid`` (FSDP2's streams, the default stream)."""
        if stream is not None:
            self._ids[id(stream)] = (sid, stream)

    def __call__(self) -> int:
        stream = self._handle.current_stream()
        known = self._ids.get(id(stream))
        if known is not None and known[1] is stream:
            return known[0]
        sid, self._next = self._next, self._next + 1
        self._ids[id(stream)] = (sid, stream)
        return sid


@contextmanager
def fsdp_stream_ids(ids: StreamIds) -> Iterator[None]:
    """While inside, FSDP2's communication streams get their ids of :data:`FSDP_STREAMS` when created."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext
    except ImportError:  # torch without FSDP2: nothing to name
        yield
        return
    original = FSDPCommContext.lazy_init

    def lazy_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        for attribute, sid in FSDP_STREAMS.items():
            ids.name(getattr(self, attribute, None), sid)
        return result

    FSDPCommContext.lazy_init = lazy_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        FSDPCommContext.lazy_init = original  # type: ignore[method-assign]
