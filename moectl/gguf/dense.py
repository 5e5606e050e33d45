"""The dense (non-expert) tensors of a GGUF model, dequantised once, under the model's own state-dict names.

Legend: H = hidden size.

Names: transformers' `get_gguf_hf_weights_map` (gguf's `TensorNameMap` run over the model's parameters, the
converter's map read backwards). Values: transformers' per-architecture `TENSOR_PROCESSORS` undo llama.cpp's
transforms (the `llama` architecture's Q/K row permutation; Qwen-MoE's shared-expert gate [H] -> [1, H]); GPT-OSS's
`attn_sinks.weight` is the model's `sinks`. Routed experts are not here (`ExpertIndex`): they stay packed.
A tensor the model does not know, or a model parameter the file lacks, is a MoectlError naming it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import MoectlError
from .dequant import dequantize
from .experts import _is_expert
from .files import GgufFiles

# moectl family -> the gguf architecture name transformers' name map wants (its own hack list lacks some)
GGUF_MODEL_TYPE = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
                   "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss"}


def dense_names(files: GgufFiles, model) -> dict[str, str]:
    """GGUF name -> model state-dict name for every dense tensor of the file."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    processor = TENSOR_PROCESSORS.get(files.arch, TensorProcessor)(config=model.config.to_dict())
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
        if _is_expert(name):
            continue
        if name not in names:
            raise MoectlError(f"{files.tensors[name].file}: tensor {name} has no place in a "
                              f"{model.config.model_type} model")
        out[name] = names[name]
    return out


def dense_state_dict(files: GgufFiles, model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """{state-dict name: tensor} of every dense tensor, dequantised to `dtype` (the skeleton loads it with
    `load_state_dict(..., assign=True)`); the model's non-expert parameters must all be there."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(files.arch, TensorProcessor)(config=model.config.to_dict())
    out = {}
    for gguf_name, hf_name in dense_names(files, model).items():
        t = files.tensors[gguf_name]
        raw = torch.from_numpy(files.bytes_of(t.file, t.offset, t.nbytes))
        values = dequantize(raw, t.encoding, t.shape, torch.float32, f"{t.file}: tensor {gguf_name}").numpy()
        values = processor.process(weights=values, name=gguf_name).weights
        want = model.state_dict()[hf_name].shape
        values = torch.from_numpy(np.ascontiguousarray(values)).reshape(want) if values.size == want.numel() \
            else _shape_error(files, gguf_name, values.shape, hf_name, want)
        out[hf_name] = values.to(dtype)
    return out


def _shape_error(files, gguf_name, got, hf_name, want):
    raise MoectlError(f"{files.tensors[gguf_name].file}: tensor {gguf_name} is {list(got)}, but the model's "
                      f"{hf_name} is {list(want)} (metadata contradicts tensors)")
