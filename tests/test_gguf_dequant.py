"""moectl/gguf's torch dequantisation and int4 repacking against gguf's reference (`gguf.quants.dequantize`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference, quantize

from gguf_build import k_blocks
from moectl.formats.gguf_dequant import dequantize
from moectl.formats.gguf_int4_repack import int4_dequantized, repack_int4

ROWS, COLS = 32, 512


def packed(encoding: T, seed: int = 0) -> np.ndarray:
    """[ROWS, bytes] of a [ROWS, COLS] tensor: quantised by gguf where it can, else valid hand-built K blocks."""
    x = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    x[0, :32] = 0                                                   # an all-zero block (scale 0)
    if encoding == T.F32:
        return x.view(np.uint8)
    if encoding == T.F16:
        return x.astype(np.float16).view(np.uint8)
    if encoding in (T.Q4_K, T.Q5_K, T.Q6_K):
        return k_blocks(ROWS, COLS, encoding, seed)
    return quantize(x, encoding)


@pytest.mark.parametrize("encoding", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4])
def test_dequantize_bit_for_bit(encoding):
    """fp32 values equal gguf's reference exactly (including at an odd start in a buffer: the copy path)."""
    raw = packed(encoding)
    want = torch.from_numpy(reference(raw if encoding not in (T.F32, T.F16) else raw.view(
        np.float32 if encoding == T.F32 else np.float16), encoding)).reshape(ROWS, COLS).float()
    flat = torch.from_numpy(raw.reshape(-1).copy())
    got = dequantize(flat, encoding, (ROWS, COLS))
    assert torch.equal(got, want)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), flat])[1:]           # storage offset 1
    assert torch.equal(dequantize(shifted, encoding, (ROWS, COLS)), want)
    assert dequantize(flat, encoding, (ROWS, COLS), torch.bfloat16).dtype == torch.bfloat16
    assert raw.nbytes == ROWS * COLS // GGML_QUANT_SIZES[encoding][0] * GGML_QUANT_SIZES[encoding][1]


def test_mxfp4_scale_edges():
    """e8m0 exponents 0 and 1 (ggml's subnormal-half branch) and a large one, all 16 codes."""
    blocks = np.zeros((3, 17), np.uint8)
    blocks[:, 0] = (0, 1, 200)
    blocks[:, 1:] = (np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4))
    want = torch.from_numpy(reference(blocks, T.MXFP4)).reshape(-1)
    assert torch.equal(dequantize(torch.from_numpy(blocks.reshape(-1).copy()), T.MXFP4, (96,)), want)


@pytest.mark.parametrize("encoding", [T.Q4_0, T.Q4_K])
def test_int4_repack_is_lossless(encoding):
    """The kernel's own weights, (q - 8) scale + zero', equal the reference dequantisation (fp32; Q4_K's zero' is
    one rounded fp32 product-difference, equal on these blocks), and its matmul equals the dequantised matmul
    up to the kernel's summation order."""
    raw = packed(encoding, seed=1)
    want = torch.from_numpy(reference(raw, encoding)).reshape(ROWS, COLS)
    data = torch.from_numpy(raw.reshape(-1).copy())
    w = int4_dequantized(data, encoding, (ROWS, COLS))
    assert (w - want).abs().max() <= 1e-6 * want.abs().max()
    x = torch.randn(7, COLS, generator=torch.Generator().manual_seed(0))
    y, y_ref = repack_int4(data, encoding, (ROWS, COLS))(x), x @ want.T
    assert y.shape == (7, ROWS)
    assert (y - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
