"""The dense model's Linears on the CPU: torch's one-row GEMV (lossless), or low-bit with `--dense-lowbit` (lossy).

Legend: N = output rows of a matrix, K = its input columns.

1. GEMV. transformers' `nn.Linear` sends a one-row bf16 product to oneDNN, half the speed of torch's native GEMV
   (`kernels/gemv.py`, same output bits), and the dense weights a decode token reads are not small: on the Mixtral
   shape x 2 layers the attention projections and the lm_head are 430 MB of the 1.84 GB a bf16 token reads. On a
   CPU every dense `nn.Linear` becomes a `GemvLinear` (the same module, class swapped: parameters, state dict and
   tied weights unchanged) whose forward takes `gemv.linear` for one row and `F.linear` otherwise.
2. `--dense-lowbit q8`. llama.cpp's Q4_0 / Q8_0 files quantize every weight (560 MB per q4 token on that shape
   against moectl's 827 with bf16 attention and lm_head). With this option the attention projections
   (`*.self_attn.*`) and the lm_head are quantized once at load and multiplied low-bit; embedding table, norms,
   routers stay. Where moectl's CPU kernels run (`moectl/kernels`: AVX-512 VNNI + BF16) they become q8g64
   round-to-nearest (`formats/vnni.quantize_rtn`, what `moectl quantize --method rtn` makes of experts) through the
   int8-activation kernel (`VnniDenseLinear`). Elsewhere (AVX2-only CPUs, most desktop Intel ones) they become
   ggml's Q8_0 blocks (`GgmlDenseLinear`: ggml's own quantizer, as llama-quantize without an imatrix, and its
   `mul_mat`, llama.cpp's kernel for this CPU; also where moectl's kernels run but the experts are ggml blocks, a
   GGUF's or `quantize --format ggml-q4_0` copies, so that one ggml graph computes the forward), or, where ggml
   cannot be built either, int8 symmetric per output
   row (`quant/int8_cpu.requantize`: every weight within half a step) for torch's int8 kernel
   (`Int8DenseLinear`). Lossy: the engine's `lossy()` names it. CPU and bf16 only.
3. `--dense-lowbit q4`: the mix of llama.cpp's Q4_0 files (attention Q4_0, output tensor Q6_K): through moectl's
   kernels the attention projections q4g64 and the lm_head q6g64 (its error reaches every logit directly); through
   ggml the attention Q4_0 and the lm_head Q6_K, llama.cpp's own (a Q6_K row is whole blocks of 256: a narrower
   lm_head is Q8_0, llama-quantize's fallback too). Needs one of the two. The lm_head is most of a 2-layer
   token's dense bytes (Mixtral's 32000 x 4096: 139 MB at q8g64, 107 at q6g64; Qwen3's 151936 x 2048: 330 and 253).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..errors import MoectlError
from ..formats.gguf_encodings import T, encoding_name
from ..kernels import gemv, ggml
from .dense_gguf import GgufLinear

DENSE_LOWBIT = ("q8", "q4")


class GemvLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        y = gemv.linear(x, self.weight)                                            # one row: torch's GEMV
        return y if self.bias is None else y + self.bias


class Int8DenseLinear(nn.Module):
    """An nn.Linear's product from int8 codes [N, K] and a bf16 scale per row (+ its bias)."""

    def __init__(self, linear: nn.Linear):
        from ..formats.int8_cpu import requantize

        super().__init__()
        codes, scale = requantize(linear.weight.detach())
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..formats.int8_cpu import Int8Linear

        y = Int8Linear(self.codes, self.scale)(x)
        return y if self.bias is None else y + self.bias


class VnniDenseLinear(nn.Module):
    """An nn.Linear's product from q4g64 / q8g64 codes in moectl's kernel layout (+ its bias)."""

    def __init__(self, linear: nn.Linear, bits: int):
        from ..formats.vnni import quantize_rtn

        super().__init__()
        codes, sm = quantize_rtn(linear.weight.detach(), bits=bits)
        self.register_buffer("codes", codes)
        self.register_buffer("sm", sm)
        self.bias, self.bits = linear.bias, bits
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..formats.vnni import VnniLinear

        y = VnniLinear(self.codes, self.sm, self.out_features)(x)
        return y if self.bias is None else y + self.bias


class GgmlDenseLinear(GgufLinear):
    """An nn.Linear quantized once at load into ggml blocks of `encoding` (ggml's own quantizer: round to nearest
    per block, as llama-quantize without an importance matrix) and multiplied by ggml's `mul_mat` (x quantized per
    block as llama.cpp does). The blocks are a host copy the module owns, not a mapped file; the bias stays, the bf16
    weight does not (`cpu_linears` drops the Linear it replaces)."""

    def __init__(self, linear: nn.Linear, encoding: int, name: str):
        blocks = ggml.quantize(encoding, linear.weight)           # uint8 [N, row bytes]; fp32 a chunk of rows at a time
        super().__init__(linear, encoding, blocks, None, name)

    @property
    def encoding(self) -> int:
        return self.matrix.encoding

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{encoding_name(self.encoding)} (ggml), bias={self.bias is not None}")


