"""Host memory told honestly: what a configuration needs, what is free, one clear error when it does not fit.

The need is computed before anything is loaded, from the shard headers (bytes per expert, dense bytes):
experts kept in RAM, dense weights and KV reserve when they live on the host, and the cache's host
buffers (CPU slots, or pinned staging buffers for a CUDA disk tier). The free figure is the smaller of
/proc/meminfo MemAvailable and the cgroup's limit minus its non-reclaimable use; MOECTL_FREE_MEMORY_BYTES
overrides it (tests, or to leave room for other work).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.recipes import format_bytes
from ..errors import MoectlError

FREE_ENV = "MOECTL_FREE_MEMORY_BYTES"


@dataclass
class HostNeed:
    """Host RAM one configuration needs, by part (bytes)."""

    dense: int = 0
    experts: int = 0        # experts kept in RAM (--offload ram)
    lowbit: int = 0         # low-bit copies (--lowbit), always in RAM
    cache: int = 0          # cache buffers on the host (CPU slots, pinned staging)
    kv: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.lowbit + self.cache + self.kv

    def parts(self) -> str:
        named = [("dense weights", self.dense), ("experts in RAM", self.experts),
                 ("low-bit copies", self.lowbit), ("cache buffers", self.cache),
                 ("KV reserve", self.kv)]
        return " + ".join(f"{name} {format_bytes(n)}" for name, n in named if n)


def host_need(offload: str, on_host_device: bool, in_place: bool, slots: int, expert_nbytes: int,
              num_experts_total: int, dense: int, kv: int, lowbit_nbytes: int = 0, low_slots: int = 0) -> HostNeed:
    """What stays in host RAM: experts (ram tier), low-bit copies (`lowbit_nbytes` each, always), dense + KV (CPU
    device), slots (CPU device or CUDA staging for the disk tier -- low-bit slots only on a CPU device; none in
    place, where the store itself is what the CPU computes on)."""
    cache = 0 if in_place else slots * expert_nbytes if on_host_device or offload == "disk" else 0
    if on_host_device and not in_place:
        cache += low_slots * lowbit_nbytes
    return HostNeed(dense=dense if on_host_device else 0,
                    experts=num_experts_total * expert_nbytes if offload == "ram" else 0,
                    lowbit=num_experts_total * lowbit_nbytes, cache=cache, kv=kv if on_host_device else 0)


def host_options(free: int, offload: str, on_host: bool, in_place: bool, slots: int, expert_nbytes: int,
                 num_layers: int, num_experts: int, dense: int, kv: int) -> list[str]:
    """Configurations of this model that fit `free` bytes of host RAM, for the not-enough-memory error."""
    out = []
    total = num_layers * num_experts
    if on_host and offload == "ram" and not in_place:
        need = host_need("ram", True, True, 0, expert_nbytes, total, dense, kv).total
        if need <= free:
            out.append(f"drop --emulate-device (experts computed in place: {format_bytes(need)})")
    fixed = host_need("disk", on_host, False, 0, expert_nbytes, total, dense, kv).total
    n = min(total, (free - fixed) // expert_nbytes) if free > fixed else 0
    if n >= num_layers and (offload == "ram" or n < slots):
        need = host_need("disk", on_host, False, int(n), expert_nbytes, total, dense, kv).total
        out.append(f"--offload disk --cache-experts {int(n)} ({format_bytes(need)})")
    return out


def kv_cache_nbytes(config, itemsize: int, tokens: int) -> int:
    """Bytes of a KV cache of `tokens` tokens (K and V, every layer, `itemsize` bytes a value) at the config's shapes."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * tokens * itemsize


