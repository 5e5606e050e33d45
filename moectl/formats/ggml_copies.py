"""GgmlCopyFormat: moectl's own low-bit copy of an expert in ggml's blocks (`moectl quantize --format ggml-q4_0`).

Legend: I = expert intermediate size, H = hidden size, N = bytes of one packed expert.

Why: moectl's fast low-bit CPU kernels (VNNI, `formats/vnni.py`) need AVX-512 VNNI + BF16; on an AVX2-only CPU (most
desktop Intel ones) HQQ copies fall back to torch's int4 kernel. ggml's CPU backend (llama.cpp's own kernels,
runtime ISA dispatch: `kernels/ggml.py`) runs everywhere, so these copies are written in its blocks and computed by
it as llama.cpp computes a Q4_0 / Q8_0 / Q4_K file. The quantizer is ggml's own (`ggml.quantize`: round to
nearest per block, as llama-quantize without an importance matrix): Q4_0 is 32 weights sharing one fp16 scale
(4.5 bits a weight), Q8_0 the same at 8 bits (8.5), Q4_K 256-weight super-blocks of 8 sub-blocks with 6-bit
scales and mins (4.5).

It is a GGUF expert whose bytes are moectl's rather than a file's: the parts are gate [I, H], up [I, H] and down
[H, I] (the file's [out, in]) as uint8 rows of blocks, back to back, so `GgufExpertFormat` (formats/gguf.py) does
the rest: on a GPU its Triton kernels read the blocks in the slot (`device_kernels`, set at load), else torch
dequantises them; on the CPU `weights` gives ggml's callables over the host copy (`cpu_weights`), which know the
layer's [E, N] buffer as stacked experts N bytes apart: in place, a layer's routed experts are one mul_mat_id graph
(`kernels/ggml.py: experts_decode`, `experts_routed`), decode and prefill, as llama.cpp computes them. On a CPU run
that buffer is the shard mapped copy-on-write and registered (`store/lowbit.py`), so ggml's CPU_REPACK interleaves
those strided stacks on first use (Q4_0 and Q4_K on AVX2), as llama.cpp's loader does for its file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES

from ..errors import MoectlError
from ..kernels import ggml
from .gguf import GgufExpertFormat
from .gguf_encodings import T

# the names `--format` / `--lowbit` take -> their ggml block type (core/shapes.py: GGML_COPY_BITS prices them)
ENCODINGS = {"ggml-q4_0": T.Q4_0, "ggml-q8_0": T.Q8_0, "ggml-q4_k": T.Q4_K}
FORMAT_VERSION = 1                      # the layout above; a reader refuses another


def is_ggml_copy(name: str | None) -> bool:
    return name is not None and str(name).strip().lower() in ENCODINGS


@dataclass(frozen=True)
class _Matrix:
    """What `GgufExpertFormat` reads of a tensor entry: its encoding, [out, in] shape and bytes."""

    encoding: int
    shape: tuple[int, int]
    nbytes: int


class _LayoutIndex:
    """The `ExpertIndex` protocol over one expert layout: every expert's matrices have the same encoding and shape."""

    files = None

    def __init__(self, matrices: list[tuple[str, _Matrix]]):
        self.layers, self._matrices = [0], matrices

    def parts(self, layer: int, expert: int) -> list[tuple[str, _Matrix]]:
        return self._matrices


