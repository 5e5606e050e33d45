"""HqqFormat: one expert's HQQ low-bit copy as one packed buffer, dequantised with HQQ's own code.

Legend: G = group size, R = rows of a matrix reshaped into groups (numel / G along axis 1; G along axis 0),
C = its columns, N = bytes of one packed expert.

Each 2-D matrix of the expert layout (gate_up [2I,H], down [H,I]) is stored as HQQ stores it:
`Quantizer.quantize(W, nbits, group_size, axis)` reshapes W into groups ([numel/G, G] for axis 1, [G, numel/G]
for axis 0), bit-packs the integer codes along the first dimension (8 bit: R rows of uint8; 4 bit: R/2; 2 bit:
R/4; 3 bit: ceil(R/10) rows of int32) and keeps one scale and one zero per group. The parts, in order:

    {name}.W_q    packed codes      [packed R, C]  uint8 / int32
    {name}.scale  one per group     [numel/G, 1] (axis 1) or [1, numel/G] (axis 0), `meta_dtype`
    {name}.zero   one per group     same

1-D tensors (GPT-OSS biases) stay dense in `meta_dtype`. `weights` rebuilds HQQ's meta dict from the views and
calls `Quantizer.dequantize` (bit-unpack, (W_r - zero) * scale, reshape), so a stored copy dequantises to
exactly what HQQ's own dequantisation gives, on the device the buffer is on.

`name` is `q{bits}g{group}` (the `--lowbit` value); the axis is recorded in the copy set's JSON.
"""

from __future__ import annotations

import math
import re

import torch

from ..errors import MoectlError
from .expert import ExpertFormat, Part

BITS = (8, 4, 3, 2)
PACKED_ROWS = {8: 1, 4: 2, 3: 10, 2: 4}          # codes per packed element along the first dimension
CODE_DTYPE = {8: torch.uint8, 4: torch.uint8, 3: torch.int32, 2: torch.uint8}
PACKING = {8: "8bit_u8", 4: "4bit_u8", 3: "3bit_32", 2: "2bit_u8"}
NAME_RE = re.compile(r"^q([0-9]+)g([0-9]+)$")


def lowbit_name(bits: int, group: int) -> str:
    return f"q{bits}g{group}"


def parse_lowbit(name: str) -> tuple[int, int]:
    """'q4g64' -> (4, 64), or a clear error."""
    m = NAME_RE.match(str(name).strip().lower())
    if not m or int(m.group(1)) not in BITS:
        raise MoectlError(f"--lowbit {name!r}: write q<bits>g<group>, bits one of {', '.join(map(str, BITS))}, "
                          f"e.g. q4g64")
    return int(m.group(1)), int(m.group(2))


def check_settings(bits: int, group: int, axis: int, shapes) -> None:
    """Clear errors for settings HQQ would assert on."""
    if bits not in BITS:
        raise MoectlError(f"--bits {bits}: choose one of {', '.join(map(str, BITS))}")
    if axis not in (0, 1):
        raise MoectlError(f"--axis {axis}: choose 0 or 1")
    if group < 8 or group % 8:
        raise MoectlError(f"--group-size {group}: HQQ needs a multiple of 8")
    for shape in shapes:
        if len(shape) == 2 and math.prod(shape) % group:
            raise MoectlError(f"--group-size {group} does not divide a {tuple(shape)} expert matrix")


