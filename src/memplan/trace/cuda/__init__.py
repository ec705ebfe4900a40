"""CUDA emulation on a CPU machine: the caching allocator's rounding, autocast, kernel dispatch and SDPA backends as on CUDA."""
