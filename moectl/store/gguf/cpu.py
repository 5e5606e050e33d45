"""A GGUF's experts on the CPU in place: computed by ggml where they lie in the mapped file (`map_for_ggml`), or,
where ggml is not built (`MOECTL_GGML=0`, no compiler), Q4_0 / Q4_K / Q6_K / Q8_0 matrices repacked once, at load,
for torch's int4 kernel (`repack_for_cpu`).

ggml (moectl/kernels/ggml.py): llama.cpp's own CPU kernels read every encoding in its blocks; nothing is read, copied
or repacked before the first token, the experts' pages are mapped (RSS grows as they are touched, as llama.cpp's).
GPT-OSS's experts too, with their F32 biases and its clamped SwiGLU (llama.cpp's swiglu_oai graph); only where
ggml is not built does GPT-OSS keep torch's path (dequantised per use: its expert_forward multiplies matrices).

Legend: L = MoE layers, E = experts per layer, N_l = bytes of one repacked expert of layer l.

In place (`--device cpu --offload ram`, `runtime/cache.py: InPlaceExperts`) experts are computed where they lie in host RAM.
A matrix dequantised per use costs tens of ms (docs/gguf.md); Q4_0 and Q4_K are affine per 32 weights, exactly
what `_weight_int4pack_mm_for_cpu` computes at group 32, so each expert is repacked once (`GgufInt4Format`: the
same 4-bit codes, per-32 scale and zero; Q6_K and Q8_0 as two 4-bit planes, `int4.py: PlanesLinear`) and the repacked buffer is the RAM tier's, not a copy beside it: the
experts are read from the file by positioned reads one at a time into one scratch buffer, repacked into their
layer's [E, N_l] buffer, and nothing else stays. Other matrices (Q5_K, MXFP4, Q4_1, Q5_0, ...) keep their GGUF bytes
in the same buffer and are dequantised per use. Scales in the run's dtype: fp32 is lossless, bf16
(`--dtype bf16`) the fast kernel, rounding the scales as any bf16 weight is rounded.
"""

from __future__ import annotations

import torch

from ...formats.gguf_encodings import T
from ...formats.gguf_int4 import GgufInt4Format
from ...kernels import ggml
from ...progress import ProgressBar
from ..memory import host_empty, release_freed
from .experts import ggml_experts_note


def ggml_in_place(adapter) -> bool:
    """Whether the CPU in place computes this GGUF's experts with ggml: ggml built or buildable here (no build is
    started: `inspect` asks this too). GPT-OSS's too: its biases and clamped SwiGLU are ggml's ops (mg_moe_oai)."""
    return adapter.gguf is not None and ggml.planned()


def dense_mapped(adapter, model) -> dict:
    """The dense matrices the CPU in place computes with ggml where they lie in the mapped file
    (`GgufModel.dense_in_place`, models/dense_gguf.py), or {} where ggml is not planned here (`inspect` asks
    this too: nothing is built)."""
    return adapter.gguf.dense_in_place(model) if adapter.gguf is not None and ggml.planned() else {}


def ggml_repacked_bytes(adapter, model=None, mapped: dict | None = None) -> dict:
    """The copies ggml's CPU repack makes in place (llama.cpp's CPU_REPACK, moectl/kernels/ggml_shim.c: of each
    mapped matrix on its first use, a stacked tensor's experts as they are first routed to; anonymous memory), from
    the header and the shim's own query (`ggml.repacks`: the encodings and shapes this CPU's ggml interleaves; AVX2:
    Q4_0, Q4_K, IQ4_NL, MXFP4 with rows a multiple of 8): {"experts": bytes of every expert matrix it repacks, all
    layers and experts (each once routed to), "dense": bytes of the `mapped` dense matrices (`dense_in_place`) a
    `GgufLinear` multiplies by (the embedding table only when a tied lm_head reads it; `model` says which module
    reads which), "total"}. A copy takes its matrix's bytes in the file (ggml sizes it at ggml_nbytes) and stands in
    for them: the file's pages of a repacked matrix are not read again (page cache the kernel reclaims), so the host
    figures that count the mapped bytes hold the same total, part of it now anonymous. All 0 where ggml is not in
    place, not built yet (nothing is built to answer), or `MOECTL_GGML_REPACK=0`."""
    out = {"experts": 0, "dense": 0, "total": 0}
    if not ggml_in_place(adapter):
        return out
    E = adapter.num_experts
    for f in adapter.formats(torch.float32).values():
        for _, t in f.tensors:
            if len(t.shape) == 2 and ggml.repacks(t.encoding, tuple(t.shape)):
                out["experts"] += E * t.nbytes
    modules = dict(model.named_modules()) if model is not None else {}
    seen = set()
    for key, (encoding, data, *_rest) in (mapped or {}).items():
        module = modules.get(key.removesuffix(".weight"))
        if not isinstance(module, torch.nn.Linear) or data.ctypes.data in seen:
            continue
        seen.add(data.ctypes.data)
        if ggml.repacks(encoding, (data.shape[0], module.in_features)):
            out["dense"] += data.nbytes
    out["total"] = out["experts"] + out["dense"]
    return out


