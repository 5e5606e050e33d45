"""This machine's speeds, measured once and cached: what the runtime's cost model and `bench/cpu_expert.py` use.

Legend: H = hidden size, I = expert intermediate size.

Four figures decide fetch vs CPU compute of a missed expert (`policies/placement.py`):
  mem_read_gbps   host memory read bandwidth: a sum over a buffer far larger than the caches
  cpu_expert_gbps a one-token expert FFN (gate/up [2I,H], down [H,I]) computed on the CPU from host RAM, as
                  GB/s of weights read (a GEMV reads every weight once; this is what an expert costs the CPU)
  cpu_lowbit_gbps the same FFN from q4g64 packed weights through the runtime's q4 kernel (moectl's own where it
                  builds, else torch's int4 kernel), as GB/s of packed bytes (how a low-bit miss is computed on
                  the CPU; a kernel may be compute bound, so this is not mem_read_gbps)
  copy_gbps       host -> device copy: pinned RAM -> GPU on CUDA; on a CPU-only machine the memcpy an
                  emulated device's slot fill does
A 16 MB-per-matrix expert is small enough to measure in well under a second; the timed calls cycle through
copies of it that together pass twice the last-level cache (`cold_copies`), so each reads its weights from RAM;
the result is cached in `$MOECTL_HOME/machine.json` under a key of host, CPU, torch version, threads and
device, so a later start reads the file instead of measuring.

The figures become a `Hardware` for `sim/cost.py: CostModel` (`machine_hardware`), so the runtime and the
simulator price a miss the same way.
"""

from __future__ import annotations

import json
import os
import platform
import time
from itertools import cycle
from pathlib import Path

import torch

from ..setting.threads import thread_count

FORMAT = "moectl-machine-v5"            # v2: cpu_lowbit_gbps; v3: bf16 GEMV through kernels/gemv.py;
                                        # v4: q4 / q8 through moectl's own kernels where they build;
                                        # v5: expert rates from copies cycled past the last-level cache


def set_threads(n: int | None, hidden_size: int | None = None, intermediate_size: int | None = None,
                drives_gpu: bool = False) -> int:
    """Set torch's intra-op threads to `n` (--threads) or the default (`setting/threads.py`); returns the count set."""
    n = thread_count(n, hidden_size, intermediate_size, drives_gpu)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def best_s(fn, repeat: int) -> float:
    """Best of `repeat` timed calls of `fn` (seconds), after one untimed warm-up."""
    fn()                                              # warm-up (page faults, kernel choice)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def mem_read_gbps(nbytes: int = 512 * 2**20, repeat: int = 5) -> float:
    """Host memory read bandwidth: a float32 sum over `nbytes` (reads every byte once)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_s(lambda: x.sum(), repeat) / 1e9


def llc_bytes() -> int:
    """The largest CPU cache's size (sysfs; 32 MiB where it cannot be read)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]] if text[-1] in "KMG"
                         else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 * 2**20)


