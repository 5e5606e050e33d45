"""The GGUF tensor encodings moectl reads, and their sizes (torch-free: sizing and `inspect` use it).

Legend: Q = weights per block, B = bytes per block.

A GGUF tensor is rows of blocks along its last (input) axis: Q weights packed into B bytes. The sizes are the
`gguf` package's own table (`GGML_QUANT_SIZES`); this module only says which encodings moectl computes with
(`moectl/formats/gguf_dequant.py`) and turns an unsupported one into a clear error.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import MoectlError

T = GGMLQuantizationType
# The encodings llama.cpp users' MoE files hold (Q4_K_M = Q4_K + Q6_K, Q5_K_M = Q5_K + Q6_K, GPT-OSS = MXFP4).
SUPPORTED = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4,
             # computed by ggml's CPU backend (moectl/kernels/ggml.py), elsewhere dequantised by gguf's reference
             # (moectl/formats/gguf_dequant.py): the K- and I-quants of llama-quantize's mixes (Q2_K, Q3_K_M,
             # IQ4_XS, the dynamic IQ2/IQ3 quants). Not the ternary TQ1_0/TQ2_0: no MoE file uses them.
             T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)
# what moectl's torch dequantiser computes on any device; the rest through gguf's numpy reference on the host
TORCH_DEQUANT = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4)


def encoding_name(code: int) -> str:
    """'Q4_K' for 12; 'type 99' for a code the gguf package does not know."""
    try:
        return T(code).name
    except ValueError:
        return f"type {code}"


def check_supported(code: int, where: str) -> T:
    """The encoding, or a MoectlError naming it and `where` (a file and tensor)."""
    if code not in {int(t) for t in SUPPORTED}:
        raise MoectlError(f"{where} is encoded as {encoding_name(code)}, which moectl does not read; supported: "
                          f"{', '.join(t.name for t in SUPPORTED)}")
    return T(code)


def block(code: int) -> tuple[int, int]:
    """(Q weights, B bytes) of one block."""
    return GGML_QUANT_SIZES[T(code)]


def packed_nbytes(code: int, shape: tuple[int, ...], where: str = "a tensor") -> int:
    """Bytes of a tensor of `shape` (torch order, last axis = the blocked one) in this encoding."""
    q, b = block(code)
    if shape[-1] % q:
        raise MoectlError(f"{where}: rows of {shape[-1]} weights are not whole {encoding_name(code)} blocks of {q}")
    n = 1
    for s in shape:
        n *= s
    return n // q * b


def bits_per_weight(code: int) -> float:
    q, b = block(code)
    return 8 * b / q
