"""The Triton source of `triton_lowbit.py`'s kernels (imported on first use: `import triton` costs ~0.5 s, which a
CPU run never pays). TRITON_INTERPRET is read when these are decorated, i.e. when this module is first imported.

Legend: E = experts of one grouped call, M = tokens, N = output rows, K = input columns, BN / BK / BM = tile sizes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _u8(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _u16(p, mask):
    """Little-endian uint16 at byte pointer p, as int32."""
    return _u8(p, mask) | (_u8(p + 1, mask) << 8)


@triton.jit
def _f16(p, mask):
    return _u16(p, mask).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _half(p, mask, F16: tl.constexpr):
    """A 2-byte float at p: fp16, or bf16 widened exactly (its bits are fp32's top half)."""
    if F16:
        v = _f16(p, mask)
    else:
        v = (_u16(p, mask) << 16).to(tl.float32, bitcast=True)
    return v


# One decoder per format, each (row n [BN, 1], column k [1, BK]) -> fp32 weights [BN, BK], one return each (a
# `return` inside a static `if` is not something every Triton version compiles).
@triton.jit
def _hqq(data, sc, zr, n, k, mask, K, HALF, G: tl.constexpr, BITS: tl.constexpr, F16: tl.constexpr):
    """HQQ, axis 1: group g = (n K + k) / G, column c; 4 bits: groups g < HALF in the high nibbles, the rest in the
    low ones (HQQ's `pack_4bit_u8` over the whole matrix); w = (q - zero) scale."""
    flat = n.to(tl.int64) * K + k
    g = flat // G
    c = flat % G
    if BITS == 4:
        b = _u8(data + (g % HALF) * G + c, mask)
        q = tl.where(g < HALF, b >> 4, b & 15).to(tl.float32)
    else:
        q = _u8(data + g * G + c, mask).to(tl.float32)
    return (q - _half(zr + 2 * g, mask, F16)) * _half(sc + 2 * g, mask, F16)


@triton.jit
def _vnni(data, sm, n, k, mask, K, BITS: tl.constexpr):
    """formats/vnni.py: codes [NG, G64, 8 bits 16], sm [NG, G64, 2, 16] bf16; w = (q - C) s + zero'."""
    GB = (K + 63) // 64
    blk = (n // 16).to(tl.int64) * GB + k // 64
    r = n % 16
    kk = k % 64
    if BITS == 4:                                      # k = 4 (c + 8 h) + i -> byte 64 c + 4 r + i, nibble h
        b = _u8(data + blk * 512 + ((kk // 4) % 8) * 64 + r * 4 + kk % 4, mask)
        q = tl.where(kk >= 32, b >> 4, b & 15).to(tl.float32) - 8.0
    else:                                              # k = 4 c + i -> byte 64 c + 4 r + i
        q = _u8(data + blk * 1024 + (kk // 4) * 64 + r * 4 + kk % 4, mask).to(tl.float32) - 128.0
    s = _half(sm + (blk * 32 + r) * 2, mask, False)
    m = _half(sm + (blk * 32 + 16 + r) * 2, mask, False)
    return q * s + m


@triton.jit
def _q8_0(data, n, k, mask, K):
    """34-byte blocks of 32: fp16 d, int8 q[32]; w = d q."""
    blk = data + n.to(tl.int64) * (K // 32 * 34) + (k // 32) * 34
    q = tl.load(blk + 2 + k % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return _f16(blk, mask) * q


@triton.jit
def _q4_0(data, n, k, mask, K):
    """18-byte blocks of 32: fp16 d, 16 bytes (weight j < 16: low nibble of byte j, else high of j - 16); d (q - 8)."""
    blk = data + n.to(tl.int64) * (K // 32 * 18) + (k // 32) * 18
    j = k % 32
    b = _u8(blk + 2 + j % 16, mask)
    q = tl.where(j < 16, b & 15, b >> 4).to(tl.float32)
    return _f16(blk, mask) * (q - 8.0)


@triton.jit
def _q45_k(data, n, k, mask, K, Q5: tl.constexpr):
    """Q4_K (144 bytes) / Q5_K (176): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
    (Q5_K: 32 bytes of fifth bits,) 128 bytes of nibbles; w = d sc q - dmin m (ggml's get_scale_min_k4)."""
    if Q5:
        BB = 176
        QS = 48
    else:
        BB = 144
        QS = 16
    blk = data + n.to(tl.int64) * (K // 256 * BB) + (k // 256) * BB
    j = k % 256
    sb = j // 32                                       # sub-block
    l = j % 32
    lo = sb < 4
    s_a = _u8(blk + 4 + tl.where(lo, sb, sb + 4), mask)            # scales[sb] or scales[sb + 4]
    s_b = _u8(blk + 4 + tl.where(lo, sb + 4, sb - 4), mask)        # scales[sb + 4] or scales[sb - 4]
    s_c = _u8(blk + 4 + sb, mask)                                   # scales[sb]
    sc6 = tl.where(lo, s_a & 63, (s_a & 15) | ((s_b >> 6) << 4))
    mn6 = tl.where(lo, s_b & 63, (s_a >> 4) | ((s_c >> 6) << 4))
    b = _u8(blk + QS + (sb // 2) * 32 + l, mask)
    q = tl.where(sb % 2 == 0, b & 15, b >> 4)
    if Q5:
        q = q | (((_u8(blk + 16 + l, mask) >> sb) & 1) << 4)
    return _f16(blk, mask) * sc6.to(tl.float32) * q.to(tl.float32) - _f16(blk + 2, mask) * mn6.to(tl.float32)


@triton.jit
def _q6_k(data, n, k, mask, K):
    """210-byte blocks of 256: ql[128], qh[64], int8 scales[16], fp16 d; w = d sc (q - 32), q 6 bits."""
    blk = data + n.to(tl.int64) * (K // 256 * 210) + (k // 256) * 210
    j = k % 256
    h = j // 128
    r = (j % 128) // 32
    l = j % 32
    low = (_u8(blk + 64 * h + 32 * (r % 2) + l, mask) >> (4 * (r // 2))) & 15
    high = (_u8(blk + 128 + 32 * h + l, mask) >> (2 * r)) & 3
    s = tl.load(blk + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return _f16(blk + 208, mask) * s * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _mxfp4(data, n, k, mask, K, lut):
    """17-byte blocks of 32: e8m0 exponent, 16 bytes of nibbles (as Q4_0's); w = 2^(e-127) / 2 x lut[q]."""
    blk = data + n.to(tl.int64) * (K // 32 * 17) + (k // 32) * 17
    j = k % 32
    e = _u8(blk, mask)
    half = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    b = _u8(blk + 1 + j % 16, mask)
    return half * tl.load(lut + tl.where(j < 16, b & 15, b >> 4))


@triton.jit
def _iq4_xs(data, n, k, mask, K, lut):
    """136-byte blocks of 256: fp16 d, uint16 scales_h, scales_l[4], qs[128]; 8 sub-blocks of 32 with 6-bit scales;
    w = d (ls - 32) lut[q] (IQ4_NL's code book)."""
    blk = data + n.to(tl.int64) * (K // 256 * 136) + (k // 256) * 136
    j = k % 256
    sb = j // 32
    l = j % 32
    ls = ((_u8(blk + 4 + sb // 2, mask) >> (4 * (sb % 2))) & 15) | (((_u16(blk + 2, mask) >> (2 * sb)) & 3) << 4)
    b = _u8(blk + 8 + sb * 16 + l % 16, mask)
    return _f16(blk, mask) * (ls - 32).to(tl.float32) * tl.load(lut + tl.where(l < 16, b & 15, b >> 4))


@triton.jit
def _weights(data, sc, zr, n, k, mask, K, HALF, lut, FMT: tl.constexpr, G: tl.constexpr, F16: tl.constexpr):
    """fp32 weights W[n, k] ([BN, 1] x [1, BK] -> [BN, BK]) of a matrix whose codes start at byte pointer `data`
    (its scales at `sc`, zeros at `zr` where the format keeps them apart); HALF = half the matrix's HQQ groups;
    lut = the fp32 code book (MXFP4, IQ4_XS). FMT: `triton_lowbit.FORMATS`."""
    if FMT == 0:
        w = _hqq(data, sc, zr, n, k, mask, K, HALF, G, 4, F16)
    elif FMT == 1:
        w = _hqq(data, sc, zr, n, k, mask, K, HALF, G, 8, F16)
    elif FMT == 2:
        w = _vnni(data, sc, n, k, mask, K, 4)
    elif FMT == 3:
        w = _vnni(data, sc, n, k, mask, K, 8)
    elif FMT == 4:
        w = _q8_0(data, n, k, mask, K)
    elif FMT == 5:
        w = _q4_0(data, n, k, mask, K)
    elif FMT == 6:
        w = _q45_k(data, n, k, mask, K, False)
    elif FMT == 7:
        w = _q45_k(data, n, k, mask, K, True)
    elif FMT == 8:
        w = _q6_k(data, n, k, mask, K)
    elif FMT == 9:
        w = _mxfp4(data, n, k, mask, K, lut)
    else:
        w = _iq4_xs(data, n, k, mask, K, lut)
    return w


@triton.jit
def _gemv_kernel(x_ptr, x_se, x_sm, base, offs, out_ptr, o_se, o_sm, rw_ptr, M, N, K, HALF, row0, up_row0, lut,
                 FMT: tl.constexpr, G: tl.constexpr, F16: tl.constexpr, FUSE: tl.constexpr,
                 ROUTED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[e, m, n] = sum_k x[e, m, k] W_e[n, k] for a tile of n, expert e = program_id(1); the expert's matrix
    at `base` + offs[e] (int64 [E, 6]: codes, scales, zeros; a second matrix's three after, FUSE's up), its
    rows from row0. FUSE: out = SiLU(x W_gate^T) * (x W_up^T) (up: rows from up_row0 of the second); ROUTED: times
    rw[e]. x_se = 0 shares one x among the experts (a decode token's gate_up)."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    o = offs + e * 6
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    gd, gs, gz = base + tl.load(o), base + tl.load(o + 1), base + tl.load(o + 2)
    ud, us, uz = base + tl.load(o + 3), base + tl.load(o + 4), base + tl.load(o + 5)
    xrow = x_ptr + e.to(tl.int64) * x_se + m[:, None] * x_sm
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(xrow + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0).to(tl.float32)
        wm = (n[:, None] < N) & (k[None, :] < K)
        w = _weights(gd, gs, gz, n[:, None] + row0, k[None, :], wm, K, HALF, lut, FMT, G, F16)    # [BN, BK]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if FUSE:
            wu = _weights(ud, us, uz, n[:, None] + up_row0, k[None, :], wm, K, HALF, lut, FMT, G, F16)
            acc_u += tl.sum(x[:, None, :] * wu[None, :, :], axis=2)
    if FUSE:
        acc = acc * tl.sigmoid(acc) * acc_u
    if ROUTED:
        acc = acc * tl.load(rw_ptr + e).to(tl.float32)
    optr = out_ptr + e.to(tl.int64) * o_se + m[:, None] * o_sm + n[None, :]
    tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _decode_kernel(base, offs, out_ptr, N, K, HALF, row0, lut, FMT: tl.constexpr, G: tl.constexpr,
                   F16: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[e, n, k] = W_e[row0 + n, k] in out's dtype: a scratch tile set for cuBLAS (prefill)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    e = tl.program_id(2)
    o = offs + e * 6
    mask = (n[:, None] < N) & (k[None, :] < K)
    w = _weights(base + tl.load(o), base + tl.load(o + 1), base + tl.load(o + 2), n[:, None] + row0, k[None, :],
                 mask, K, HALF, lut, FMT, G, F16)
    optr = out_ptr + (e.to(tl.int64) * N + n[:, None]) * K + k[None, :]
    tl.store(optr, w.to(out_ptr.dtype.element_ty), mask=mask)
