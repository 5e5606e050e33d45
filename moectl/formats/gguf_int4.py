"""GgufInt4Format: a layer's GGUF experts with their Q4_0 / Q4_K matrices repacked for the CPU int4 kernel.

Legend: I = expert intermediate size, H = hidden size, G = 32.

For the CPU in place (experts computed from host RAM): at load each expert's GGUF buffer is repacked once
(`repack`) into this format, which replaces it. `gate_up` is one kernel matrix [2I, H] when gate and up are both
Q4 (their codes and per-32 scales stacked row-wise: the same codes, nothing re-quantised); `down` too when it is
Q4. A Q6_K or Q8_0 matrix (Q4_K_M's down_proj in some layers, Q6_K and Q8_0 files) goes onto the same kernel as
two 4-bit code planes (`int4.py: PlanesLinear`, exact up to summation order); any other matrix keeps its GGUF
bytes and is dequantised per use. `weights` returns
`Int4Linear` callables for the repacked ones, which `FamilyAdapter.linear` applies (not GPT-OSS: its
expert_forward multiplies matrices directly). Scales in fp32 keep it lossless (moectl/formats/gguf_int4_repack.py); bf16 scales
are the fast path (docs/gguf.md: ~60x faster on this CPU) and round them as any bf16 weight is rounded.
"""

from __future__ import annotations

import torch

from .expert import ExpertFormat, Part
from .gguf import GgufExpertFormat
from .gguf_dequant import dequantize
from .gguf_encodings import T
from .gguf_int4_repack import GROUP, PLANES, PlanesLinear, int4_parts, pack_codes, plane_parts
from .int4_cpu import Int4Linear

Q4 = (T.Q4_0, T.Q4_K)


class GgufInt4Format(ExpertFormat):
    def __init__(self, src: GgufExpertFormat, scale_dtype: torch.dtype = torch.float32):
        if src.family == "gpt_oss":
            raise ValueError("GPT-OSS's expert_forward multiplies matrices; it takes no int4 callables")
        self.src, self.scale_dtype = src, scale_dtype
        t = dict(src.tensors)
        self.groups = {"gate_up": ("gate", "up"), "down": ("down",)}
        self.int4 = {m for m, names in self.groups.items() if all(t[n].encoding in Q4 for n in names)}
        self.planes = {m for m, names in self.groups.items()            # two 4-bit planes: all Q6_K, or all Q8_0
                    if len({t[n].encoding for n in names}) == 1 and t[names[0]].encoding in PLANES}
        parts = []
        for m, names in self.groups.items():
            N, K = sum(t[n].shape[0] for n in names), t[names[0]].shape[1]
            if m in self.int4:
                parts += [Part(f"{m}.int4", (N, K // 2), torch.uint8), Part(f"{m}.sz", (K // GROUP, N, 2), scale_dtype)]
            elif m in self.planes:
                B = PLANES[t[names[0]].encoding][0]
                parts += [Part(f"{m}.int4", (N, K), torch.uint8), Part(f"{m}.sz", (K // B, N, 2), scale_dtype)]
            else:
                parts += [Part(n, (t[n].nbytes,), torch.uint8) for n in names]
        super().__init__(f"{src.name}-int4", parts)

    def repack(self, src_buf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This format's buffer [N] from the GGUF buffer `src_buf` of the same expert."""
        views, tensors = self.src.views(src_buf), {}
        t = dict(self.src.tensors)
        for m, names in self.groups.items():
            if m not in self.int4 and m not in self.planes:
                tensors.update({n: views[n][:t[n].nbytes] for n in names})
                continue
            parts = (int4_parts if m in self.int4 else plane_parts)
            codes = [parts(views[n][:t[n].nbytes], t[n].encoding, t[n].shape, self.scale_dtype, pack=False)
                     for n in names]
            tensors[f"{m}.int4"] = pack_codes(torch.cat([q for q, _ in codes]))            # rows: gate, then up
            tensors[f"{m}.sz"] = torch.cat([sz for _, sz in codes], dim=1)                  # [K/G, N, 2]
        return self.pack(tensors, out)

    def weights(self, views: dict[str, torch.Tensor]) -> dict:
        t, out = dict(self.src.tensors), {}
        for m, names in self.groups.items():
            if m in self.int4:
                out[m] = Int4Linear(views[f"{m}.int4"], views[f"{m}.sz"], GROUP)
            elif m in self.planes:
                out[m] = PlanesLinear(views[f"{m}.int4"], views[f"{m}.sz"], t[names[0]].encoding)
            else:
                mats = [dequantize(views[n], t[n].encoding, t[n].shape, self.src.dtype) for n in names]
                out[m] = torch.cat(mats) if len(mats) > 1 else mats[0]
        return out
