"""A GGUF layer's experts computed by ggml's CPU backend where they lie (moectl/kernels/ggml.py).

Legend: E = experts per layer, I = expert intermediate size, H = hidden size.

In place on the CPU the experts are never read into moectl's buffers: `GgufMappedFormat`'s "packed expert" is its
index (one int64), the RAM tier of a layer is [E, 8] bytes of those indices, and `weights` returns `GgmlLinear`
callables whose addresses are the expert's matrices in the memory-mapped file (the page cache holds them, as
llama.cpp's mmap does): no repack pass before the first token, no copy, no dequantisation (ggml's own CPU repack
copies an expert's Q4_0 / Q4_K / IQ4_NL / MXFP4 matrices on its first use: the map is registered for it). GPT-OSS's experts get
`GgmlBiasedLinear`s: their F32 biases (ffn_*_exps.bias) added, and pointed at where they lie for the fused graph.
(`GgufExpertFormat.cpu_weights` gives the same callables over a host buffer holding the file's bytes: the CPU side
of a GPU run.)
"""

from __future__ import annotations

import torch

from ..kernels.ggml import expert_weights, oai_expert_weights, register_stable
from .expert import ExpertFormat, Part
from .gguf import GgufExpertFormat
from .gguf_dequant import dequantize
from .gguf_encodings import T

PROJS = ("gate", "up", "down")


class GgufMappedFormat(ExpertFormat):
    def __init__(self, src: GgufExpertFormat):
        self.src, self.layer = src, src.layer
        super().__init__(f"{src.name}-ggml", [Part("expert", (1,), torch.int64)])
        self._cache: dict[int, dict] = {}

    @property
    def precision_name(self) -> str:
        return self.src.name                # the file's encodings: ggml computes them as they lie

    @staticmethod
    def indices(num_experts: int) -> torch.Tensor:
        """A layer's 'RAM tier': uint8 [E, 8], row e holding e."""
        return torch.arange(num_experts, dtype=torch.int64).view(torch.uint8).view(num_experts, 8)

    def weights(self, views: dict[str, torch.Tensor]) -> dict:
        e = int(views["expert"][0])
        w = self._cache.get(e)
        if w is None:
            files, mats, arrays, keep, base = self.src.index.files, {}, {}, [], {}
            first = dict(self.src.index.parts(self.layer, 0))
            for name, t in self.src.index.parts(self.layer, e):
                arr = files.bytes_of(t.file, t.offset, t.nbytes)               # the mapped file: no copy
                register_stable(arr)       # ggml may repack its matrices on first use (llama.cpp's CPU_REPACK)
                keep.append(arr)
                mats[name] = (t.encoding, arr.ctypes.data, tuple(t.shape))
                arrays[name] = arr
                t0 = first[name]
                if t0.file == t.file and t.offset == t0.offset + e * t.nbytes:   # a row of a stacked ffn_*_exps
                    E = self.src.index.num_experts
                    whole = files.bytes_of(t0.file, t0.offset, t0.nbytes * E)
                    keep.append(whole)
                    base[name] = (whole.ctypes.data, E)
            stacked = (e, base) if set(base) >= {"gate", "up", "down"} else None
            if self.src.family == "gpt_oss":            # biases too: rows of ffn_*_exps.bias (F32 as llama.cpp writes)
                parts = dict(self.src.index.parts(self.layer, e))
                biases = {p: dequantize(torch.from_numpy(arrays[f"{p}_bias"].copy()), parts[f"{p}_bias"].encoding,
                                        parts[f"{p}_bias"].shape, torch.float32, f"layer {self.layer} {p} bias")
                          for p in PROJS}
                f32 = all(parts[f"{p}_bias"].encoding == T.F32 for p in PROJS)
                bias_stacked = ({p: base[f"{p}_bias"] for p in PROJS}
                                if f32 and set(base) >= {f"{p}_bias" for p in PROJS} else None)
                w = self._cache[e] = oai_expert_weights(mats, biases, keep, stacked, bias_stacked)
            else:
                w = self._cache[e] = expert_weights(mats, keep, stacked)
        return w

