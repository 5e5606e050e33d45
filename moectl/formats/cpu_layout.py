"""Which CPU kernel layout a low-bit copy set is repacked into at load, when its experts are computed on the CPU.

q4 and q8 copies grouped along the input axis in multiples of 64 -> moectl's own int8-activation kernel
(`vnni.py`, `moectl/kernels`: the copy's codes and scales, activations quantized to int8 per 64 as llama.cpp
does), where it is built on this machine; else
q4 copies -> torch's int4 kernel (`int4_cpu.py`, lossless: same codes and scales),
q8 copies -> torch's int8 kernel (`int8_cpu.py`, requantized per output row: a second rounding, bounded there).
Anything else stays in HQQ's layout and is dequantised at every use.
"""

from __future__ import annotations

from .expert import ExpertFormat
from .hqq import HqqFormat
from .int4_cpu import Int4CpuFormat, int4_cpu_ok
from .int8_cpu import Int8CpuFormat, int8_cpu_ok
from .vnni import VnniFormat, vnni_ok


def cpu_kernel_format(fmt: HqqFormat) -> ExpertFormat | None:
    """The kernel layout for `fmt`'s copies, or None when no CPU kernel takes them."""
    if vnni_ok(fmt):
        return VnniFormat(fmt)
    if int4_cpu_ok(fmt):
        return Int4CpuFormat(fmt)
    if int8_cpu_ok(fmt):
        return Int8CpuFormat(fmt)
    return None
