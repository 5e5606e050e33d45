"""The dense (non-expert) tensors of a GGUF model, dequantised once, under the model's own state-dict names.

Legend: H = hidden size.

Names: transformers' `get_gguf_hf_weights_map` (gguf's `TensorNameMap` run over the model's parameters, the
converter's map read backwards). Values: transformers' per-architecture `TENSOR_PROCESSORS` undo llama.cpp's
transforms (the `llama` architecture's Q/K row permutation; Qwen-MoE's shared-expert gate [H] -> [1, H]); GPT-OSS's
`attn_sinks.weight` is the model's `sinks`. Routed experts are not here (`ExpertIndex`): they stay packed.
A tensor the model does not know, or a model parameter the file lacks, is a MoectlError naming it.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from ...errors import MoectlError
from ...formats.gguf_dequant import dequantize
from .experts import _is_expert
from .files import CHUNK_WEIGHTS, ROW_CHUNKED, GgufFiles

# moectl family -> the gguf architecture name transformers' name map wants (its own hack list lacks some)
GGUF_MODEL_TYPE = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
                   "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss"}


def _processor(files: GgufFiles, model):
    """transformers' per-architecture tensor processor: undoes llama.cpp's transforms of the converter."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(files.arch, TensorProcessor)(config=model.config.to_dict())


