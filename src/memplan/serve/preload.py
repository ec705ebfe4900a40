"""Imported once by the forkserver of :mod:`memplan.serve.isolate`, before it forks any worker.

Importing this module answers one small request of each kind, so that the lazy imports and the
caches they fill (presets, the job flags, the GPU catalogue, sysconfig's paths) are in the
forkserver's memory, and every child forked from it starts warm: a placement request takes about
10 ms in a warm child instead of about 100 ms in a cold one.
"""

from __future__ import annotations

from memplan.serve.work import doctor_reply, estimate_reply, fit_reply, place_reply

_MESSAGE = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.10 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 77.88 GiB memory in "
            "use. Of the allocated memory 66.00 GiB is allocated by PyTorch, and 9.80 GiB is reserved by PyTorch but "
            "unallocated.")

estimate_reply({"model": "gpt2", "gpu": "h100-80gb"})
place_reply({"job": {"model": "gpt2"}, "gpus": [{"id": "warm-up", "gpu": "h100-80gb"}]})
fit_reply({"model": "gpt2", "gpus": 2, "top": 1})
doctor_reply({"message": _MESSAGE, "job": {"model": "gpt2"}}, None)

# Every preset parsed once here: a child forked for a request then finds its model in the cache.
from memplan.model.presets import load_preset, preset_names  # noqa: E402

for _name in preset_names():
    load_preset(_name)
