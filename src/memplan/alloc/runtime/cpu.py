"""CPU backend: PyTorch's CPU allocator replaced, inside ``planned(device="cpu")`` only.

``_cpu_allocator.cpp`` (a c10::Allocator, ~60 lines, no pybind) is compiled with
``torch.utils.cpp_extension.load`` at first use into ``~/.cache/memplan/runtime/torch-<version>``
(or ``$MEMPLAN_RUNTIME_CACHE``) and loaded with ctypes; it calls the C core through function pointers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from pathlib import Path

from memplan.alloc.runtime._native import Core, RuntimeUnavailable, load_core, runtime_cache_dir
from memplan.errors import MemplanError

__all__ = ["cpu_allocator_library", "installed_on_cpu"]

_SOURCE = Path(__file__).resolve().parent / "_cpu_allocator.cpp"


@functools.lru_cache(maxsize=1)
def cpu_allocator_library() -> ctypes.CDLL:
    """Build (once per torch version and source) and load the CPU allocator shim."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise RuntimeUnavailable(f"the CPU backend needs torch ({exc})") from None
    import hashlib

    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    name = f"mpr_cpu_{digest}"
    build = runtime_cache_dir() / f"torch-{torch.__version__}" / name
    build.mkdir(parents=True, exist_ok=True)
    library = build / f"{name}.so"
    if not library.is_file():
        try:
            cpp_extension.load(name=name, sources=[str(_SOURCE)], build_directory=str(build), is_python_module=False,
                               extra_cflags=["-O2"], verbose=bool(os.environ.get("MEMPLAN_RUNTIME_VERBOSE")))
        except (RuntimeError, OSError, ImportError) as exc:
            raise RuntimeUnavailable(f"building the CPU allocator shim failed: {str(exc).strip().splitlines()[-1:]}") from None
    lib = ctypes.CDLL(str(library))
    lib.mpr_cpu_install.restype = ctypes.c_int
    lib.mpr_cpu_install.argtypes = [ctypes.c_void_p] * 3
    lib.mpr_cpu_uninstall.restype = ctypes.c_int
    return lib


@contextlib.contextmanager
def installed_on_cpu(core: Core) -> Iterator[None]:
    """PyTorch's CPU allocator is the core's inside the block, the previous one again after it."""
    shim = cpu_allocator_library()
    native = load_core()
    malloc_fn = ctypes.cast(native.mpr_malloc, ctypes.c_void_p).value
    free_fn = ctypes.cast(native.mpr_free_any, ctypes.c_void_p).value
    rc = shim.mpr_cpu_install(malloc_fn, free_fn, core.handle)
    if rc == 1:
        raise MemplanError("a memplan planned CPU arena is already active; nest no second one")
    if rc == 2:
        raise MemplanError("another CPU allocator with a higher priority is registered; the planned arena cannot replace it")
    try:
        yield
    finally:
        shim.mpr_cpu_uninstall()
