"""Cost model: how long copies and computations take on a given GPU for a given model shape.

One object shared by the simulator (its clock) and the runtime (fetch vs CPU compute vs low
precision on a miss). Numbers come from `recipes/hardware/<name>.yaml` (bandwidths, FLOP/s) and
a model shape (`core/shapes.py`: the `shape:` block of `recipes/<model>.yaml`), so bytes per expert are real:
Mixtral-8x7B's expert is 3 * 4096 * 14336 * 2 B = 352 MB in bf16.

Decode is memory bound: a layer's time is the bytes it reads divided by the GPU memory bandwidth
(weights, plus the KV cache for attention); prefill also checks FLOPs and takes the larger.
All times are in seconds, bandwidths in GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ..core.shapes import DTYPE_BYTES, RECIPES_DIR, expert_bytes
from ..errors import MoectlError

HARDWARE_DIR = RECIPES_DIR / "hardware"
@dataclass
class Hardware:
    name: str
    pcie_gbps: float
    gpu_mem_gbps: float
    gpu_tflops: float
    cpu_mem_gbps: float
    cpu_cores: int
    mem_efficiency: float = 0.75
    flops_efficiency: float = 0.5
    layer_overhead_ms: float = 0.02
    gpu_memory_gb: float = 24.0
    cpu_gflops: float | None = None       # CPU GEMM speed; None = cpu_cores x 50 GFLOP/s (AVX2/AVX-512 FMA)
    cpu_lowbit_gbps: float | None = None  # CPU rate over a low-bit copy's packed bytes (torch's int4 kernel is
                                          # compute bound on some CPUs: moectl/runtime/machine.py measures it); None =
                                          # cpu_mem_gbps x CPU_Q4_SHARE["moectl"] (measured beside llama.cpp)
    cpu_llamacpp_gbps: float | None = None  # llama.cpp's CPU rate over a q4 expert's bytes; None = cpu_mem_gbps x
                                            # CPU_Q4_SHARE["llamacpp"]
    gpu_lowbit_gbps: float | None = None  # the GPU's rate over a resident low-bit copy's packed bytes at decode
                                          # (moectl's Triton kernels, timed by the GPU check's kernels step:
                                          # bench/gpu_kernels.py); None = gpu_mem_gbps x mem_efficiency, as bf16


# A q4 expert computed on the CPU at decode, as a share of the host's memory read bandwidth: measured on this
# project's 2-core machine, both tools on the same checkpoint (bench/vs_llamacpp.py; docs/benchmarks.md "moectl
# beside llama.cpp, measured"), and carried to hardware profiles that give only cpu_mem_gbps.
# Third round (moectl's own int8-activation q4 kernel, `moectl/kernels`): both tools' whole decode tokens at one
# thread at the same precision (moectl q4g64 + `--dense-lowbit q4`, llama.cpp Q4_0; Mixtral shape x 2 layers,
# 18:52-18:58 UTC), bytes a token reads / its time over the host read rate measured in that run: moectl 17.5 /
# 31.4 GB/s = 0.56, llama.cpp 19.5 / 31.4 = 0.62. Whole tokens for both, so the same measure on both sides (a
# whole token's rate is a lower bound on its experts' rate: one q4g64 expert alone read 0.67-0.75 of the host
# rate through moectl's kernel, bench/cpu_expert.py; llama.cpp's experts cannot be timed alone). Was 0.36 / 0.58
# with torch's int4 kernel.
# Fourth round (four dpbusd chains and a prefetch in the q4 kernel, the decode attention kernel, fused experts, a
# q6 lm_head; 21:29-21:38 UTC): moectl q4g64 + dense q4 22.6 / 32.4 GB/s = 0.70, llama.cpp Q4_0 19.0 / 32.4 = 0.59.
CPU_Q4_SHARE = {"moectl": 0.70, "llamacpp": 0.59}          # 1 thread, Mixtral shape, q4g64 and Q4_0


def list_hardware() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name_or_path: str) -> Hardware:
    p = Path(name_or_path).expanduser()
    if not p.is_file():
        p = HARDWARE_DIR / f"{name_or_path}.yaml"
    if not p.is_file():
        raise MoectlError(f"unknown hardware profile {name_or_path!r}; known: {', '.join(list_hardware())} "
                          f"(or a path to a yaml file like recipes/hardware/rtx4090-pcie4.yaml)")
    d = yaml.safe_load(p.read_text()) or {}
    fields = set(Hardware.__dataclass_fields__)
    missing = {"pcie_gbps", "gpu_mem_gbps", "gpu_tflops", "cpu_mem_gbps", "cpu_cores"} - set(d)
    if missing:
        raise MoectlError(f"hardware profile {p} lacks {', '.join(sorted(missing))}")
    d.setdefault("name", p.stem)
    return Hardware(**{k: v for k, v in d.items() if k in fields})


class CostModel:
    """Times (seconds) for copies and compute of `shape` on `hw`."""

    def __init__(self, hw: Hardware, shape: dict, bits: float | None = None):
        self.hw, self.shape = hw, shape
        self.dtype_bytes = DTYPE_BYTES.get(str(shape.get("dtype", "bfloat16")), 2.0)
        self.expert_bytes = expert_bytes(shape, bits)
        self.mem_bps = hw.gpu_mem_gbps * 1e9 * hw.mem_efficiency
        self.flops = hw.gpu_tflops * 1e12 * hw.flops_efficiency
        D, H = shape["hidden_size"], shape["num_attention_heads"]
        kv, hd = shape.get("num_key_value_heads", H), shape.get("head_dim") or D // H
        self.attn_params = D * H * hd * 2 + D * kv * hd * 2            # q, o + k, v projections
        self.kv_bytes_per_token = 2 * kv * hd * self.dtype_bytes        # K and V of one layer
        shared_i = (shape.get("shared_experts") or 0) and (shape.get("shared_expert_intermediate_size")
                                                           or shape["intermediate_size"] * shape["shared_experts"])
        self.shared_params = 3 * D * shared_i if shared_i else 0
        self.expert_params = 3 * D * shape["intermediate_size"]

    def load_s(self, nbytes: float | None = None) -> float:
        """Host -> GPU copy of `nbytes` (default one expert)."""
        return (self.expert_bytes if nbytes is None else nbytes) / (self.hw.pcie_gbps * 1e9)

    def _gemm_s(self, params: float, tokens: int) -> float:
        return max(params * self.dtype_bytes / self.mem_bps, 2 * params * tokens / self.flops)

    def attention_s(self, tokens: int = 1, context: int = 512) -> float:
        """Non-expert part of one layer (attention, norms, router, shared experts) for `tokens` new tokens
        attending to `context` cached ones."""
        kv_read = context * self.kv_bytes_per_token / self.mem_bps
        return (self._gemm_s(self.attn_params + self.shared_params, tokens) + kv_read
                + self.hw.layer_overhead_ms * 1e-3)

    def expert_s(self, tokens: int = 1, nbytes: float | None = None, lowbit: bool = False) -> float:
        """One resident expert applied to `tokens` tokens; `nbytes` the copy's size (a low-bit copy reads
        fewer bytes: decode is memory bound; default the expert at the model's precision); a `lowbit` copy's bytes
        at the device's measured low-bit rate where the profile has one (`gpu_lowbit_gbps`)."""
        nbytes = self.expert_bytes if nbytes is None else nbytes
        rate = self.hw.gpu_lowbit_gbps * 1e9 if lowbit and self.hw.gpu_lowbit_gbps else self.mem_bps
        return max(nbytes / rate, 2 * self.expert_params * tokens / self.flops)

    def lm_head_s(self, tokens: int = 1) -> float:
        return self._gemm_s(self.shape["hidden_size"] * (self.shape.get("vocab_size") or 32000), tokens)

    def cpu_expert_s(self, tokens: int = 1, nbytes: float | None = None, lowbit: bool = False,
                     engine: str = "moectl") -> float:
        """One expert computed on the CPU from host RAM (Fiddler-style alternative to a copy): its bytes
        (`nbytes`, default the full-precision expert) read at host memory bandwidth (a `lowbit` copy at the
        low-bit kernel's rate: measured, or the measured share of the bandwidth; `engine="llamacpp"`: llama.cpp's
        measured rate), or its FLOPs at the CPU's GEMM speed when many tokens make it compute bound (prefill)."""
        nbytes = self.expert_bytes if nbytes is None else nbytes
        hw = self.hw
        if engine == "llamacpp":
            gbps = hw.cpu_llamacpp_gbps or hw.cpu_mem_gbps * CPU_Q4_SHARE["llamacpp"]
        else:
            gbps = (hw.cpu_lowbit_gbps or hw.cpu_mem_gbps * CPU_Q4_SHARE["moectl"]) if lowbit else hw.cpu_mem_gbps
        gflops = self.hw.cpu_gflops or 50.0 * self.hw.cpu_cores
        return max(nbytes / (gbps * 1e9), 2 * self.expert_params * tokens / (gflops * 1e9))