class GgmlCopyFormat(GgufExpertFormat):
    def __init__(self, layout, name: str, dtype: torch.dtype):
        name = str(name).strip().lower()
        if name not in ENCODINGS:
            raise MoectlError(f"--format {name!r}: choose hqq or one of {', '.join(ENCODINGS)}")
        if tuple(layout.names) != ("gate_up", "down"):
            raise MoectlError(f"{name} copies take experts of gate_up and down matrices; this family's are "
                              f"{', '.join(layout.names)} (GPT-OSS: use --format hqq)")
        encoding = ENCODINGS[name]
        block, block_bytes = GGML_QUANT_SIZES[encoding]
        (I2, H), (_, I) = layout.shapes
        if H % block or I % block:
            fits = [n for n, t in ENCODINGS.items() if H % GGML_QUANT_SIZES[t][0] == I % GGML_QUANT_SIZES[t][0] == 0]
            raise MoectlError(f"{name}: ggml's {encoding.name} rows are whole blocks of {block} weights, and this "
                              f"model's expert rows are {H} (hidden) and {I} (intermediate) wide: choose "
                              f"{' or '.join(fits + ['hqq'])}")
        mats = [(part, _Matrix(int(encoding), (N, K), N * K // block * block_bytes))
                for part, (N, K) in (("gate", (I2 // 2, H)), ("up", (I2 // 2, H)), ("down", (H, I)))]
        self.layout, self.encoding = layout, encoding
        super().__init__(_LayoutIndex(mats), 0, "ggml-copy", dtype)
        self.name = name

    def dequantized(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{gate_up [2I, H], down [H, I]} dequantised to the compute dtype (torch: on the buffer's device)."""
        m = self.matrices(views)
        return {"gate_up": torch.cat([m["gate"], m["up"]]), "down": m["down"]}

    def weights(self, views: dict[str, torch.Tensor]) -> dict:
        # device slots flagged for the Triton kernels (a GPU run: the CPU side takes `cpu_weights`) and a copy off
        # the CPU: the GGUF path (the kernels on the blocks, or torch's dequantisation); on the CPU ggml's kernels
        # on the copy's own blocks (dequantised only where ggml is not built)
        if self.device_kernels or views["gate"].device.type != "cpu" or not ggml.planned() or ggml.library() is None:
            return super().weights(views)
        return self.cpu_weights(views)

    def cpu_weights(self, views: dict[str, torch.Tensor]) -> dict:
        """ggml's {gate_up, down} callables over the copy's blocks; where the copy is a row of a layer's [E, N] buffer
        (the RAM tier, `store/lowbit.py`) they also know that buffer as stacked experts `N` bytes apart, so a layer's
        experts run as one mul_mat_id graph (`kernels/ggml.py: experts_decode`, `experts_routed`), as llama.cpp's."""
        if not ggml.planned() or ggml.library() is None:
            return super().weights(views)
        mats = {name: (int(self.encoding), views[name].data_ptr(), t.shape) for name, t in self.tensors}
        return ggml.expert_weights(mats, views, self._stacked(views))

    def _stacked(self, views: dict[str, torch.Tensor]) -> tuple[int, dict] | None:
        """(expert, {gate, up, down: (address in row 0, rows, bytes a row)}) when the copy is row e of a memory of
        rows of N bytes (its storage: a layer's [E, N] buffer), else None. Each address is row 0's plus e times N by
        construction, so whatever rows the storage holds, the ids the graph gets are rows this layer holds."""
        store = views["gate"].untyped_storage()
        rows = store.nbytes() // self.nbytes
        e, rest = divmod(views["gate"].data_ptr() - store.data_ptr() - self.spans["gate"][0], self.nbytes)
        if rest or not 0 <= e < rows or views["gate"].device.type != "cpu":
            return None
        return e, {name: (store.data_ptr() + self.spans[name][0], rows, self.nbytes) for name in ("gate", "up", "down")}

    def quantize(self, weights: dict[str, torch.Tensor], out: torch.Tensor | None = None, device: str = "cpu",
                 optimize: bool = False) -> torch.Tensor:
        """Pack ggml's quantization of `weights` (gate_up [2I, H], down [H, I]) into a uint8 buffer [N]. ggml's
        quantizer is round to nearest on the CPU: `device` and `optimize` (HQQ's) do not apply."""
        gate_up, down = weights["gate_up"].float().cpu(), weights["down"].float().cpu()
        I = gate_up.shape[0] // 2
        rows = {"gate": gate_up[:I], "up": gate_up[I:], "down": down}
        return self.pack({name: torch.from_numpy(ggml.quantize(int(self.encoding), w).reshape(-1))
                          for name, w in rows.items()}, out)

    def describe(self) -> dict:
        return super().describe() | {"name": self.name, "encoding": self.encoding.name,
                                     "ggml_format_version": FORMAT_VERSION}
