"""Optional C extensions (the DSA search core, the doctor's and the estimator's replay core, the runtime core);
metadata lives in pyproject.toml.

``optional=True``: without a compiler the build goes on, :mod:`memplan.alloc.dsa` falls back to its
pure-Python search (same algorithm, ~100x slower), and :mod:`memplan.doctor.replay` and
:mod:`memplan.alloc.schedule` (``reserved="simulated"``) to the pure-Python allocator model (same answers,
~10x slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "memplan.alloc._dsa_search",
            sources=["src/memplan/alloc/_dsa_search.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "memplan.alloc._replay_core",
            sources=["src/memplan/alloc/_replay_core.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        # The runtime core: plain C (no Python.h), loaded with ctypes and by CUDAPluggableAllocator
        # (memplan/alloc/runtime/_native.py); without a compiler it is built at first use if one appears.
        Extension(
            "memplan.alloc.runtime._core",
            sources=["src/memplan/alloc/runtime/_core.c"],
            extra_compile_args=["-O2", "-std=c99", "-D_POSIX_C_SOURCE=200809L"],
            libraries=["dl", "pthread"],
            optional=True,
        ),
    ]
)
