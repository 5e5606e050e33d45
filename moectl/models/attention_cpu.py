"""A decode token's attention on the CPU: moectl's kernel for one query, transformers' own function otherwise.

Legend: B = batch, H = query heads, KV = key/value heads, Q = query tokens, S = cached positions, D = head size.

torch's CPU `scaled_dot_product_attention` is built for long queries: for one query token it took 0.41 ms over 64
cached positions and 3.6 ms over 512 at one thread here (Mixtral's 32 x 8 heads of 128), two attentions of which
are a sizeable part of a 2-layer q4 token (~30 ms); the kernel (`kernels/cpu_kernels.cpp`, fp32 scores, softmax and
sums over the cache in place) takes 0.04 and 0.24 ms, with the same error against an fp32 reference as SDPA's.

How it plugs in: transformers' models look their attention function up by `config._attn_implementation` in
`AttentionInterface`, and their mask maker in `AttentionMaskInterface`. `cpu_attention(model)` registers two
names, one per implementation a model may run with, and points the model's config at the matching one:
    moectl_cpu_sdpa  -> the kernel, else transformers' `sdpa_attention_forward`, with SDPA's masks
    moectl_cpu_eager  -> the kernel, else the model file's own `eager_attention_forward` (GPT-OSS's sinks), with
                         eager's masks
The kernel takes a call only when it computes exactly what the fallback would: one query token, batch 1, bf16, no
dropout / softcap, and every cached position visible (no mask, or a mask that masks nothing: a sliding window
shorter than the cache falls back). Everything else (prefill, padding, training) is the fallback's, unchanged.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .. import kernels
from ..kernels import ops

NAMES = {"sdpa": "moectl_cpu_sdpa", "eager": "moectl_cpu_eager"}


def _all_visible(mask: torch.Tensor | None) -> bool:
    """Whether `mask` masks nothing: None, all True (bool), or all 0 (additive float)."""
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else not bool(mask.any())


def _kernel_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, dropout: float, kwargs) -> bool:
    return (query.shape[0] == 1 and query.shape[2] == 1 and query.device.type == "cpu"
            and query.dtype == key.dtype == value.dtype == torch.bfloat16
            and query.shape[-1] % 32 == 0 and value.shape[-1] % 16 == 0 and value.shape[-1] <= 512
            and query.shape[1] % key.shape[1] == 0
            and key.stride(-1) == 1 and value.stride(-1) == 1
            and not dropout and kwargs.get("softcap") is None and _all_visible(mask))


def _decode(module: nn.Module, query, key, value, scaling, sinks):
    """query [1, H, 1, D], key / value [1, KV, S, D] -> ([1, 1, H, Dv], None), the layout transformers' functions
    return."""
    out = ops.decode_attention(query[0, :, 0], key[0], value[0],                       # [H, Dv]
                               scaling if scaling is not None else query.shape[-1] ** -0.5, sinks)
    return out.view(1, 1, *out.shape), None


def sdpa_or_kernel(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _kernel_fits(query, key, value, attention_mask, dropout, kwargs) and kwargs.get("s_aux") is None:
        return _decode(module, query, key, value, scaling, None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def eager_or_kernel(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    if _kernel_fits(query, key, value, attention_mask, dropout, kwargs):
        # GPT-OSS passes its sinks as s_aux; its eager function reads module.sinks (the same Parameter)
        return _decode(module, query, key, value, scaling, kwargs.get("s_aux"))
    eager = sys.modules[type(module).__module__].eager_attention_forward     # the model file's own
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(NAMES["sdpa"], sdpa_or_kernel)
    AttentionInterface.register(NAMES["eager"], eager_or_kernel)
    AttentionMaskInterface.register(NAMES["sdpa"], sdpa_mask)
    AttentionMaskInterface.register(NAMES["eager"], eager_mask)


def cpu_attention(model: nn.Module) -> str | None:
    """Point `model` (on the CPU) at the decode kernel where moectl's kernels run and its attention is transformers'
    sdpa or eager; returns the implementation it now runs (None: left as it was)."""
    current = model.config._attn_implementation
    if kernels.library() is None or current not in NAMES:
        return None
    if not hasattr(sys.modules[type(model).__module__], "eager_attention_forward") and current == "eager":
        return None
    _register()
    model.set_attn_implementation(NAMES[current])
    return model.config._attn_implementation
