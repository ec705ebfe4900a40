"""Shared by the runtime tests: the core (skip without a compiler) and a stub CUDA runtime library."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

STUB_SOURCE = r"""
#include <stdlib.h>
#include <stddef.h>
static long n_malloc = 0, n_free = 0, live = 0;
int cudaMalloc(void **p, size_t size) { *p = malloc(size ? size : 1); if (!*p) return 2; n_malloc++; live++; return 0; }
int cudaFree(void *p) { free(p); n_free++; live--; return 0; }
long stub_mallocs(void) { return n_malloc; }
long stub_frees(void) { return n_free; }
long stub_live(void) { return live; }
"""


def core_or_skip():
    from memplan.alloc.runtime._native import RuntimeUnavailable, load_core

    try:
        return load_core()
    except RuntimeUnavailable as exc:
        pytest.skip(f"runtime core unavailable: {exc}")


def build_stub(tmp: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the stub CUDA runtime")
    src = tmp / "stub_cudart.c"
    src.write_text(STUB_SOURCE)
    out = tmp / "libstub_cudart.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", str(src), "-o", str(out)], check=True)
    return out
