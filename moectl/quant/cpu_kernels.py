"""Which CPU kernel layout a low-bit copy set is repacked into at load, when its experts are computed on the CPU.

q4 copies grouped along the input axis -> torch's int4 kernel (`int4_cpu.py`, lossless: same codes and scales);
q8 copies -> torch's int8 kernel (`int8_cpu.py`, requantized per output row: a second rounding, bounded there).
Anything else stays in HQQ's layout and is dequantised at every use.
"""

from __future__ import annotations

from ..models.formats import ExpertFormat
from .hqq_format import HqqFormat
from .int4_cpu import Int4CpuFormat, int4_cpu_ok
from .int8_cpu import Int8CpuFormat, int8_cpu_ok


def cpu_kernel_format(fmt: HqqFormat) -> ExpertFormat | None:
    """The kernel layout for `fmt`'s copies, or None when no CPU kernel takes them."""
    if int4_cpu_ok(fmt):
        return Int4CpuFormat(fmt)
    if int8_cpu_ok(fmt):
        return Int8CpuFormat(fmt)
    return None
