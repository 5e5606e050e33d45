"""Dequantise GGUF bytes in torch, on whatever device they are on.

Legend: N = packed bytes, Q = weights per block.

Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: transformers' torch port of ggml's dequantisation
(`transformers.integrations.gguf.dequant.dequantize`), F32/F16/BF16: views (widened to fp32), Q5_0 / Q5_1
(llama-quantize's fallback for Q4_K / Q5_K rows that are not whole 256-weight blocks, e.g. a 1408-wide
down_proj; transformers lacks them) as gguf's `Q5_0/Q5_1.dequantize_blocks`, and MXFP4 (which transformers lacks):
here, as ggml's `dequantize_row_mxfp4` / gguf's `MXFP4.dequantize_blocks`. Every one equals
`gguf.quants.dequantize` bit for bit in fp32 (tests/test_gguf_dequant.py); the result is then cast to `dtype`.
"""

from __future__ import annotations

import functools

import torch

from .gguf_encodings import TORCH_DEQUANT, T, block, check_supported

# MXFP4's 16 code points, doubled (e2m1 x 2), as ggml's kvalues_mxfp4; the block scale is halved to match
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_VIEWS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def dequantize_mxfp4(data: torch.Tensor) -> torch.Tensor:
    """uint8 [N] of 17-byte blocks (e8m0 exponent, 16 bytes of nibbles: low nibbles are weights 0-15, high
    nibbles 16-31) -> fp32 [N/17*32]."""
    blocks = data.view(-1, 17)
    e = blocks[:, :1].to(torch.int32)
    half_scale = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)   # 2^(e-127) / 2
    pairs = _byte_pairs(data.device)[blocks[:, 1:].long()]                                # [nb, 16, 2]: lo, hi
    return (half_scale[:, :, None] * pairs.transpose(1, 2)).reshape(-1)                    # lo x16, then hi x16


@functools.lru_cache(maxsize=None)
def _byte_pairs(device: torch.device) -> torch.Tensor:
    """[256, 2]: the two code values (low nibble, high nibble) of each byte: one gather per byte, not per nibble."""
    values = torch.tensor(_MXFP4_VALUES, dtype=torch.float32)
    b = torch.arange(256)
    return torch.stack([values[b & 15], values[b >> 4]], dim=1).to(device)


def dequantize_q5(data: torch.Tensor, affine: bool) -> torch.Tensor:
    """uint8 [N] of Q5_0 blocks (22 bytes: fp16 d, 32 high bits, 16 bytes of low nibbles: weight j's low nibble
    is byte j's low half for j < 16, byte j-16's high half after) -> (q - 16) d; Q5_1 (24 bytes: fp16 d, fp16 m, then
    the same) -> q d + m."""
    head = 4 if affine else 2
    blocks = data.view(-1, head + 20)
    d = blocks[:, :2].contiguous().view(torch.float16).float()                          # [nb, 1]
    qh = blocks[:, head:head + 4].contiguous().view(torch.int32)                         # [nb, 1]: 32 high bits
    high = (qh >> torch.arange(32, dtype=torch.int32, device=data.device)) & 1           # [nb, 32]
    qs = blocks[:, head + 4:].to(torch.int32)                                            # [nb, 16]
    low = torch.cat([qs & 15, qs >> 4], dim=1)                                           # [nb, 32]
    q = (low | (high << 4)).float()
    if not affine:
        return (d * (q - 16)).reshape(-1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(-1)


def dequantize(data: torch.Tensor, encoding: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
               where: str = "a GGUF tensor") -> torch.Tensor:
    """The tensor of `shape` encoded in the uint8 bytes `data` [N], as `dtype` (computed in fp32)."""
    code = check_supported(encoding, where)
    if data.storage_offset() % 4:                   # typed views need an aligned start (a copy, rarely)
        data = data.clone()
    if code in _VIEWS:
        out = data.view(_VIEWS[code]).float()
    elif code == T.MXFP4:
        out = dequantize_mxfp4(data)
    elif code in (T.Q5_0, T.Q5_1):
        out = dequantize_q5(data, code == T.Q5_1)
    elif code in TORCH_DEQUANT:
        from transformers.integrations.gguf.dequant import dequantize as blocks_to_values

        out = blocks_to_values(data, int(code))
    else:                           # K/I-quants ggml computes in place: gguf's reference, on the host (dense: once)
        from gguf import quants

        values = quants.dequantize(data.cpu().numpy(), code)
        out = torch.from_numpy(values.astype("float32", copy=False).reshape(-1)).to(data.device)
    q, b = block(code)
    if data.numel() * q != b * _numel(shape):
        raise ValueError(f"{where}: {data.numel()} bytes of {code.name} are not a tensor of shape {list(shape)}")
    return out.view(shape).to(dtype)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