def dense_names(files: GgufFiles, model) -> dict[str, str]:
    """GGUF name -> model state-dict name for every dense tensor of the file."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    processor = _processor(files, model)
    names = get_gguf_hf_weights_map(model, processor, GGUF_MODEL_TYPE[model.config.model_type],
                                    model.config.num_hidden_layers)
    if model.config.model_type == "gpt_oss":
        for layer in range(model.config.num_hidden_layers):
            names[f"blk.{layer}.attn_sinks.weight"] = f"model.layers.{layer}.self_attn.sinks"
    if model.config.model_type == "deepseek_v3":   # the name map reads the bias as the router's own
        for layer in range(model.config.num_hidden_layers):
            names[f"blk.{layer}.exp_probs_b.bias"] = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    out = {}
    for name in files.tensors:
        if _is_expert(name) or MLA_SPLIT.match(name):
            continue
        if name not in names:
            raise MoectlError(f"{files.tensors[name].file}: tensor {name} has no place in a "
                              f"{model.config.model_type} model")
        out[name] = names[name]
    return out


def dense_in_place(files: GgufFiles, model) -> dict[str, tuple]:
    """The dense matrices ggml computes where they lie (moectl/models/dense_gguf.py): {state-dict name of the
    weight: (encoding, uint8 [rows, row bytes] view of the mapped file, row order or None, GGUF name)} for every
    nn.Linear and nn.Embedding of `model` whose GGUF tensor has the module's shape, save the routers (kept exact:
    their scores pick the experts). The converter's transform must be a pure reordering of rows (the `llama`
    architecture's Q/K permutation; found by running transformers' processor over the row numbers), else the
    tensor is dequantised as before. A tied lm_head (no output.weight) points at the embedding table's bytes."""
    processor = _processor(files, model)
    modules = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    out = {}
    for gguf_name, hf_name in dense_names(files, model).items():
        module, t = modules.get(hf_name.removesuffix(".weight")), files.tensors[gguf_name]
        if module is None or not hf_name.endswith(".weight") or "ffn_gate_inp" in gguf_name or len(t.shape) != 2:
            continue
        rows, cols = t.shape
        if tuple(module.weight.shape) != (rows, cols) or t.nbytes % rows:
            continue
        order = processor.process(weights=np.arange(rows, dtype=np.float64).reshape(rows, 1), name=gguf_name).weights
        order = np.asarray(order)
        if order.shape != (rows, 1) or not np.array_equal(np.sort(order[:, 0]), np.arange(rows)):
            continue                          # the converter's transform is more than a reordering of rows
        perm = None if np.array_equal(order[:, 0], np.arange(rows)) else torch.from_numpy(order[:, 0].astype(np.int64))
        data = files.bytes_of(t.file, t.offset, t.nbytes).reshape(rows, t.nbytes // rows)
        out[hf_name] = (t.encoding, data, perm, gguf_name)
    if getattr(model.config, "tie_word_embeddings", False) and "output.weight" not in files.tensors:
        # one table for both: the lm_head reads the embedding's bytes, or neither stays in the file (tie_weights)
        head = model.get_output_embeddings()
        head_name = next((k for k, v in modules.items() if v is head), None)
        emb = next((k for k in out if isinstance(modules[k.removesuffix(".weight")], nn.Embedding)), None)
        if emb is not None and isinstance(head, nn.Linear) and tuple(head.weight.shape) == out[emb][1].shape[:1] + (
                head.in_features,):
            out[f"{head_name}.weight"] = out[emb]
        else:
            out.pop(emb, None)
    return out


def dense_state_dict(files: GgufFiles, model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """{state-dict name: tensor} of every dense tensor, dequantised to `dtype` (the skeleton loads it with
    `load_state_dict(..., assign=True)`); the model's non-expert parameters must all be there."""
    return dict(dense_tensors(files, model, lambda name: dtype))


def dense_tensors(files: GgufFiles, model, dtype_of=lambda name: torch.float32, skip=()):
    """(state-dict name, tensor in `dtype_of(name)`) of every dense tensor but those named in `skip`, one at a time:
    each read by a positioned read (nothing of the file stays mapped), dequantised in fp32, fixed up, cast, then the
    next, so loading holds one fp32 temporary at most beside the model."""
    processor = _processor(files, model)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    for gguf_name, hf_name in dense_names(files, model).items():
        if hf_name in skip:
            continue
        t = files.tensors[gguf_name]
        if gguf_name in ROW_CHUNKED and tuple(shapes[hf_name]) == tuple(t.shape) and t.nbytes % t.shape[0] == 0:
            yield hf_name, _rows_dequantised(files, t, dtype_of(hf_name))
            continue
        raw = torch.from_numpy(files.read(t.file, t.offset, t.nbytes))
        values = dequantize(raw, t.encoding, t.shape, torch.float32, f"{t.file}: tensor {gguf_name}").numpy()
        values = processor.process(weights=values, name=gguf_name).weights
        want = shapes[hf_name]
        values = torch.from_numpy(np.ascontiguousarray(values)).reshape(want) if values.size == want.numel() \
            else _shape_error(files, gguf_name, values.shape, hf_name, want)
        yield hf_name, values.to(dtype_of(hf_name))
    out: dict[str, torch.Tensor] = {}
    _merge_mla(files, model, out, torch.float32)
    for name, value in out.items():
        yield name, value.to(dtype_of(name))


def _rows_dequantised(files: GgufFiles, t, dtype: torch.dtype) -> torch.Tensor:
    """A vocabulary-sized tensor (ROW_CHUNKED, files.py) `t` [rows, cols] in `dtype`, dequantised CHUNK_WEIGHTS at a time (whole rows: a row is whole
    blocks of its encoding, so a block of rows is a byte range of the file)."""
    rows, cols = t.shape
    row_bytes = t.nbytes // rows
    out = torch.empty(t.shape, dtype=dtype)
    step = max(1, CHUNK_WEIGHTS // cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        raw = torch.from_numpy(files.read(t.file, t.offset + r0 * row_bytes, n * row_bytes))
        out[r0:r0 + n] = dequantize(raw, t.encoding, (n, cols), torch.float32, f"{t.file}: tensor {t.name}")
    return out


MLA_SPLIT = re.compile(r"^blk\.(\d+)\.attn_([kv])_b\.weight$")


def _merge_mla(files: GgufFiles, model, out: dict, dtype: torch.dtype) -> None:
    """DeepSeek files from today's converter split kv_b_proj [heads*(nope+v), kv_lora] into attn_k_b
    [heads, kv_lora, nope] (transposed, for llama.cpp's absorbed MLA) and attn_v_b [heads, v, kv_lora]: joined back."""
    layers = sorted({int(m[1]) for n in files.tensors if (m := MLA_SPLIT.match(n))})
    for layer in layers:
        k_b, v_b = (files.tensors.get(f"blk.{layer}.attn_{x}_b.weight") for x in "kv")
        if k_b is None or v_b is None:
            raise MoectlError(f"{files.paths[0]}: layer {layer} has only one of attn_k_b / attn_v_b")
        k, v = (dequantize(torch.from_numpy(files.bytes_of(t.file, t.offset, t.nbytes)), t.encoding, t.shape,
                           torch.float32, f"{t.file}: tensor blk.{layer}") for t in (k_b, v_b))
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        want = model.state_dict()[name].shape
        kv = torch.cat([k.transpose(1, 2), v], dim=1)                              # [heads, nope + v, kv_lora]
        out[name] = (kv.reshape(want) if kv.numel() == want.numel() else
                     _shape_error(files, k_b.name, tuple(kv.shape), name, want)).to(dtype)


def _shape_error(files, gguf_name, got, hf_name, want):
    raise MoectlError(f"{files.tensors[gguf_name].file}: tensor {gguf_name} is {list(got)}, but the model's "
                      f"{hf_name} is {list(want)} (metadata contradicts tensors)")