def rotary_tables_nbytes(config) -> int:
    """Bytes of the rotary tables a transformers 5 model holds as buffers (`inv_freq` and `original_inv_freq`, fp32,
    half the rotary width each): what a dense part's bytes count besides its weights."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    return 2 * 4 * -(-rotary // 2)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_free() -> int | None:
    """Limit minus non-reclaimable use of this process's memory cgroup (v2 or v1); None if unlimited."""
    for limit_f, usage_f, stat_f, inactive in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        root = Path("/sys/fs/cgroup")
        limit, usage = _read_int(root / limit_f), _read_int(root / usage_f)
        if limit is None or usage is None or limit >= 2**60:
            continue
        reclaimable = 0
        try:
            for line in (root / stat_f).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == inactive:
                    reclaimable = int(v)
        except OSError:
            pass
        return max(0, limit - usage + reclaimable)
    return None


def free_host_bytes() -> tuple[int, str]:
    """(bytes free for a new load, where the figure comes from)."""
    env = os.environ.get(FREE_ENV)
    if env:
        from ..core.recipes import parse_size

        return parse_size(env), FREE_ENV
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    cg = _cgroup_free()
    if avail is None and cg is None:
        return 2**62, "unknown (no /proc/meminfo)"
    if cg is not None and (avail is None or cg < avail):
        return cg, "cgroup memory limit"
    return avail, "MemAvailable"


def check_host_memory(need: HostNeed, what: str, alternatives) -> None:
    """A clear error if `need` exceeds free host memory; `alternatives(free)` lists options that fit."""
    free, source = free_host_bytes()
    if need.total <= free:
        return
    fits = alternatives(free)
    raise MoectlError(f"not enough host memory: {what} needs {format_bytes(need.total)} ({need.parts()}), "
                      f"{format_bytes(free)} is free ({source}). "
                      + (f"Options that fit: {'; '.join(fits)}." if fits else
                         "No configuration of this model fits: free memory or use a machine with more RAM."))


def out_of_memory(what: str, nbytes: int = 0) -> MoectlError:
    free, source = free_host_bytes()
    size = f" ({format_bytes(nbytes)})" if nbytes else ""
    return MoectlError(f"out of memory while {what}{size}; {format_bytes(free)} of host memory is free ({source}). "
                       f"Use --offload disk, or a smaller --cache-experts / --budget")


def host_alloc(make, what: str, nbytes: int = 0):
    """`make()`, with an allocation failure turned into the clear out-of-memory error (never 'corrupt file')."""
    try:
        return make()
    except MemoryError:
        raise out_of_memory(what, nbytes) from None
    except RuntimeError as e:
        if "can't allocate memory" in str(e) or "out of memory" in str(e):
            raise out_of_memory(what, nbytes) from None
        raise


HUGE_PAGE = 2 * 2**20


def advise_huge_pages(t) -> None:
    """Ask Linux for transparent huge pages under a big host buffer (THP 'madvise' mode): 512x fewer page
    faults when it is first written, fewer TLB misses when experts are computed on or copied from it."""
    n = t.numel() * t.element_size()
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + n) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)      # MADV_HUGEPAGE; advisory only


def host_empty(shape, dtype, what: str, pin: bool = False, touch: bool = False):
    """torch.empty on the host (huge pages asked for); `touch` writes every page now, so the memory is paid for
    at start-up and never as page faults on the first use of a slot (pinned pages are resident already)."""
    import torch                        # here: a torch-free run (runtime/graph_engine.py) reads this module too

    def make():
        t = torch.empty(shape, dtype=dtype, pin_memory=pin)
        if not pin:
            advise_huge_pages(t)
        return t.zero_() if touch and not pin else t

    return host_alloc(make, what, math.prod(shape) * dtype.itemsize)


def rss_bytes() -> tuple[int, int]:
    """(resident set size now, peak) of this process, from /proc/self/status (0, 0 where unavailable)."""
    now = peak = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                now = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    return now, peak


def release_freed() -> None:
    """Give the heap's freed pages back to the system (glibc's `malloc_trim`; a no-op elsewhere). A load's
    temporaries (fp32 dequantisation, unpacked codes) are freed into the heap, where they would stay in the RSS
    beside what the run keeps: `inspect`'s load peak counts what is kept plus one step's working set."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
