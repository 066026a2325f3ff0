"""The tests' spawn helper: ``fp4fuse.launch`` (shared with the demo), and the Inductor setting of
ranks that compile."""
from fp4fuse.launch import RankError, run_on_ranks

__all__ = ["COMPILE_THREADS", "RankError", "run_on_ranks"]

#: ``TORCHINDUCTOR_COMPILE_THREADS`` of spawned ranks that compile. Ranks that compile one model
#: compile the same C++ kernels into one cache, and Inductor's per-kernel file lock makes one rank
#: wait while another compiles each kernel: with one worker per rank, one of two cores would sit
#: idle through every kernel compile; with two, two kernels compile at once.
COMPILE_THREADS = "2"
