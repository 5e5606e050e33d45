"""Triton kernels that compute low-bit experts on the GPU from the bytes as they lie in a device slot (issue 43).

Legend: E = experts of one grouped call (selected slots, repeats allowed), M = tokens, N = output rows of a matrix,
K = its input columns, I = an expert's intermediate size, H = hidden size, BN / BK / BM = tile sizes.

Why: the dequantise path (`formats/vnni.dequantize`, HQQ's `Quantizer.dequantize`, `formats/gguf_dequant.py`) runs
~10 elementwise torch kernels per matrix and writes a bf16 copy of every expert it computes (on an H200 those
kernels took 34 of a q4 request's 142 ms of GPU time, docs/gpu-check.md). Here a decode layer is three launches
whatever its top-k: one grouped GEMV over all selected experts' gate and up (SiLU(gate) * up fused in its epilogue),
one grouped GEMV for down (the routing weight fused), one sum over the experts. A prefill (M > DECODE_MAX_M) decodes
each matrix into a scratch buffer of the activations' dtype (bf16 on a GPU: never an fp32 expert) and lets
cuBLAS multiply.

Every format is one `_weights` branch that turns (row n, column k) into the fp32 weight, reading the block bytes
where they lie; scales are assembled from bytes and bitcast (no alignment needed). Formats (`Spec.fmt`):
  hqq4, hqq8      moectl's stored copies (`formats/hqq.py`, axis 1): HQQ's packing, (q - z) s per group
  vnni4, vnni8    the `--cpu-experts` layout (`formats/vnni.py`): 16 x 64 blocks, (q - C) s + zero'
  q8_0 q4_0 q4_k q5_k q6_k mxfp4 iq4_xs   GGUF blocks as the file stores them (gguf-py `gguf/quants.py`)

CPU twins: the same source runs under Triton's interpreter (`TRITON_INTERPRET=1`, read when the kernels are
decorated: set it before importing this module) on CPU tensors; tests/test_triton_lowbit.py compares every format
with `gguf.quants.dequantize` / moectl's dequantisers. The interpreter's limits are coded around: bf16 is only ever
loaded and cast (arithmetic in fp32), no autotuning, no inline asm.

`import triton` happens only in the kernels' source module (`triton_lowbit_jit.py`), on first use: without triton
`available()` is False and callers keep the dequantise path (`device_kernels` says which path a device gets, once
per process).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

import torch


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DECODE_MAX_M = 8                            # up to this many tokens: the GEMV kernels; above: decode tile + cuBLAS
MIN_CAPABILITY = (8, 0)                     # Triton's supported NVIDIA GPUs (its README); sm_75 keeps the old path

# Format codes (the kernels' constexpr switch) and their blocks: (weights, bytes) per block along a row.
FORMATS = {"hqq4": 0, "hqq8": 1, "vnni4": 2, "vnni8": 3, "q8_0": 4, "q4_0": 5, "q4_k": 6, "q5_k": 7, "q6_k": 8,
           "mxfp4": 9, "iq4_xs": 10}
GGUF_BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
               "mxfp4": (32, 17), "iq4_xs": (256, 136)}
# GGUF type name (gguf's GGMLQuantizationType) -> format
GGUF_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "MXFP4": "mxfp4",
              "IQ4_XS": "iq4_xs"}
# The non-uniform code books: MXFP4's e2m1 values doubled (ggml's kvalues_mxfp4; the scale is halved to match) and
# IQ4_NL's (IQ4_XS).
_LUTS = {"mxfp4": (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),
         "iq4_xs": (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)}


def available() -> bool:
    """Whether triton is installed (the kernels' module is imported on first use)."""
    return importlib.util.find_spec("triton") is not None


def _jit():
    from . import triton_lowbit_jit

    return triton_lowbit_jit


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- what a device slot's matrix is --------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """A matrix encoding the kernels read: `fmt` one of FORMATS; HQQ's group size and whether its scales are fp16
    (else bf16)."""

    fmt: str
    group: int = 64
    f16: bool = False

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"no Triton kernel reads {self.fmt!r}; formats: {', '.join(FORMATS)}")


@dataclass
class Matrix:
    """One low-bit matrix W [N, K] where its bytes lie (rows row0 .. row0 + N of a matrix of NTOT rows: HQQ's gate
    and up share one packed [2I, K]); callable: x [..., K] -> x @ W^T [..., N] in x's dtype."""

    spec: Spec
    N: int
    K: int
    data: torch.Tensor                      # codes (GGUF: the whole blocks)
    scale: torch.Tensor | None = None       # HQQ: scales; vnni: sm (scales then zero')
    zero: torch.Tensor | None = None        # HQQ: zeros
    row0: int = 0
    ntot: int = 0

    def __post_init__(self):
        self.ntot = self.ntot or self.N
        fmt = self.spec.fmt
        if fmt in GGUF_BLOCKS and self.K % GGUF_BLOCKS[fmt][0]:
            raise ValueError(f"{fmt}: rows of {self.K} are not whole blocks of {GGUF_BLOCKS[fmt][0]}")

    @property
    def half(self) -> int:
        """Half the HQQ groups of the whole packed matrix (the kernels' HALF; unused by other formats)."""
        return self.ntot * self.K // self.spec.group // 2

    def pointers(self) -> tuple[int, int, int]:
        d = self.data.data_ptr()
        return d, self.scale.data_ptr() if self.scale is not None else d, \
            self.zero.data_ptr() if self.zero is not None else d

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = linear(x.reshape(-1, shape[-1]), [self])
        return y.reshape(*shape[:-1], self.N)


@dataclass
class GateUp:
    """An expert's gate_up [2I, K] as two low-bit matrices (gate rows, then up rows); callable like `Matrix`."""

    gate: Matrix
    up: Matrix

    @property
    def N(self) -> int:
        return self.gate.N + self.up.N

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = linear(x.reshape(-1, shape[-1]), [self.gate, self.up])
        return y.reshape(*shape[:-1], self.N)


def _check_grouped(mats: list[Matrix]) -> None:
    m0 = mats[0]
    if any((m.spec, m.N, m.K, m.ntot) != (m0.spec, m0.N, m0.K, m0.ntot) for m in mats):
        raise ValueError("a grouped call needs every matrix of one encoding and shape")


def offsets(pairs: list[tuple[Matrix, Matrix]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, offs int64 [E, 6]): every matrix's code / scale / zero pointers as byte offsets from `base` (the first
    matrix's codes), two matrices a row. The matrices may lie anywhere (slots, staging buffers)."""
    base = pairs[0][0].data
    b = base.data_ptr()
    rows = [[p - b for m in pair for p in m.pointers()] for pair in pairs]
    return base.view(torch.uint8) if base.dtype != torch.uint8 else base, \
        torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def slot_offsets(pool: torch.Tensor, slots: torch.Tensor, parts: list[tuple[int, int, int]]) -> torch.Tensor:
    """offs int64 [E, 6] for the experts in `slots` (int [E], any order, repeats allowed) of a slot pool
    (uint8 [S, bytes per expert]): `parts` = one or two matrices' (codes, scales, zeros) byte offsets inside a slot.
    Stays on the device: no host sync."""
    part = torch.tensor([p for triple in parts for p in triple] * (2 // len(parts)), dtype=torch.int64)
    return slots.to(torch.int64)[:, None] * pool.stride(0) + part.to(pool.device)[None, :]


def _lut(fmt: str, device) -> torch.Tensor:
    key = (fmt, str(device))
    if key not in _LUT_CACHE:
        _LUT_CACHE[key] = torch.tensor(_LUTS.get(fmt, (0.0,)), dtype=torch.float32, device=device)
    return _LUT_CACHE[key]


_LUT_CACHE: dict = {}


def _meta(spec: Spec) -> dict:
    return {"FMT": FORMATS[spec.fmt], "G": spec.group, "F16": spec.f16}


def gemv(x: torch.Tensor, base: torch.Tensor, offs: torch.Tensor, m0: Matrix, out_dtype=None, fuse: bool = False,
         up_row0: int = 0, routing: torch.Tensor | None = None, per_expert_x: bool = False) -> torch.Tensor:
    """The grouped GEMV: out [E, M, N] (E = offs' rows) of x [M, K] (or [E, M, K] with per_expert_x) times each
    expert's matrix (`m0` describes them all: encoding, N, K); fuse: SiLU(gate) * up with the second matrix of each
    offs row; routing [E]: each expert's output scaled by its weight. M <= DECODE_MAX_M."""
    E, M, N, K = offs.shape[0], x.shape[-2], m0.N, m0.K
    assert M <= DECODE_MAX_M and x.shape[-1] == K
    x = x.contiguous()
    out = torch.empty(E, M, N, dtype=out_dtype or x.dtype, device=x.device)
    BN, BK = (128, 256) if INTERPRET else (32, 128)       # the interpreter: few big tiles (numpy)
    BM = 1 << (M - 1).bit_length()
    grid = (_cdiv(N, BN), E)
    _jit()._gemv_kernel[grid](x, x.stride(0) if per_expert_x else 0, x.stride(-2), base, offs, out, out.stride(0),
                              out.stride(1), routing if routing is not None else x, M, N, K, m0.half, m0.row0,
                              up_row0, _lut(m0.spec.fmt, x.device), FUSE=fuse, ROUTED=routing is not None, BM=BM,
                              BN=BN, BK=BK, **_meta(m0.spec))
    return out


def dequantize(base: torch.Tensor, offs: torch.Tensor, m0: Matrix, dtype: torch.dtype) -> torch.Tensor:
    """W [E, N, K] in `dtype` of each offs row's first matrix (rows row0 .. row0 + N of m0's shape)."""
    E, N, K = offs.shape[0], m0.N, m0.K
    out = torch.empty(E, N, K, dtype=dtype, device=base.device)
    BN, BK = (128, 256) if INTERPRET else (64, 128)
    grid = (_cdiv(N, BN), _cdiv(K, BK), E)
    _jit()._decode_kernel[grid](base, offs, out, N, K, m0.half, m0.row0, _lut(m0.spec.fmt, base.device), BN=BN,
                                BK=BK, **_meta(m0.spec))
    return out


def linear(x: torch.Tensor, mats: list[Matrix]) -> torch.Tensor:
    """x [M, K] @ cat(W of mats)^T -> [M, sum N] in x's dtype: GEMV kernels up to DECODE_MAX_M rows, else each
    matrix decoded into a scratch of x's dtype and multiplied by torch (cuBLAS on a GPU)."""
    ys = []
    for m in mats:
        base, offs = offsets([(m, m)], x.device)
        if x.shape[0] <= DECODE_MAX_M:
            ys.append(gemv(x, base, offs, m)[0])
        else:
            ys.append(x @ dequantize(base, offs, m, x.dtype)[0].T)
    return ys[0] if len(ys) == 1 else torch.cat(ys, -1)


def experts_decode(x: torch.Tensor, pairs: list[tuple[GateUp, Matrix]], weights: torch.Tensor) -> torch.Tensor:
    """One token (or up to DECODE_MAX_M) through a layer's selected experts: x [M, H]; pairs (gate_up, down) of
    one encoding each (repeats allowed); weights [E] routing weights -> out [M, H] in x's dtype =
    sum_e weights[e] * down_e(SiLU(gate_e x) * up_e x). Three launches: gate+up, down, the sum."""
    g0, u0, d0 = pairs[0][0].gate, pairs[0][0].up, pairs[0][1]
    _check_grouped([p[0].gate for p in pairs] + [p[0].up for p in pairs if p[0].up.data is not p[0].gate.data])
    _check_grouped([p[1] for p in pairs])
    base, offs = offsets([(gu.gate, gu.up) for gu, _ in pairs], x.device)
    h = gemv(x, base, offs, g0, out_dtype=torch.float32, fuse=True, up_row0=u0.row0)      # [E, M, I] fp32
    dbase, doffs = offsets([(d, d) for _, d in pairs], x.device)
    y = gemv(h, dbase, doffs, d0, out_dtype=torch.float32, routing=weights.float(), per_expert_x=True)  # [E, M, H]
    return y.sum(0).to(x.dtype)


def groupable(pairs: list) -> bool:
    """Whether `experts_decode` takes these (gate_up, down) pairs: kernel callables, every gate and up of one encoding
    and shape, every down of one."""
    if not all(isinstance(g, GateUp) and isinstance(d, Matrix) for g, d in pairs):
        return False
    key = lambda m: (m.spec, m.N, m.K, m.ntot)                                   # noqa: E731
    g0, d0 = pairs[0]
    return all(key(g.gate) == key(g.up) == key(g0.gate) and g.up.row0 == g0.up.row0 and key(d) == key(d0)
               for g, d in pairs)


def runs_on(t: torch.Tensor) -> bool:
    """Whether the kernels can read tensor t where it is: a CUDA tensor, or any under the interpreter."""
    return t.is_cuda or INTERPRET


# --- which path a device gets --------------------------------------------------------------------------------
_said: set = set()


def why_not(device) -> str | None:
    """None when the low-bit experts on `device` can use these kernels, else why not (the dequantise path then)."""
    device = torch.device(device)
    if os.environ.get("MOECTL_TRITON", "1") == "0":
        return "MOECTL_TRITON=0"
    if not available():
        return "triton is not installed"
    if device.type != "cuda":
        return f"{device.type} is not a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} is below Triton's {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    return None


def device_kernels(device) -> bool:
    """Whether low-bit experts on `device` are computed by these kernels (only ever on CUDA: the CPU has its own
    kernels; the interpreter twins call the kernels directly); on a CUDA device the answer is said once per process
    on stderr."""
    device = torch.device(device)
    reason = why_not(device)
    if device.type == "cuda" and device not in _said:
        _said.add(device)
        print(f"low-bit experts on {device}: " + ("Triton kernels (moectl/kernels/triton_lowbit.py)" if reason is None
              else f"dequantised by torch ({reason})"), file=sys.stderr)
    return reason is None
