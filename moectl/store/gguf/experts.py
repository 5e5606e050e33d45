"""Where each routed expert's packed bytes are in a GGUF model, and how big they are (torch-free).

Legend: L = MoE layers, E = experts, I = expert intermediate size, H = hidden size.

llama.cpp's converter stacks a layer's experts: `blk.N.ffn_{gate,up}_exps.weight` [E, I, H] and
`blk.N.ffn_down_exps.weight` [E, H, I] (torch order; rows of blocks along the last axis), so expert e is the
contiguous byte range e * nbytes/E of each; older files store one `blk.N.ffn_{gate,up,down}.E.weight` per expert.
GPT-OSS adds `blk.N.ffn_{gate,up,down}_exps.bias` [E, I] / [E, H] (F32). Either way an expert is 3 (or 6) byte
ranges, read in place: `ExpertIndex.parts(layer, e)`. MoE layers are those with a router (`ffn_gate_inp`);
DeepSeek's leading dense layers have none.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ...errors import MoectlError
from ...tables import plural
from ...formats.gguf_encodings import bits_per_weight, encoding_name
from .files import ROW_CHUNKED, GgufFiles

PROJS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertTensor:
    """One expert's one projection (or bias): `nbytes` at `offset` of `file`, `shape` [out, in] (or [out])."""

    file: Path
    offset: int
    nbytes: int
    encoding: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return _numel(self.shape)


class ExpertIndex:
    """(layer, expert) -> its packed parts, for every MoE layer of a GGUF model."""

    def __init__(self, files: GgufFiles):
        self.files = files
        self.num_experts = int(files.get("{arch}.expert_count", required=True))
        blocks = int(files.get("{arch}.block_count", required=True))
        self.layers = [l for l in range(blocks) if f"blk.{l}.ffn_gate_inp.weight" in files]
        if not self.layers:
            raise MoectlError(f"{files.paths[0]} has no MoE layers (no blk.N.ffn_gate_inp.weight tensor)")
        self._parts = {l: self._layer(l) for l in self.layers}    # layer -> [(name, [ExpertTensor] * E)]

    def _layer(self, layer: int) -> list[tuple[str, list[ExpertTensor]]]:
        E, out = self.num_experts, []
        for proj in PROJS:
            stacked = f"blk.{layer}.ffn_{proj}_exps.weight"
            if stacked in self.files:
                out.append((proj, self._split(stacked)))
                continue
            names = [f"blk.{layer}.ffn_{proj}.{e}.weight" for e in range(E)]
            missing = [n for n in names if n not in self.files]
            if missing:
                raise MoectlError(f"{self.files.paths[0]}: layer {layer} has a router but no {proj} experts "
                                  f"({stacked}, or {missing[0]} ...)")
            per_expert = [self._whole(self.files.tensors[n]) for n in names]
            odd = next((e for e, t in enumerate(per_expert) if (t.encoding, t.shape) != (per_expert[0].encoding,
                                                                                         per_expert[0].shape)), None)
            if odd is not None:                     # one format per layer: its experts must be stored alike
                raise MoectlError(f"{self.files.paths[0]}: {names[odd]} is {encoding_name(per_expert[odd].encoding)} "
                                  f"{list(per_expert[odd].shape)}, {names[0]} is "
                                  f"{encoding_name(per_expert[0].encoding)} {list(per_expert[0].shape)}: moectl "
                                  f"needs a layer's experts stored alike")
            out.append((proj, per_expert))
        for proj in PROJS:
            bias = f"blk.{layer}.ffn_{proj}_exps.bias"
            if bias in self.files:
                out.append((f"{proj}_bias", self._split(bias)))
        return out

    def _split(self, name: str) -> list[ExpertTensor]:
        t = self.files.tensors[name]
        if t.shape[0] != self.num_experts:
            raise MoectlError(f"{t.file}: tensor {name} stacks {t.shape[0]} experts, the metadata says "
                              f"{self.num_experts} ({self.files.arch}.expert_count)")
        per = t.nbytes // self.num_experts
        return [ExpertTensor(t.file, t.offset + e * per, per, t.encoding, t.shape[1:]) for e in range(t.shape[0])]

    @staticmethod
    def _whole(t) -> ExpertTensor:
        return ExpertTensor(t.file, t.offset, t.nbytes, t.encoding, t.shape)

    def parts(self, layer: int, expert: int) -> list[tuple[str, ExpertTensor]]:
        """[(name, ExpertTensor)] of one expert: gate, up, down, then any biases."""
        return [(name, per_expert[expert]) for name, per_expert in self._parts[layer]]

    def expert_nbytes(self, layer: int) -> int:
        """Packed bytes of one expert of `layer` (experts of a layer share encodings and shapes)."""
        return sum(t.nbytes for _, t in self.parts(layer, 0))

    def slot_nbytes(self) -> int:
        """Bytes of the buffer that holds any expert of any layer: each part as large as the largest layer's
        (moectl/formats/gguf.py), what a RAM-tier row and a cache slot hold."""
        most: dict[str, int] = {}
        for layer in self.layers:
            for name, t in self.parts(layer, 0):
                most[name] = max(most.get(name, 0), t.nbytes)
        return sum(most.values())

    def sizes(self, mapped: frozenset = frozenset()) -> dict:
        """What `inspect` shows, from the header alone: bits per weight over all expert matrices, bytes per expert
        (the largest layer's: a slot must hold any), all experts' bytes, and the encodings' share of them.
        `mapped`: dense tensors (GGUF names) computed where they lie (`dense_in_place`): their packed bytes are
        `dense_mapped_bytes`, and they are never dequantised (not the largest step of a load)."""
        total_bytes = weights = 0
        by_encoding: Counter = Counter()
        for layer in self.layers:
            for name, t in self.parts(layer, 0):
                total_bytes += t.nbytes * self.num_experts
                if not name.endswith("_bias"):
                    weights += t.numel * self.num_experts
                    by_encoding[t.encoding] += t.nbytes * self.num_experts
        dense = [t for n, t in self.files.tensors.items() if not _is_expert(n)]
        read = [t for t in dense if t.name not in mapped]                      # dequantised at load
        largest = max((t for t in read if t.name not in ROW_CHUNKED), key=lambda t: _numel(t.shape), default=None)
        return {"bits_per_weight": 8 * total_bytes / weights,
                "weights_per_expert": max(sum(t.numel for name, t in self.parts(layer, 0) if not name.endswith("_bias"))
                                          for layer in self.layers),
                "row_chunked_weights": max((_numel(t.shape) for t in read if t.name in ROW_CHUNKED), default=0),
                "largest_dense": {"name": largest.name, "packed_bytes": largest.nbytes,
                                  "weights": _numel(largest.shape)} if largest is not None else None,
                "bytes_per_expert": max(self.expert_nbytes(l) for l in self.layers),
                "expert_bytes": total_bytes, "moe_layers": len(self.layers), "experts": self.num_experts,
                "encodings": {encoding_name(c): b for c, b in sorted(by_encoding.items())},
                "encoding_bits": {encoding_name(c): bits_per_weight(c) for c in sorted(by_encoding)},
                "dense_packed_bytes": sum(t.nbytes for t in dense),
                "dense_weights": sum(_numel(t.shape) for t in dense),
                "dense_mapped_bytes": sum(t.nbytes for t in dense if t.name in mapped),
                "dense_mapped_weights": sum(_numel(t.shape) for t in dense if t.name in mapped)}