class HqqFormat(ExpertFormat):
    def __init__(self, layout, bits: int, group: int, axis: int, meta_dtype: torch.dtype,
                 compute_dtype: torch.dtype | None = None):
        check_settings(bits, group, axis, layout.shapes)
        self.layout, self.bits, self.group, self.axis = layout, bits, group, axis
        self.meta_dtype, self.compute_dtype = meta_dtype, compute_dtype or meta_dtype
        self.matrices = [n for n, s in zip(layout.names, layout.shapes) if len(s) == 2]
        parts = []
        for name, shape in zip(layout.names, layout.shapes):
            if len(shape) != 2:
                parts.append(Part(name, tuple(shape), meta_dtype))
                continue
            groups = math.prod(shape) // group
            rows, cols = (groups, group) if axis == 1 else (group, groups)
            meta_shape = (groups, 1) if axis == 1 else (1, groups)
            parts += [Part(f"{name}.W_q", (-(-rows // PACKED_ROWS[bits]), cols), CODE_DTYPE[bits]),
                      Part(f"{name}.scale", meta_shape, meta_dtype), Part(f"{name}.zero", meta_shape, meta_dtype)]
        super().__init__(lowbit_name(bits, group), parts)

    def meta(self, name: str, views: dict[str, torch.Tensor]) -> dict:
        """HQQ's meta dict for matrix `name`, its scale and zero being views of the buffer."""
        shape = dict(zip(self.layout.names, self.layout.shapes))[name]
        return {"nbits": self.bits, "group_size": self.group, "shape": torch.Size(shape), "axis": self.axis,
                "scale": views[f"{name}.scale"], "zero": views[f"{name}.zero"], "packing": PACKING[self.bits],
                "view_as_float": False, "compute_dtype": self.meta_dtype}

    # Set at load when the device computes low-bit experts with moectl's Triton kernels (runtime/load.py): `weights`
    # then returns the kernels' callables for a slot's q4 / q8 axis-1 copy instead of dequantising it.
    device_kernels = False

    def kernel_weights(self, views: dict[str, torch.Tensor]) -> dict | None:
        """{gate_up: GateUp, down: Matrix} reading the slot's bytes (kernels/triton_lowbit.py), or None where the
        kernels do not take this copy set (other bits, axis 0, 1-D tensors, fp32 scales, a tensor the kernels cannot
        reach)."""
        from ..kernels import triton_lowbit as tk

        if (not self.device_kernels or self.bits not in (4, 8) or self.axis != 1 or set(self.matrices) != set(
                self.layout.names) or self.meta_dtype not in (torch.bfloat16, torch.float16)
                or not tk.runs_on(next(iter(views.values())))):
            return None
        shapes = dict(zip(self.layout.names, self.layout.shapes))
        spec = tk.Spec(f"hqq{self.bits}", self.group, self.meta_dtype == torch.float16)
        out = {}
        for name in self.matrices:
            N, K = shapes[name]
            parts = views[f"{name}.W_q"], views[f"{name}.scale"], views[f"{name}.zero"]
            out[name] = tk.Matrix(spec, N, K, *parts)
            if name == "gate_up":                   # gate rows, then up rows: halves of one packed matrix
                out[name] = tk.GateUp(tk.Matrix(spec, N // 2, K, *parts, 0, N), tk.Matrix(spec, N // 2, K, *parts,
                                                                                         N // 2, N))
        return out

    def weights(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from hqq.core.quantize import Quantizer

        if self.device_kernels and (kernel := self.kernel_weights(views)) is not None:
            return kernel
        out = {}
        for name in self.layout.names:
            if name in self.matrices:
                w = Quantizer.dequantize(views[f"{name}.W_q"], self.meta(name, views))
            else:
                w = views[name]
            out[name] = w if w.dtype == self.compute_dtype else w.to(self.compute_dtype)
        return out

    def quantize(self, weights: dict[str, torch.Tensor], out: torch.Tensor | None = None,
                 device: str = "cpu", optimize: bool = True) -> torch.Tensor:
        """Pack HQQ's quantization of `weights` (the layout's tensors) into a uint8 buffer [N] (on the CPU);
        `optimize=False` is round-to-nearest (see `quant/methods.py`)."""
        from hqq.core.quantize import Quantizer

        parts = {}
        for name in self.layout.names:
            w = weights[name]
            if name not in self.matrices:
                parts[name] = w
                continue
            W_q, meta = Quantizer.quantize(w.to(device), nbits=self.bits, group_size=self.group, axis=self.axis,
                                           optimize=optimize, bitpack=True, device=device)
            parts[f"{name}.W_q"], parts[f"{name}.scale"], parts[f"{name}.zero"] = W_q, meta["scale"], meta["zero"]
        return self.pack({k: v.cpu() for k, v in parts.items()}, out)

    def describe(self) -> dict:
        return super().describe() | {"bits": self.bits, "group_size": self.group, "axis": self.axis,
                                     "meta_dtype": str(self.meta_dtype).replace("torch.", "")}
