"""The run's thread count: --threads, or the default for the model's shapes (torch-free: the torch runtime sets
torch's intra-op threads to it, `runtime/machine.py: set_threads`; the torch-free one hands it to ggml alone,
`runtime/graph_engine.py`)."""

from __future__ import annotations

import os

from ..errors import MoectlError


def default_threads(hidden_size: int | None = None, intermediate_size: int | None = None,
                    drives_gpu: bool = False) -> int:
    """The runtime's intra-op thread count when --threads is not given. Small matrices are dispatch bound:
    more threads only add synchronisation (and on a loaded 2-core machine a waiting thread can slow a small op
    100x), so models whose expert matrices are under ~4M weights get 1 thread; larger ones get every core this
    process may run on -- but one, when the process drives a GPU (`drives_gpu`) on 4 cores or more: the thread
    launching its kernels then never waits behind torch's CPU threads. Measured on an H200 beside 16 Xeon cores
    (docs/gpu-check.md): a CPU-computed Mixtral expert took 13.5 ms at 16 threads and 6.1 ms at 15."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if hidden_size is not None and intermediate_size is not None and hidden_size * intermediate_size < 4 * 2**20:
        return 1
    return max(1, cores - 1 if drives_gpu and cores >= 4 else cores)


def thread_count(n: int | None, hidden_size: int | None = None, intermediate_size: int | None = None,
                 drives_gpu: bool = False) -> int:
    """`n` (--threads, checked) or `default_threads`."""
    if n is not None and n < 1:
        raise MoectlError(f"--threads must be >= 1, not {n}")
    return n or default_threads(hidden_size, intermediate_size, drives_gpu)