def ggml_experts_note(encodings, threads: int) -> str:
    """The load's note where ggml computes a GGUF's experts in place (`cpu.py: map_for_ggml`, and the torch-free run)."""
    return (f"gguf: experts computed by ggml's CPU backend where they lie in the mapped file ({', '.join(encodings)}; "
            f"x quantized per block as llama.cpp does, {plural(threads, 'thread')})")


def held_dense_bytes(sizes: dict, itemsize: int, in_place: bool = True) -> int:
    """Bytes of the dense tensors as a run holds them, from `ExpertIndex.sizes(mapped)`: dequantised at `itemsize`
    bytes a weight, but the mapped ones at their bytes in the file (`in_place` False: every one dequantised, as
    the sizing counts them before anything is mapped)."""
    if not in_place:
        return sizes["dense_weights"] * itemsize
    return (sizes["dense_weights"] - sizes["dense_mapped_weights"]) * itemsize + sizes["dense_mapped_bytes"]


def dense_in_place_names(files: GgufFiles) -> frozenset:
    """The GGUF names `dense.py: dense_in_place` maps, from the header alone (no model to ask), for the families whose converter
    only reorders a dense matrix's rows (the one-graph families, runtime/ggml_model.py: Mixtral as `llama`,
    Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS): every 2-D non-expert tensor but the routers (Qwen2-MoE's shared
    expert's gate, ffn_gate_inp_shexp, is one). For the lean load (runtime/load.py), which
    builds no model; tests/test_lean_load.py checks it equals `dense_in_place`'s names on each family."""
    return frozenset(n for n, t in files.tensors.items()
                     if len(t.shape) == 2 and not _is_expert(n) and "ffn_gate_inp" not in n)


def _is_expert(name: str) -> bool:
    """A routed expert's tensor (stacked or per expert), not a shared expert's (`_shexp`) or the router."""
    return "_exps." in name or any(f".ffn_{p}." in name and name.split(".")[-2].isdigit() for p in PROJS)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def decode_read_bytes(files: GgufFiles) -> dict:
    """Bytes one decode token reads of the weights, from the header alone, at the file's own encodings (gguf's
    block sizes: `TensorEntry.nbytes`): every dense tensor whole (attention, routers, norms, biases, a shared expert,
    a dense layer's FFN), the lm_head whole (`output.weight`, or the embedding matrix where the file ties them),
    one row of the embedding (a token looks up one row, not the matrix), and per MoE layer the top-k experts'
    matrices (and biases), k from `{arch}.expert_used_count`. Not counted: the KV cache (it grows with the context;
    a few hundred KB at the benchmark's 16-48 positions) and activations. A token of a memory-bound decode can take
    no less than these bytes / the bandwidth the cores stream at (bench/gguf_vs_llamacpp.py, docs/gguf.md stop 54).
    {"total", "experts", "lm_head", "embedding_row", "dense" (the rest), "top_k", "experts_per_layer"}."""
    index = ExpertIndex(files)
    top_k = int(files.get("{arch}.expert_used_count", required=True))
    embd = files.entry("token_embd.weight")                 # [V, H], torch order: one row per token
    lm_head = files.tensors.get("output.weight", embd)
    row = embd.nbytes // embd.shape[0]
    dense = sum(t.nbytes for n, t in files.tensors.items()
                if not _is_expert(n) and n not in ("token_embd.weight", "output.weight"))
    experts = sum(top_k * index.expert_nbytes(layer) for layer in index.layers)
    return {"total": dense + lm_head.nbytes + row + experts, "experts": experts, "lm_head": lm_head.nbytes,
            "embedding_row": row, "dense": dense, "top_k": top_k, "experts_per_layer": index.num_experts}
