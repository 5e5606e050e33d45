"""ExpertStore: every routed expert's weights in host memory (or on disk), one flat buffer each.

Legend: L = MoE layers, E = experts per layer, P = numel of one packed expert (`ExpertLayout`).

`ram` tier: experts are read from the checkpoint one tensor at a time into one packed buffer per
expert (pinned when CUDA is present, so device copies can run asynchronously). The checkpoint is
memory-mapped, so peak host memory while loading stays near the model size plus one expert.
`disk` tier: nothing is copied up front; each fetch reads the expert's tensors straight from the
memory-mapped safetensors shards (the OS page cache is the only host copy).
"""

from __future__ import annotations

import torch

from ..models.base import ExpertLayout, FamilyAdapter
from ..progress import ProgressBar
from .checkpoint import Checkpoint


class ExpertStore:
    def __init__(self, ckpt: Checkpoint, adapter: FamilyAdapter, moe_layer_ids: list[int], dtype: torch.dtype,
                 offload: str = "ram", pin: bool = False, progress: bool = True):
        self.ckpt, self.adapter, self.dtype = ckpt, adapter, dtype
        self.moe_layer_ids = list(moe_layer_ids)              # trace layer -> model layer
        self.layout: ExpertLayout = adapter.layout()
        self.num_experts = adapter.num_experts
        self.offload = offload
        self.expert_nbytes = self.layout.numel * torch.empty((), dtype=dtype).element_size()
        self.buffers: list[list[torch.Tensor]] | None = None   # [L][E] flat [P] tensors (ram tier)
        if offload == "ram":
            self.buffers = []
            total = len(self.moe_layer_ids) * self.num_experts
            with ProgressBar(progress, transient=True) as bar:
                task = bar.add("reading experts", total)
                for layer in self.moe_layer_ids:
                    row = []
                    for e in range(self.num_experts):
                        flat = torch.empty(self.layout.numel, dtype=dtype, pin_memory=pin)
                        self._read_into(layer, e, flat)
                        row.append(flat)
                        bar.update(task, advance=1)
                    self.buffers.append(row)

    @property
    def num_layers(self) -> int:
        return len(self.moe_layer_ids)

    def _read_into(self, model_layer: int, expert: int, flat: torch.Tensor) -> None:
        start = 0
        for t, shape in zip(self.adapter.read_expert(self.ckpt, model_layer, expert), self.layout.shapes):
            if tuple(t.shape) != tuple(shape):
                from ..errors import MoectlError

                raise MoectlError(f"expert {expert} of layer {model_layer} in {self.ckpt.path} has shape "
                                  f"{tuple(t.shape)}, config says {tuple(shape)}")
            n = t.numel()
            flat[start:start + n].copy_(t.reshape(-1))      # casts to the store dtype
            start += n

    def host(self, layer: int, expert: int) -> torch.Tensor:
        """The packed host buffer [P] of (MoE layer `layer`, expert). Disk tier: read it now."""
        if self.buffers is not None:
            return self.buffers[layer][expert]
        flat = torch.empty(self.layout.numel, dtype=self.dtype)
        self._read_into(self.moe_layer_ids[layer], expert, flat)
        return flat