class FixedCost:
    """A cost model with fixed times (seconds), for tests and hand-made cases. Default ratios are
    Mixtral-8x7B-like (an expert copy ~30x its compute)."""

    def __init__(self, load: float = 1.0, attention: float = 0.01, expert: float = 0.03, head: float = 0.0,
                 expert_bytes: float = 1.0, cpu_expert: float = 0.3):
        self.load, self.attention, self.expert, self.head = load, attention, expert, head
        self.expert_bytes, self.cpu_expert = expert_bytes, cpu_expert

    def cpu_expert_s(self, tokens: int = 1, nbytes: float | None = None, lowbit: bool = False,
                     engine: str = "moectl") -> float:
        return self.cpu_expert if nbytes is None else self.cpu_expert * nbytes / self.expert_bytes

    def load_s(self, nbytes: float | None = None) -> float:
        return self.load if nbytes is None else self.load * nbytes / self.expert_bytes

    def attention_s(self, tokens: int = 1, context: int = 0) -> float:
        return self.attention

    def expert_s(self, tokens: int = 1, nbytes: float | None = None, lowbit: bool = False) -> float:
        return self.expert if nbytes is None else self.expert * nbytes / self.expert_bytes

    def lm_head_s(self, tokens: int = 1) -> float:
        return self.head
