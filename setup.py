"""Optional C extension for the DSA search core; project metadata lives in pyproject.toml.

``optional=True``: without a compiler the build goes on and :mod:`memplan.alloc.dsa` falls back to
its pure-Python search (same algorithm, ~100x slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "memplan.alloc._dsa_search",
            sources=["src/memplan/alloc/_dsa_search.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
