"""GPT-OSS: router with bias, softmax over the top-k logits; experts are stored fused and
transposed with biases: gate_up [E,H,2I] with gate = [..., ::2] and up = [..., 1::2] interleaved,
down [E,I,H]; the activation is a clamped SwiGLU (the experts module's own `_apply_gate`).
As released (openai/gpt-oss-*) the projections are MXFP4 `*_blocks` / `*_scales` ([E, out, in/32, 16] /
[E, out, in/32]); they stay packed (`moectl/formats/mxfp4.py`). A GGUF's experts in place on the CPU come as
ggml callables over the mapped file (`formats/gguf_ggml.py`), biases included."""

from __future__ import annotations

import torch

from ..errors import MoectlError
from .base import ExpertLayout, FamilyAdapter


class GptOssAdapter(FamilyAdapter):
    family = "gpt_oss"
    model_types = ("gpt_oss",)
    per_expert = ()                       # released checkpoints are fused only
    fused = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")
    router_attr = "router"
    linear_callables = False              # its expert_forward multiplies x @ w directly

    def layout(self) -> ExpertLayout:
        H, I = self.config.hidden_size, self.config.intermediate_size
        return ExpertLayout(("gate_up", "gate_up_bias", "down", "down_bias"), ((H, 2 * I), (2 * I,), (I, H), (H,)))

    def _prefix(self, ckpt, layer):
        p = f"model.layers.{layer}.mlp"
        if f"{p}.{self._disk_keys(self.fused)[0]}" in ckpt:
            return p, True
        if self.quant is None and f"{p}.experts.gate_up_proj_blocks" in ckpt:
            raise MoectlError(f"{ckpt.path} stores GPT-OSS experts in MXFP4 (`*_blocks`/`*_scales`) but its "
                              f"config.json has no quantization_config {{quant_method: mxfp4}}")
        raise MoectlError(f"checkpoint {ckpt.path} has no experts for layer {layer} under {p}"
                          + (f" ({self.quant.method}: {self._disk_keys(self.fused)[0]})" if self.quant else ""))

    def expert_forward(self, w, x, apply_gate):
        if not isinstance(w["gate_up"], torch.Tensor):
            # a GGUF's expert computed by ggml where it lies (kernels/ggml.py: GgmlBiasedLinear): x -> [gate | up]
            # with the biases added; the gate reads them interleaved (gate in the even columns)
            gate, up = w["gate_up"](x).chunk(2, dim=-1)
            return w["down"](apply_gate(torch.stack([gate, up], dim=-1).flatten(-2)))
        h = apply_gate(x @ w["gate_up"] + w["gate_up_bias"])
        return h @ w["down"] + w["down_bias"]
