"""GgufExpertFormat: one expert in its GGUF encoding as one packed buffer, dequantised where it is computed.

Legend: I = expert intermediate size, H = hidden size, N = bytes of one packed expert.

It is an `ExpertFormat` (moectl/formats/expert.py): parts are the expert's byte ranges in the file, in
`ExpertIndex.parts` order (gate, up, down, GPT-OSS biases), each uint8 and exactly the file's bytes, back to back,
so the RAM tier, a disk read (`ExpertStore` checks each range against its part) and a device slot all hold what
the file holds. `weights(views)` dequantises (moectl/formats/gguf_dequant.py) into the family's layout:
  standard families: gate_up [2I, H] = gate rows then up rows, down [H, I]          (the file's [out, in])
  GPT-OSS:           gate_up [H, 2I] with gate in the even columns, gate_up_bias [2I], down [I, H], down_bias [H]
One format per MoE layer (a Q4_K_M file mixes Q4_K and Q6_K layers, some layers' down_proj differ); every
layer's parts are padded to the largest layer's part of that name (`part_bytes`: a part's tail past the layer's
bytes is unused), so all layers' formats have the same parts, spans and `nbytes`: one slot size, and a buffer's
typed views (`views`) are the same whichever layer's expert it holds. Only `weights` is the layer's own (its
encodings): the store keeps a format per layer for that (`ExpertStore.format_of(precision, layer)`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..kernels import ggml
from .expert import ExpertFormat, Part
from .gguf_dequant import dequantize
from .gguf_encodings import encoding_name


class ExpertIndex(Protocol):
    """What a format reads of a GGUF file's expert index (the store's `store/gguf/experts.py: ExpertIndex`): its MoE
    layers, each expert's tensors (name, and an entry with `file`, `offset`, `nbytes`, `encoding`, `shape`), and the
    open files (`files.bytes_of(file, offset, nbytes)`)."""

    layers: list[int]
    files: object

    def parts(self, layer: int, expert: int) -> list[tuple[str, object]]: ...


class GgufExpertFormat(ExpertFormat):
    def __init__(self, index: ExpertIndex, layer: int, family: str, dtype: torch.dtype,
                 part_bytes: dict[str, int] | None = None):
        self.index, self.layer, self.family, self.dtype = index, layer, family, dtype
        self.tensors = index.parts(layer, 0)                                   # encodings and shapes of expert 0
        encodings = "+".join(dict.fromkeys(encoding_name(t.encoding) for _, t in self.tensors))
        part_bytes = part_bytes or {}
        super().__init__(f"gguf-{encodings}", [Part(name, (max(t.nbytes, part_bytes.get(name, 0)),), torch.uint8)
                                               for name, t in self.tensors])
        self.padded = any(p.numel != t.nbytes for p, (_, t) in zip(self.parts, self.tensors))

    def fill(self, expert: int, out: torch.Tensor) -> torch.Tensor:
        """Copy expert `expert`'s bytes from the memory-mapped file into `out` [N] (the RAM tier's row)."""
        views = self.views(out)
        for name, t in self.index.parts(self.layer, expert):
            views[name][:t.nbytes].copy_(torch.from_numpy(self.index.files.bytes_of(t.file, t.offset, t.nbytes)))
        return out

    def packed(self, expert: int) -> torch.Tensor:
        """A new buffer [N] holding expert `expert`."""
        return self.fill(expert, torch.zeros(self.nbytes, dtype=torch.uint8))

    def matrices(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{gate, up, down[, *_bias]} dequantised, in the file's orientation ([out, in])."""
        return {name: dequantize(views[name][:t.nbytes], t.encoding, t.shape, self.dtype,
                                 f"layer {self.layer} {name} experts")
                for name, t in self.tensors}

    device_kernels = False              # set at load: a GPU slot computed by the Triton kernels (runtime/load.py)

    def kernel_weights(self, views: dict[str, torch.Tensor]) -> dict | None:
        """{gate_up: GateUp, down: Matrix} reading the file's blocks in the slot (kernels/triton_lowbit.py), or None
        where the kernels do not take this layer (GPT-OSS's layout, an encoding they do not read)."""
        from ..kernels import triton_lowbit as tk

        specs = {name: tk.GGUF_TYPES.get(encoding_name(t.encoding)) for name, t in self.tensors}
        if (self.family == "gpt_oss" or set(specs) != {"gate", "up", "down"} or None in specs.values()
                or not tk.runs_on(views["gate"])):
            return None
        m = {name: tk.Matrix(tk.Spec(specs[name]), t.shape[0], t.shape[1], views[name][:t.nbytes])
             for name, t in self.tensors}
        return {"gate_up": tk.GateUp(m["gate"], m["up"]), "down": m["down"]}

    def weights(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device_kernels and (kernel := self.kernel_weights(views)) is not None:
            return kernel
        m = self.matrices(views)
        if self.family != "gpt_oss":
            return {"gate_up": torch.cat([m["gate"], m["up"]]), "down": m["down"]}
        gate_up = torch.stack([m["gate"], m["up"]], dim=1).flatten(0, 1)          # [2I, H]: gate, up interleaved
        bias = torch.stack([m["gate_bias"], m["up_bias"]], dim=1).flatten()         # [2I]
        return {"gate_up": gate_up.T, "gate_up_bias": bias, "down": m["down"].T, "down_bias": m["down_bias"]}

    def cpu_weights(self, views: dict[str, torch.Tensor]) -> dict:
        """The weights where the CPU computes an expert from its host copy (the CPU side of a GPU run): ggml's
        kernels on the buffer's GGUF bytes (moectl/kernels/ggml.py; GPT-OSS's with its biases added), or `weights`
        (dequantised) where ggml is not built."""
        if not ggml.planned() or ggml.library() is None:
            return self.weights(views)
        mats = {name: (t.encoding, views[name].data_ptr(), tuple(t.shape)) for name, t in self.tensors
                if not name.endswith("_bias")}
        if self.family == "gpt_oss":
            biases = {name.removesuffix("_bias"): dequantize(views[name][:t.nbytes], t.encoding, t.shape,
                                                             torch.float32, f"layer {self.layer} {name} experts")
                      for name, t in self.tensors if name.endswith("_bias")}
            return ggml.oai_expert_weights(mats, biases, views)
        return ggml.expert_weights(mats, views)

    def describe(self) -> dict:
        return super().describe() | {"layer": self.layer, "encodings": [encoding_name(t.encoding)
                                                                         for _, t in self.tensors]}


def layer_formats(index: ExpertIndex, family: str, dtype: torch.dtype) -> dict[int, GgufExpertFormat]:
    """One format per MoE layer, each part as large as the largest layer's: the same views for all layers."""
    part_bytes: dict[str, int] = {}
    for layer in index.layers:
        for name, t in index.parts(layer, 0):
            part_bytes[name] = max(part_bytes.get(name, 0), t.nbytes)
    return {l: GgufExpertFormat(index, l, family, dtype, part_bytes) for l in index.layers}