def cold_copies(nbytes: int) -> int:
    """How many copies of an `nbytes` expert the timed calls cycle through, so that each call reads its weights
    from RAM as a decode token's experts are read: between two uses of a copy the others read twice the
    last-level cache. One copy of a 48 MB expert on a server CPU with 100+ MB of L3 measured 149 GB/s against
    109 GB/s of RAM (docs/gpu-check.md), and that rate priced CPU experts 2x too cheap."""
    llc = llc_bytes()
    return 1 if nbytes >= 2 * llc else 1 + -(-2 * llc // nbytes)


def _cold_experts(make) -> tuple[list, int]:
    """`make()` -> ((gate_up, down), bytes one expert reads): the first expert, then as many more as
    `cold_copies` of its bytes asks for; and those bytes."""
    first, nbytes = make()
    return [first] + [make()[0] for _ in range(cold_copies(nbytes) - 1)], nbytes


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cpu_expert_ms(hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16, tokens: int = 1,
                  repeat: int = 5) -> float:
    """Milliseconds of one expert FFN (act(x W_gate) * (x W_up)) W_down on `tokens` tokens on the CPU, through
    the runtime's own linear (`kernels/gemv.py`: torch's native GEMV for one token), weights read from RAM."""
    from ..kernels.gemv import linear

    g = torch.Generator().manual_seed(0)

    def make():
        gate_up = (torch.randn(2 * inter, hidden, generator=g) * 0.02).to(dtype)      # [2I, H]
        down = (torch.randn(hidden, inter, generator=g) * 0.02).to(dtype)             # [H, I]
        return ((lambda x: linear(x, gate_up)), (lambda x: linear(x, down))), _nbytes(gate_up, down)
    return _ffn_ms(_cold_experts(make)[0], inter, hidden, tokens, repeat, g, dtype)


def _ffn_ms(experts: list, inter: int, hidden: int, tokens: int, repeat: int, g: torch.Generator,
            dtype: torch.dtype = torch.bfloat16) -> float:
    """Best milliseconds of one expert FFN, each timed call on the next of `experts` [(gate_up, down)]."""
    import torch.nn.functional as F

    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    following = cycle(experts)

    def run():
        gate_up, down = next(following)
        gu = gate_up(x)                                                           # [T, 2I]
        down(F.silu(gu[:, :inter]) * gu[:, inter:])                               # [T, H]
    with torch.inference_mode():
        return best_s(run, repeat) * 1e3


def _vnni_expert(hidden: int, inter: int, bits: int, g: torch.Generator):
    """A `_cold_experts` maker: one expert of random codes in moectl's own kernel layout at `bits`."""
    from ..formats.vnni import random_linear

    def make():
        (gu, b1), (dn, b2) = random_linear(2 * inter, hidden, bits, g), random_linear(hidden, inter, bits, g)
        return (gu, dn), b1 + b2
    return make


def cpu_expert_q4_ms(hidden: int, inter: int, group: int = 64, repeat: int = 5) -> tuple[float, int]:
    """(milliseconds, bytes read) of one expert FFN on one token from q4g64 weights through the kernel the runtime
    computes a q4 copy with on this CPU: moectl's own (`moectl/kernels`, int8 activations) where it builds, else
    torch's int4 kernel (`aten._weight_int4pack_mm_for_cpu`: bf16 activations, one bf16 scale and zero per
    `group` weights). Random codes: speed only (the rate the runtime prices a low-bit miss computed on the CPU at)."""
    from .. import kernels

    g = torch.Generator().manual_seed(0)
    if kernels.library() is not None:
        experts, nbytes = _cold_experts(_vnni_expert(hidden, inter, 4, g))
        return _ffn_ms(experts, inter, hidden, 1, repeat, g), nbytes

    def pack(n: int, k: int):                            # an [n, k] weight: packed codes + [k/group, n, 2] scales
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        return (torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2),
                (torch.randn(k // group, n, 2, generator=g) * 0.01).to(torch.bfloat16))
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu

    def make():
        gate_up, down = pack(2 * inter, hidden), pack(hidden, inter)
        return (((lambda x: mm(x, gate_up[0], group, gate_up[1])), (lambda x: mm(x, down[0], group, down[1]))),
                _nbytes(*gate_up, *down))
    experts, nbytes = _cold_experts(make)
    return _ffn_ms(experts, inter, hidden, 1, repeat, g), nbytes


def cpu_expert_q8_ms(hidden: int, inter: int, repeat: int = 5, tokens: int = 1) -> tuple[float, int]:
    """(milliseconds, bytes read) of one expert FFN on `tokens` tokens from q8 weights through the kernel the runtime
    uses on this CPU: moectl's own (q8g64, int8 activations) where it builds, else `Int8Linear` (`formats/int8_cpu.py`:
    torch's int8 kernel, one bf16 scale per output row). Random codes: speed only."""
    from .. import kernels
    from ..formats.int8_cpu import Int8Linear

    g = torch.Generator().manual_seed(0)
    if kernels.library() is not None:
        experts, nbytes = _cold_experts(_vnni_expert(hidden, inter, 8, g))
        return _ffn_ms(experts, inter, hidden, tokens, repeat, g), nbytes

    def linear8(n: int, k: int) -> Int8Linear:
        return Int8Linear(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                          (torch.rand(n, generator=g) * 1e-3).to(torch.bfloat16))

    def make():
        gate_up, down = linear8(2 * inter, hidden), linear8(hidden, inter)
        return (gate_up, down), _nbytes(gate_up.codes, gate_up.scale, down.codes, down.scale)
    experts, nbytes = _cold_experts(make)
    return _ffn_ms(experts, inter, hidden, tokens, repeat, g), nbytes


def copy_gbps(nbytes: int = 256 * 2**20, device: str = "cpu", repeat: int = 5) -> float:
    """Host -> device copy bandwidth: pinned RAM -> GPU on CUDA, a plain memcpy on the CPU."""
    if device.startswith("cuda"):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def run():
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)

        def run():
            dst.copy_(src)
    return nbytes / best_s(run, repeat) / 1e9


def measure(device: str = "cpu", hidden: int = 2048, inter: int = 4096) -> dict:
    """The four figures (GB/s) plus the expert times they came from; about a second on 2 cores."""
    ms = cpu_expert_ms(hidden, inter, torch.bfloat16)
    q4_ms, q4_bytes = cpu_expert_q4_ms(hidden, inter)
    return {"mem_read_gbps": mem_read_gbps(), "cpu_expert_gbps": 3 * hidden * inter * 2 / (ms * 1e-3) / 1e9,
            "cpu_expert_ms": ms, "cpu_lowbit_gbps": q4_bytes / (q4_ms * 1e-3) / 1e9, "cpu_expert_q4_ms": q4_ms,
            "cpu_expert_shape": [hidden, inter], "copy_gbps": copy_gbps(device=device), "device": device}


def _key(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}|{cpu}|torch {torch.__version__}|threads {torch.get_num_threads()}|{device}"


def machine_figures(device: str = "cpu", cache_file: str | Path | None = None, refresh: bool = False) -> dict:
    """`measure(device)`, cached per machine key in `cache_file` (default `$MOECTL_HOME/machine.json`)."""
    from ..core.recipes import moectl_home

    path = Path(cache_file) if cache_file else moectl_home() / "machine.json"
    key = _key(device)
    try:
        cached = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        cached = {}                                   # a damaged cache is measured again, not an error
    if cached.get("format") != FORMAT:
        cached = {"format": FORMAT, "machines": {}}
    if not refresh and key in cached["machines"]:
        return cached["machines"][key] | {"cached": True}
    figs = measure(device)
    cached["machines"][key] = figs
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass                                          # read-only home: measured every start, still correct
    return figs | {"cached": False}


def record_vs_llamacpp(result: dict, cache_file: str | Path | None = None) -> dict:
    """Store `bench/vs_llamacpp.py`'s measured decode rates in machine.json under "vs_llamacpp" (per host, CPU and
    model shape):
    per tool, format and thread count the GB/s a decode token reads (bytes read / time), and that rate as a share
    of the host's read bandwidth measured in the same run. Returns the entry."""
    from ..core.recipes import moectl_home

    path = Path(cache_file) if cache_file else moectl_home() / "machine.json"
    try:
        cached = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        cached = {}
    if cached.get("format") != FORMAT:
        cached = {"format": FORMAT, "machines": {}}
    host = _key("cpu").split("|threads")[0]
    entry = {"shape": result["shape"], "layers": result["layers"], "mem_read_gbps": result["mem_read_gbps"],
             "llamacpp_version": result["llamacpp_version"], "load_average": result["load"][0], "rates": {}}
    for r in result["rows"]:
        key = f"{r['tool']}|{r['format']}|threads {r['threads']}"
        entry["rates"][key] = {"decode_gbps": r["decode_gbps"], "decode_ms": r["decode_ms"]["median"],
                               "share_of_mem_read": r["decode_gbps"] / result["mem_read_gbps"]}
    cached.setdefault("vs_llamacpp", {})[f"{host}|{result['shape']} x {result['layers']} layers"] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cached, indent=1))
    tmp.replace(path)
    return entry


def machine_hardware(figs: dict, layer_overhead_ms: float = 0.02):
    """A `sim/cost.py: Hardware` from measured figures. With no GPU the 'device' is this CPU: its memory
    bandwidth is the host's and a 'copy' is a memcpy."""
    from ..sim.cost import Hardware

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    on_cuda = str(figs.get("device", "cpu")).startswith("cuda")
    # expert GEMV rate on the device: on a CPU-only machine the same measured rate; on CUDA left to the profile's
    # efficiency (mem_efficiency x peak, peak unknown here: 1000 GB/s stands for a current GPU)
    gpu_mem = 1000.0 if on_cuda else figs["cpu_expert_gbps"]
    return Hardware(name=f"measured-{platform.node()}", pcie_gbps=figs["copy_gbps"], gpu_mem_gbps=gpu_mem,
                    gpu_tflops=100.0 if on_cuda else 0.05 * cores, cpu_mem_gbps=figs["cpu_expert_gbps"],
                    cpu_lowbit_gbps=figs.get("cpu_lowbit_gbps"),
                    cpu_cores=cores, mem_efficiency=0.75 if on_cuda else 1.0, flops_efficiency=0.5 if on_cuda else 1.0,
                    layer_overhead_ms=layer_overhead_ms)
