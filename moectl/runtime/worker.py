"""The CPU-experts worker (Fiddler / llama.cpp --n-cpu-moe): one thread that computes missed experts from their host
copies while the layer's own thread fetches and computes the device's experts.

Which misses go there is the layer's miss decision (`offloaded.py: OffloadedExperts._place`, through
`policies/miss.py: decide_miss`); the layer starts them here (`start`) before its device side and waits for them
(`finish`) after it. torch ops release the GIL, so the two sides overlap. The worker is a member of the layers'
shared state (`Runtime.cpu`); it counts nothing itself: `finish` returns its times, the layer books them.
"""

from __future__ import annotations

import time

import torch

from ..core.cache_model import FULL


class CpuWorker:
    def __init__(self, adapter, store):
        self.adapter, self.store = adapter, store
        self._pool = None                   # the thread, started on first use
        self._host_views: dict = {}         # (layer, expert, precision) -> typed views of its host buffer

    def host_views(self, layer: int, expert: int, precision: str = FULL) -> dict:
        key = (layer, expert, precision)
        if key not in self._host_views:
            store = self.store
            self._host_views[key] = store.format_of(precision, layer).views(store.host(layer, expert, precision))  # no copy
        return self._host_views[key]

    def forward(self, w: dict, x: torch.Tensor, apply_gate) -> torch.Tensor:
        """One expert on the CPU: x [t,H] from the device, the weights in host RAM, y back on x's device."""
        return self.adapter.expert_forward(w, x.to("cpu"), apply_gate).to(x.device)

    def start(self, layer: int, experts: list[tuple[int, str]], compute, apply_gate):
        """Run `compute(e, expert)` for `experts` [(expert, precision)] on the worker thread from their host copies
        (`expert(x [t,H]) -> y [t,H]`). A low-bit copy is computed as the store holds it: q4 axis-1 copies in torch's
        int4 CPU kernel layout (`formats/int4_cpu.py`, no dequantisation), others dequantised here. Returns the
        future `finish` takes."""
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moectl-cpu-experts")
        inference = torch.is_inference_mode_enabled()
        fmt = self.store.format_of

        def work() -> float:
            t0 = time.perf_counter()
            with torch.inference_mode(inference):
                for e, p in experts:
                    f = fmt(p, layer)        # a GGUF's: ggml on the host copy's own blocks (formats/gguf.py)
                    w = getattr(f, "cpu_weights", f.weights)(self.host_views(layer, e, p))
                    compute(e, lambda x, w=w: self.forward(w, x, apply_gate))
            return time.perf_counter() - t0
        return self._pool.submit(work)

    def finish(self, fut) -> tuple[float, float]:
        """Wait for a started side: (seconds the worker computed, seconds this thread waited for it)."""
        t0 = time.perf_counter()
        busy = fut.result()
        return busy, time.perf_counter() - t0
