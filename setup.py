"""Optional C extensions (the DSA search core, the doctor's replay core); metadata lives in pyproject.toml.

``optional=True``: without a compiler the build goes on, :mod:`memplan.alloc.dsa` falls back to its
pure-Python search (same algorithm, ~100x slower) and :mod:`memplan.doctor.replay` to the pure-Python
allocator model (same answers, ~10x slower).
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
    ]
)
