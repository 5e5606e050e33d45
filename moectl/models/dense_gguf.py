"""A GGUF's dense Linears and token embedding computed where they lie in the mapped file, as llama.cpp does.

Legend: T = tokens, N = output rows of a matrix, K = its input columns, V = vocabulary, H = hidden size.

Dequantised once (the path before this), a GGUF's dense part cost moectl most of its gap to llama.cpp on the same
file: a Qwen3-shaped file's lm_head (151936 x 2048) alone is 1.24 GB of fp32 read every token (Q6_K in the file:
255 MB), its embedding table as much again held in RSS, and every dense tensor dequantised before the first token.
Here, in place on the CPU where ggml runs (moectl/kernels/ggml.py):
- `GgufLinear` replaces an nn.Linear: y = x W^T by ggml's `mul_mat` on the file's own blocks (x quantized per
  block as llama.cpp quantizes it), then the rows transformers' converter reorders (the `llama` architecture's
  Q/K permutation) taken in its order (`perm`), then the bias (a torch parameter, loaded as before). Under autograd
  (`moectl sensitivity`) its backward multiplies by the dequantised matrix, a chunk of rows at a time.
- `GgufEmbedding` replaces the input embedding: the rows of the tokens asked for, dequantised per call (a row is
  whole blocks of its encoding).
Both hold a view of the memory map (the page cache holds the bytes, as llama.cpp's mmap) and nothing else.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..formats.gguf_dequant import dequantize
from ..kernels.ggml import GgmlLinear, register_stable

_ROWS_AT_ONCE = 1 << 22                 # weights dequantised at a time in a backward: 16 MB of fp32


class _MappedMatrix:
    """W [N, K] in GGUF `encoding` at a view `data` (uint8 [N, row bytes]) of the mapped file."""

    def __init__(self, encoding: int, data: np.ndarray, shape: tuple[int, int], name: str):
        self.encoding, self.data, self.shape, self.name = int(encoding), data, tuple(shape), name

    def rows(self, index: np.ndarray) -> torch.Tensor:
        """fp32 [n, K]: the rows `index` dequantised."""
        raw = torch.from_numpy(np.ascontiguousarray(self.data[index]).reshape(-1))
        return dequantize(raw, self.encoding, (len(index), self.shape[1]), torch.float32, self.name)


class _MulMat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, lin: "GgufLinear") -> torch.Tensor:        # x [T, K] fp32 -> [T, N]
        ctx.lin = lin
        return lin.kernel(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):                                          # [T, N] -> [T, K]
        m = ctx.lin.matrix                    # the file's row order (`perm` is applied outside, by autograd)
        grad = grad.float()
        N, K = m.shape
        out = torch.zeros(grad.shape[0], K)
        step = max(1, _ROWS_AT_ONCE // K)
        for r0 in range(0, N, step):
            rows = np.arange(r0, min(N, r0 + step))
            out += grad[:, r0:r0 + len(rows)] @ m.rows(rows)
        return out, None


class GgufLinear(nn.Module):
    """An nn.Linear whose matrix stays in the mapped GGUF file; the bias (if any) is a parameter as before."""

    def __init__(self, linear: nn.Linear, encoding: int, data: np.ndarray, perm: torch.Tensor | None, name: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.matrix = _MappedMatrix(encoding, data, (self.out_features, self.in_features), name)
        self.kernel = GgmlLinear([(self.matrix.encoding, data.ctypes.data, self.matrix.shape)], keep=data)
        register_stable(data)          # the mapped file: ggml may repack the matrix on first use (CPU_REPACK)
        self.perm = perm                                                  # [N] long, or None (rows in file order)
        self.bias = linear.bias
        # the file bytes it reads, for sizing (`store/facts.py: dense_nbytes` counts buffers): not in the state dict
        self.register_buffer("mapped", torch.from_numpy(data.reshape(-1)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        xf = x.reshape(-1, self.in_features).float()
        y = _MulMat.apply(xf, self) if torch.is_grad_enabled() and x.requires_grad else self.kernel(xf)
        if self.perm is not None:
            y = y[:, self.perm]
        y = y.to(dtype).reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        from ..formats.gguf_encodings import encoding_name

        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{encoding_name(self.matrix.encoding)} in the mapped file, bias={self.bias is not None}")


class GgufEmbedding(nn.Module):
    """An nn.Embedding whose table [V, H] stays in the mapped GGUF file: each call dequantises the rows it needs."""

    def __init__(self, embedding: nn.Embedding, encoding: int, data: np.ndarray, dtype: torch.dtype, name: str):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.matrix = _MappedMatrix(encoding, data, (self.num_embeddings, self.embedding_dim), name)
        self.dtype = dtype
        self.register_buffer("mapped", torch.from_numpy(data.reshape(-1)), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:                     # [..., T] -> [..., T, H]
        flat = ids.reshape(-1).cpu().numpy()
        uniq, back = np.unique(flat, return_inverse=True)                    # a prompt repeats tokens
        rows = self.matrix.rows(uniq)[torch.from_numpy(back.reshape(-1))]
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def extra_repr(self) -> str:
        from ..formats.gguf_encodings import encoding_name

        return f"{self.num_embeddings}, {self.embedding_dim}, {encoding_name(self.matrix.encoding)} in the mapped file"


def swap_in(model: nn.Module, mapped: dict[str, tuple], dtype: torch.dtype) -> list[str]:
    """Replace the modules whose weights `mapped` names ({state-dict name of the weight: (encoding, data, perm,
    gguf name)}) by their in-place twins; returns the weight names replaced (the load does not read them)."""
    done, views = [], {}
    for weight_name, (encoding, data, perm, gguf_name) in mapped.items():
        path = weight_name.removesuffix(".weight")
        parent, _, leaf = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        old = getattr(owner, leaf)
        if isinstance(old, nn.Embedding):
            new = GgufEmbedding(old, encoding, data, dtype, gguf_name)
        elif isinstance(old, nn.Linear):
            new = GgufLinear(old, encoding, data, perm, gguf_name)
        else:
            continue
        # one buffer per table: an lm_head tied to the embedding shares it (`dense_nbytes` counts it once)
        new.mapped = views.setdefault(data.ctypes.data, new.mapped)
        setattr(owner, leaf, new)
        done.append(weight_name)
    return done
