"""The tracker and recorder: allocations seen by dispatch, their summary, simulated reserved memory, CUDA streams, simulated ranks."""
