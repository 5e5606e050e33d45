"""What moectl needs to know about one MoE family, in one small class per family.

Legend: E = routed experts, H = hidden size, I = expert intermediate size, T = tokens.

In the installed transformers every MoE block calls `self.experts(x [T,H], top_k_index [T,K],
top_k_weights [T,K])`, so the runtime swaps that one module. An adapter says where the block's
router and experts are, how many experts and top-k the config asks for, how one expert's tensors
are named on disk (per-expert keys as released, or fused `[E, ...]` keys read one row at a time),
and how to run one expert on its packed weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..errors import MoectlError
from ..formats.expert import DenseFormat, ExpertFormat
from ..formats.released import released_quant
from ..kernels import gemv


@dataclass(frozen=True)
class ExpertLayout:
    """The matrices one expert computes with (names and shapes, in on-disk packed order). How they are
    stored as bytes is an `ExpertFormat` (`moectl/formats/expert.py`): `DenseFormat(layout, dtype)` for the
    checkpoint's own tensors, a quantized format for low-bit copies."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name, shape in zip(self.names, self.shapes):
            n = math.prod(shape)
            out[name] = flat[start:start + n].view(shape)
            start += n
        return out


class FamilyAdapter:
    family = ""
    model_types: tuple[str, ...] = ()
    # The GGUF model the experts are read from (`store/gguf/model.py: GgufModel`, set by `store/gguf/store.py:
    # GgufAdapter`), or None: a safetensors checkpoint. The one way to ask "is it a GGUF?".
    gguf = None
    # On-disk prefixes of layer l's MoE block, tried in order (released names first).
    disk_prefixes: tuple[str, ...] = ("model.layers.{l}.mlp",)
    # Per-expert on-disk key suffixes for the gate (w1), up (w3) and down (w2) projections.
    per_expert = ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight")
    fused = ("experts.gate_up_proj", "experts.down_proj")
    router_attr = "gate"
    # Renames from on-disk names to the module names transformers builds (old -> new).
    key_renames: tuple[tuple[str, str], ...] = ()
    # Keys that belong to routed experts (never loaded into the skeleton).
    expert_key_re = re.compile(r"\.experts\.(\d+\.|gate_up_proj|down_proj)")

    def __init__(self, config):
        self.config = config
        # How the checkpoint was released: None (float tensors), or quantized (MXFP4, block FP8), which the
        # experts stay in (their "full" precision) and the dense weights are dequantised from when read.
        self.quant = released_quant(config, self.family)

    # --- config facts -------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        c = self.config
        for name in ("num_local_experts", "num_experts", "n_routed_experts"):
            v = getattr(c, name, None)
            if isinstance(v, int) and v > 0:
                return v
        raise MoectlError(f"config of {self.family} has no expert count")

    @property
    def top_k(self) -> int:
        return int(self.config.num_experts_per_tok)

    @property
    def expert_intermediate(self) -> int:
        return int(getattr(self.config, "moe_intermediate_size", None) or self.config.intermediate_size)

    def layout(self) -> ExpertLayout:
        H, I = self.config.hidden_size, self.expert_intermediate
        return ExpertLayout(("gate_up", "down"), ((2 * I, H), (H, I)))

    def format(self, dtype: torch.dtype) -> ExpertFormat:
        """The full-precision packed format of one expert, at the checkpoint's own precision: the layout's
        tensors in `dtype`, or the parts of a checkpoint released quantized (dequantised to `dtype` where
        the expert is computed)."""
        if self.quant is not None:
            return self.quant.expert_format(self.layout(), dtype)
        return DenseFormat(self.layout(), dtype)

    # --- the model in memory ------------------------------------------------------------
    def moe_blocks(self, model) -> list[tuple[int, torch.nn.Module]]:
        """(model layer index, MoE block) for every sparse layer; dense layers are skipped."""
        return [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]

    def router(self, block) -> torch.nn.Module:
        return getattr(block, self.router_attr)

    def skeleton_key(self, disk_key: str) -> str | None:
        """The model's state-dict key for a non-expert tensor on disk; None for expert tensors."""
        if self.expert_key_re.search(disk_key) or (self.quant is not None and self.quant.is_scale(disk_key)):
            return None
        for old, new in self.key_renames:
            disk_key = disk_key.replace(old, new)
        return disk_key

    def read_dense(self, ckpt, key: str) -> torch.Tensor:
        """A non-expert tensor as stored (dequantised if the checkpoint was released quantized)."""
        return ckpt.get(key) if self.quant is None else self.quant.read_dense(ckpt, key)

    # --- reading one expert -------------------------------------------------------------
    def _disk_keys(self, keys) -> list[str]:
        """The on-disk names of expert tensors `keys` (a quantized release stores values and scales)."""
        return list(keys) if self.quant is None else [q for k in keys for q in self.quant.disk_keys(k)]

    def _prefix(self, ckpt, layer: int) -> tuple[str, bool]:
        """(prefix, fused?) of layer `layer`'s experts in this checkpoint."""
        for p in self.disk_prefixes:
            p = p.format(l=layer)
            if self.per_expert and f"{p}.{self._disk_keys(self.per_expert)[0].format(e=0)}" in ckpt:
                return p, False
            if f"{p}.{self._disk_keys(self.fused)[0]}" in ckpt:
                if self.quant is not None and self.quant.method == "fp8":
                    raise MoectlError(f"{ckpt.path} stores FP8 experts fused ({p}.{self.fused[0]}); moectl reads "
                                      f"block-FP8 experts per expert, as they are released")
                return p, True
        raise MoectlError(f"checkpoint {ckpt.path} has no experts for layer {layer} under "
                          f"{[p.format(l=layer) for p in self.disk_prefixes]} (is it a {self.family} checkpoint?)")

    def expert_parts(self, ckpt, layer: int, expert: int) -> list[tuple[str, int | None]]:
        """(on-disk key, row or None) of this expert's tensors; their bytes, concatenated in this order, are
        the packed `layout()` buffer (gate rows then up rows, then down), so a load is plain reads."""
        prefix, fused = self._prefix(ckpt, layer)
        if fused:
            return [(f"{prefix}.{k}", expert) for k in self._disk_keys(self.fused)]
        return [(f"{prefix}.{k.format(e=expert)}", None) for k in self._disk_keys(self.per_expert)]

    # --- running one expert -------------------------------------------------------------
    def expert_forward(self, w: dict[str, torch.Tensor], x: torch.Tensor, apply_gate) -> torch.Tensor:
        """y [T,H] of one expert on its tokens x [T,H]; `apply_gate` is the family's act(gate)*up. `w` is
        `ExpertFormat.weights(views)`: the layout's matrices, dequantised if the copy was low-bit."""
        return self.linear(apply_gate(self.linear(x, w["gate_up"])), w["down"])

    # Formats whose `weights` may return a callable instead of a matrix (`moectl/formats/int4_cpu.py`) are only
    # used with adapters whose expert_forward goes through `linear`.
    linear_callables = True

    @staticmethod
    def linear(x: torch.Tensor, w) -> torch.Tensor:
        """x @ w^T for a weight [N,K], or w(x) for a format's packed-weight operator."""
        return gemv.linear(x, w) if isinstance(w, torch.Tensor) else w(x)      # one CPU row: torch's GEMV
