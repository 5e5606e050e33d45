"""Checkpoints released quantized: which scheme `config.json`'s `quantization_config` names, the on-disk
keys of a quantized tensor, and the expert format that keeps it packed as shipped.

- `mxfp4` (GPT-OSS): expert projections as `*_blocks` / `*_scales` (`moectl/formats/mxfp4.py`); everything
  else (attention, router, embeddings, head, expert biases) is BF16.
- `fp8` with `weight_block_size` (DeepSeek-V3, Qwen3-*-FP8): every linear `weight` F8_E4M3 with a
  `weight_scale_inv` per block (`moectl/formats/fp8_block.py`), experts and dense layers alike; the dense ones
  are dequantised once when read into the model (they are a small part of the bytes), the experts stay FP8.
Any other method is a clear error naming it: moectl would otherwise read packed integers as weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import MoectlError

SUPPORTED = ("mxfp4", "fp8 (block-scaled, weight_block_size)")


@dataclass(frozen=True)
class ReleasedQuant:
    method: str                                  # "mxfp4" | "fp8"
    block: tuple[int, int] | None = None         # fp8: weight_block_size

    # --- on-disk names ------------------------------------------------------------------
    def disk_keys(self, key: str) -> tuple[str, ...]:
        """The stored tensors of an expert tensor the dense checkpoint calls `key`: (values, scales) for a
        quantized projection, (key,) for one kept as it is (GPT-OSS's biases)."""
        if self.method == "mxfp4":
            return (key,) if key.endswith("_bias") else (f"{key}_blocks", f"{key}_scales")
        return (key, key.removesuffix("weight") + "weight_scale_inv") if key.endswith(".weight") else (key,)

    def is_scale(self, key: str) -> bool:
        """A scale tensor read together with its weight (never a model parameter of its own)."""
        return key.endswith("weight_scale_inv") if self.method == "fp8" else key.endswith("_scales")

    def read_dense(self, ckpt, key: str) -> torch.Tensor:
        """A non-expert tensor as the model uses it: FP8 weights dequantised with their block scales (fp32;
        the caller casts to the model dtype), everything else as stored."""
        t = ckpt.get(key)
        scale = key.removesuffix("weight") + "weight_scale_inv"
        if self.method == "fp8" and key.endswith(".weight") and scale in ckpt:
            from .fp8_block import dequantize

            return dequantize(t, ckpt.get(scale), self.block, torch.float32)
        return t

    def expert_format(self, layout, dtype: torch.dtype):
        """The packed format of one expert as released (computed in `dtype` after dequantising)."""
        if self.method == "mxfp4":
            from .mxfp4 import Mxfp4Format

            return Mxfp4Format(layout, dtype)
        from .fp8_block import Fp8BlockFormat

        return Fp8BlockFormat(layout, dtype, self.block)

    def describe(self) -> str:
        return self.method if self.block is None else f"{self.method} (blocks {self.block[0]}x{self.block[1]})"


def released_quant(config, family: str) -> ReleasedQuant | None:
    """The quantization a checkpoint was released in (None for a plain float checkpoint); a clear error for a
    method moectl does not read, or one this family does not ship."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4":
        if family != "gpt_oss":
            raise MoectlError(f"quantization_config.quant_method 'mxfp4' is read for GPT-OSS checkpoints only, "
                              f"this one is {family}")
        return ReleasedQuant("mxfp4")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise MoectlError("quantization_config.quant_method 'fp8' without weight_block_size (per-tensor FP8) is "
                              "not supported; moectl reads block-scaled FP8 (weight_scale_inv per block)")
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise MoectlError(f"quantization_config.fmt {qc.get('fmt')!r}: moectl reads FP8 e4m3 checkpoints")
        if family == "gpt_oss":
            raise MoectlError("GPT-OSS is released in MXFP4; an FP8 GPT-OSS checkpoint is not supported")
        return ReleasedQuant("fp8", (int(block[0]), int(block[1])))
    raise MoectlError(f"checkpoint is quantized with quantization_config.quant_method {method or '(none)'!r}, "
                      f"which moectl does not read; supported as released: {', '.join(SUPPORTED)}. Dequantise it "
                      f"once (transformers from_pretrained + save_pretrained) or use the bf16 release")
