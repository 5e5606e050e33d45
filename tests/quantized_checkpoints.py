"""Tiny checkpoints written the way quantized MoEs are released (offline, < 1 s each).

- `write_mxfp4_gpt_oss`: GPT-OSS with MXFP4 experts as openai/gpt-oss-* ship them: per layer
  `mlp.experts.gate_up_proj_blocks` U8 [E, 2I, H/32, 16], `gate_up_proj_scales` U8 [E, 2I, H/32],
  `gate_up_proj_bias` BF16 [E, 2I], `down_proj_blocks` U8 [E, H, I/32, 16], `down_proj_scales` U8 [E, H, I/32],
  `down_proj_bias` BF16 [E, H]; everything else BF16; config.json `quantization_config`
  {quant_method: mxfp4, modules_to_not_convert: [...]}. Blocks hold two e2m1 codes per byte (low nibble
  first), scales are e8m0 exponents (2**(s-127)) of 32 weights along the input dimension.
- `write_fp8_qwen3_moe`: Qwen3-MoE as Qwen/Qwen3-30B-A3B-FP8 ships it: every linear layer's `weight` F8_E4M3
  with a F32 `weight_scale_inv` per `weight_block_size` block (dequantised = weight * scale_inv), per-expert
  keys; embeddings, norms, routers (`mlp.gate`) and lm_head in BF16; config `quantization_config`
  {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [b, b]}.

The quantizers below only make such files from a random tiny model; what moectl and transformers read
back is the quantized values, so the comparison between them is exact.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from model_factory import family_configs

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] (C % 32 == 0) -> blocks U8 [..., R, C/32, 16], scales U8 [..., R, C/32] (OCP MX: the scale is
    2**(floor(log2(amax)) - 2), codes the nearest e2m1 value)."""
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = g.abs().amax(-1).clamp_min(2.0**-100)
    exp = torch.floor(torch.log2(amax)) - 2
    q = g / torch.exp2(exp)[..., None]
    codes = (q[..., None] - FP4_VALUES).abs().argmin(-1).to(torch.uint8)         # nearest value's code
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def write_mxfp4_gpt_oss(out: Path, seed: int = 0) -> Path:
    """A tiny random GPT-OSS saved with MXFP4 experts, as released."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = family_configs()["gpt_oss"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    tensors = {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # gate_up [E, H, 2I] / down [E, I, H] hold (in, out); the file holds (out, in), blocked along `in`
            blocks, scales = mxfp4_quantize(v.transpose(1, 2))
            tensors[f"{k}_blocks"], tensors[f"{k}_scales"] = blocks.contiguous(), scales.contiguous()
        else:
            tensors[k] = v.to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    d = cfg.to_dict() | {"architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16",
                         "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                             "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                             "lm_head"]}}
    d.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(d, indent=2))
    return out


def fp8_block_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (F8_E4M3 [R, C], F32 scale_inv [ceil(R/b), ceil(C/b)]): each block scaled to amax 448."""
    R, C = w.shape
    nr, nc = -(-R // block), -(-C // block)
    pad = torch.zeros(nr * block, nc * block)
    pad[:R, :C] = w.float()
    blk = pad.reshape(nr, block, nc, block)
    scale = blk.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0                   # [nr, nc]
    q = (blk / scale[:, None, :, None]).reshape(nr * block, nc * block)[:R, :C].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def write_fp8_qwen3_moe(out: Path, block: int = 16, seed: int = 0, family: str = "qwen3_moe") -> Path:
    """A tiny random Qwen3-MoE (or `family`: deepseek_v3) saved with block-scaled FP8 linear layers, as released."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = family_configs()[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "_bf16"
    model.save_pretrained(tmp, save_original_format=True)            # per-expert keys, as released
    from safetensors.torch import load_file

    tensors = {}
    for k, v in load_file(tmp / "model.safetensors").items():
        linear = k.endswith(("proj.weight", "proj_with_mqa.weight"))  # attention, dense MLP, every expert projection
        if linear:
            tensors[k], tensors[k.removesuffix("weight") + "weight_scale_inv"] = fp8_block_quantize(v, block)
        else:
            tensors[k] = v.to(torch.bfloat16).contiguous()
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    d = cfg.to_dict() | {"architectures": [type(model).__name__], "torch_dtype": "bfloat16",
                         "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                 "weight_block_size": [block, block]}}
    d.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(d, indent=2))
    return out


def reference_dequantized(path: Path):
    """transformers' own load of a quantized checkpoint, dequantised to fp32 (what moectl must equal)."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    method = AutoConfig.from_pretrained(path).quantization_config["quant_method"]
    qc = Mxfp4Config(dequantize=True) if method == "mxfp4" else FineGrainedFP8Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=qc)
    return model.float().eval()     # the FP8 loader leaves unquantized tensors in the file's bf16 (exact in fp32)


GPT_OSS_120B = dict(num_hidden_layers=36, num_local_experts=128, num_experts_per_tok=4, hidden_size=2880,
                    intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                    vocab_size=201088, sliding_window=128, tie_word_embeddings=False)


def write_headers_only_gpt_oss(out: Path, **shape) -> Path:
    """A GPT-OSS checkpoint of real size (default gpt-oss-120b's config) whose shard is only its header: the
    tensor names, dtypes, shapes and byte offsets of the MXFP4 release, in a sparse file of the full length
    (no data written, no disk used). What `inspect` and the sizing read; never loaded."""
    import struct

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(**(GPT_OSS_120B | shape))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    names = {torch.uint8: "U8", torch.bfloat16: "BF16"}
    tensors = {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, cin, cout = v.shape
            tensors[f"{k}_blocks"] = (torch.uint8, (E, cout, cin // 32, 16))
            tensors[f"{k}_scales"] = (torch.uint8, (E, cout, cin // 32))
        else:
            tensors[k] = (torch.bfloat16, tuple(v.shape))
    header, pos = {}, 0
    for k, (dt, shp) in tensors.items():
        n = math.prod(shp) * dt.itemsize
        header[k] = {"dtype": names[dt], "shape": list(shp), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + pos)
    d = cfg.to_dict() | {"architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16",
                         "quantization_config": {"quant_method": "mxfp4"}}
    d.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(d, indent=2))
    return out
