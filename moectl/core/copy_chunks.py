"""How the copy engine cuts an expert copy into chunks: the constants and counts the runtime's Loader
(`runtime/loader.py`), the simulator and the admission rule share. No torch, no device code.

A chunk = one contiguous row range of one weight matrix of a packed expert, at most CHUNK_BYTES. A chunk in
flight is never interrupted, so a demand load waits at most one chunk behind a started prefetch.
"""

from __future__ import annotations

import math

CHUNK_BYTES = 8 << 20                   # the largest chunk a copy is cut into (8 MiB)


def split_rows(rows: int, row_bytes: int, cap: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """[(r0, r1)]: the row ranges a matrix of `rows` rows of `row_bytes` bytes is copied in: as few as keep each
    within `cap` bytes (a row is never cut), equal to a row."""
    n = max(1, min(rows, -(-rows * row_bytes // cap)))
    return [(rows * i // n, rows * (i + 1) // n) for i in range(n)]


def chunk_count(nbytes: float, cap: float = CHUNK_BYTES) -> int:
    """How many chunks the copy of a packed expert of `nbytes` bytes is cut into, for the simulator and the admission
    rule (which know bytes, not parts): its two matrices, gate_up [2I, D] (2/3 of the bytes) and down [D, I] (1/3),
    each in `split_rows`'s ranges (rows small against `cap`)."""
    return sum(max(1, math.ceil(nbytes * share / cap)) for share in (2 / 3, 1 / 3))