def map_for_ggml(store) -> str:
    """The store's experts as ggml computes them in place: each layer's 'RAM tier' is its experts' indices, their
    matrices are the mapped file's (moectl/formats/gguf_ggml.py). Builds ggml on first use (minutes, said);
    returns the note said at load, or None when ggml could not be loaded (then the caller repacks)."""
    from ...formats.gguf_ggml import GgufMappedFormat

    if ggml.library() is None:
        return None
    store.formats = [GgufMappedFormat(f) for f in store.formats]
    store.buffers = [GgufMappedFormat.indices(store.num_experts) for _ in store.formats]
    encs = sorted({T(t.encoding).name for f in store.formats for _, t in f.src.tensors})
    return ggml_experts_note(encs, ggml.threads())


def int4_repackable(adapter) -> bool:
    """Whether some expert matrix of this GGUF model maps onto the int4 kernel (not GPT-OSS: its expert_forward
    multiplies matrices, it takes no kernel callables)."""
    g = adapter.gguf
    if g is None or adapter.family == "gpt_oss":
        return False
    return any(GgufInt4Format(f).int4 or GgufInt4Format(f).planes for f in adapter.formats(torch.float32).values())


def repack_for_cpu(store, dtype: torch.dtype, progress: bool = True) -> str:
    """The store's experts (read from the file: it was opened on the disk tier) as int4-kernel buffers in host RAM,
    one [E, N_l] per layer; `store.formats` become the repacked ones. Returns the note said at load."""
    fmts = [GgufInt4Format(f, dtype) for f in store.formats]
    scratch = torch.empty(store.expert_nbytes, dtype=torch.uint8)
    buffers = []
    with ProgressBar(progress, transient=True) as bar:
        task = bar.add("repacking experts for the CPU int4 kernel", store.num_layers * store.num_experts)
        for layer, fmt in enumerate(fmts):
            buf = host_empty((store.num_experts, fmt.nbytes), torch.uint8, "repacking experts into RAM", touch=True)
            for e in range(store.num_experts):
                store.load_into(layer, e, scratch)
                fmt.repack(scratch, buf[e])
                release_freed()                         # its unpacking temporaries leave the RSS (~us a call)
                bar.update(task, advance=1)
            buffers.append(buf)
    store.buffers, store.formats = buffers, fmts
    store.ckpt.close()
    mats = sorted({f"{m} ({'+'.join(dict.fromkeys(T(t.encoding).name for n, t in f.src.tensors if n in f.groups[m]))})"
                   for f in fmts for m in f.int4 | f.planes})
    exact = "lossless" if dtype == torch.float32 else f"scales rounded to {str(dtype).removeprefix('torch.')}"
    return (f"gguf: Q4_0/Q4_K/Q6_K/Q8_0 expert matrices repacked for the CPU int4 kernel ({', '.join(mats)}; "
            f"{str(dtype).removeprefix('torch.')} scales, {exact}); other encodings dequantised per use")


def in_place_expert_bytes(adapter, dtype: torch.dtype) -> int | None:
    """Bytes of all experts as the CPU in place holds them (repacked: `repack_for_cpu`), from the header alone;
    None when the packed GGUF bytes are held as they are (read into RAM, or mapped for ggml: the same bytes)."""
    if ggml_in_place(adapter) or not int4_repackable(adapter):
        return None
    E = adapter.num_experts
    return sum(E * GgufInt4Format(f, dtype).nbytes for f in adapter.formats(dtype).values())