def ggml_encoding(kind: str, lm_head: bool, in_features: int) -> int | None:
    """The ggml block type `--dense-lowbit kind` gives a matrix of `in_features` columns (attention, or the lm_head),
    or None where its rows are not whole blocks: llama.cpp's Q8_0 file mix for q8, its Q4_0 mix for q4 (attention
    Q4_0, output Q6_K; Q6_K's 256-wide blocks fall back to Q8_0 as in llama-quantize)."""
    if kind == "q4" and lm_head and in_features % 256 == 0:
        return int(T.Q6_K)
    if in_features % 32:
        return None
    return int(T.Q4_0) if kind == "q4" and not lm_head else int(T.Q8_0)


def check_dense_lowbit(kind: str | None, device: torch.device, dtype: torch.dtype) -> None:
    if kind is None:
        return
    if kind not in DENSE_LOWBIT:
        raise MoectlError(f"--dense-lowbit {kind!r}: choose {' or '.join(DENSE_LOWBIT)}")
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise MoectlError(f"--dense-lowbit {kind} runs on the CPU with bf16 weights (its CPU kernels); this run "
                          f"is {device.type}, {str(dtype).removeprefix('torch.')}: use --device cpu --dtype bfloat16")
    if kind == "q4" and kernels.library() is None and ggml.library() is None:
        raise MoectlError(f"--dense-lowbit q4 needs moectl's CPU kernels or ggml's CPU backend, and neither runs "
                          f"here: {kernels.why_not()}; {ggml.why_not()} (--dense-lowbit q8 runs on torch's int8 "
                          "kernel)")


def _lowbit_linear(kind: str, name: str, lin: nn.Linear, ggml_first: bool = False) -> nn.Module | None:
    """The low-bit module replacing `lin` under `--dense-lowbit kind`, or None where it stays (GEMV). `ggml_first`:
    ggml's blocks even where moectl's kernels run (the experts are ggml's, see `cpu_linears`)."""
    attention, head = ".self_attn." in f".{name}", name.split(".")[-1] == "lm_head"
    if not (attention or head):
        return None
    encoding = ggml_encoding(kind, head, lin.in_features)
    by_ggml = encoding is not None and ggml.library() is not None
    if not (ggml_first and by_ggml) and kernels.library() is not None and lin.in_features % 64 == 0:
        return VnniDenseLinear(lin, 8 if kind == "q8" else 4 if attention else 6)
    if by_ggml:
        return GgmlDenseLinear(lin, encoding, name)
    return Int8DenseLinear(lin) if lin.in_features % 16 == 0 else None


def cpu_linears(model: nn.Module, dense_lowbit: str | None = None, ggml_first: bool = False) -> dict:
    """Swap the model's Linears in place (see the module's docstring); {"gemv", "int8", "q8", "q6", "q4", "Q8_0",
    "Q6_K", "Q4_0", "bytes_before", "bytes_after"}: how many of each (int8: torch's per-row kernel; q8 / q6 / q4:
    moectl's; Q8_0 / Q6_K / Q4_0: ggml's), and the low-bit matrices' weight bytes before and after.
    `ggml_first`: the experts are ggml blocks (a GGUF's, or `quantize --format ggml-q4_0` copies), so the low-bit
    dense matrices are ggml's too, where moectl's VNNI kernels run as well: one graph then computes the whole forward
    (runtime/ggml_model.py reads no VnniDenseLinear), one kernel family for the CPU."""
    out = {"gemv": 0, "int8": 0, "q8": 0, "q6": 0, "q4": 0, "Q8_0": 0, "Q6_K": 0, "Q4_0": 0, "bytes_before": 0,
           "bytes_after": 0}
    # by name, one module at a time: a replaced Linear's bf16 weight (unless tied to the embedding) is freed before
    # the next is quantized, so the load holds one matrix twice at a time, not every one (the caller then trims the
    # heap: runtime/load.py)
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lin = getattr(owner, leaf)
        q = _lowbit_linear(dense_lowbit, name, lin, ggml_first) if dense_lowbit else None
        if q is None:
            lin.__class__ = GemvLinear
            out["gemv"] += 1
            continue
        setattr(owner, leaf, q)
        out[f"q{q.bits}" if isinstance(q, VnniDenseLinear) else
            encoding_name(q.encoding) if isinstance(q, GgmlDenseLinear) else "int8"] += 1
        out["bytes_before"] += lin.weight.numel() * lin.weight.element_size()
        out["bytes_after"] += sum(b.numel() * b.element_size() for b in q.buffers())
        lin.weight = None                  # whatever else holds the Linear (a hook, a list) does not keep its weight
        del lin, q
    return out
