"""The CPU-experts worker (Fiddler / llama.cpp --n-cpu-moe): missed experts the placement (`--cpu-experts`) sends
to the CPU are computed there from their host copies on one worker thread, while the main thread fetches and
computes the device's experts; then, as the simulator does, a CPU miss may be filled into the cache while the copy
engine idles. Which misses go there is the shared miss decision (`policies/miss.py: decide_miss`)."""

from __future__ import annotations

import time

import torch

from ..core.cache_model import FULL
from ..policies.miss import decide_miss
from ..policies.placement import CPU, LayerQueue
from ..policies.precision import LOW, SKIP


class CpuWorker:
    """Mixed into the runtime's shared state (`driver.Runtime`): the placement, the worker thread, its timers."""

    def init_worker(self) -> None:
        self.placement = None               # ComputePlacement: a missed expert fetched or computed on the CPU
        self._cpu_pool = None               # the CPU-experts worker thread
        self._host_views: dict = {}
        self.cpu_experts = 0                # experts computed on the CPU (missed, placed there)
        self.cpu_side_s = 0.0               # time the worker spent computing CPU experts
        self.cpu_wait_s = 0.0               # time a layer waited for the worker after its own side was done

    def cpu_side(self, layer: int, plan: dict[int, str], tokens: dict[int, int]) -> list[tuple[int, str]]:
        """The missed experts the placement computes on the CPU instead of fetching: (expert, precision) for each
        entry of the layer's precision `plan` ({e: FULL|LOW|SKIP}) that is not resident, priced at the bytes of the
        copy the plan chose (a low-bit miss reads its packed copy; `moectl-q4` is all low-bit misses). A full-precision
        miss needs the RAM tier (the disk tier keeps no host copy to compute from); low-bit copies are always in RAM."""
        cache = self.cache
        if self.placement is None or self.placement.mode == "never" or cache.in_place or torch.is_grad_enabled():
            return []
        store, out, queue = cache.store, [], LayerQueue()
        for e, p in plan.items():
            held = p if p != SKIP and cache.contains(layer, e, p) else None
            where, _ = decide_miss(held, p, self.placement, tokens.get(e, 1), store.nbytes(p) if p != SKIP else None,
                                   host_copy=p == LOW or store.buffers is not None, queue=queue)
            if where == CPU:
                out.append((e, p))
        return out

    def host_views(self, layer: int, expert: int, precision: str = FULL) -> dict:
        key = (layer, expert, precision)
        if key not in self._host_views:
            store = self.cache.store
            self._host_views[key] = store.format_of(precision, layer).views(store.host(layer, expert, precision))  # no copy
        return self._host_views[key]

    def cpu_forward(self, w: dict, x: torch.Tensor, apply_gate) -> torch.Tensor:
        """One expert on the CPU: x [t,H] from the device, the weights in host RAM, y back on x's device."""
        return self.adapter.expert_forward(w, x.to("cpu"), apply_gate).to(x.device)

    def start_cpu(self, layer: int, experts: list[tuple[int, str]], compute, gate):
        """Run `compute(e, expert)` for `experts` [(expert, precision)] on the CPU worker thread from their host
        copies; torch ops release the GIL, so it runs while this thread fetches and computes the device's experts.
        A low-bit copy is computed as the store holds it: q4 axis-1 copies in torch's int4 CPU kernel layout
        (`formats/int4_cpu.py`, no dequantisation), others dequantised here."""
        from concurrent.futures import ThreadPoolExecutor

        if self._cpu_pool is None:
            self._cpu_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moectl-cpu-experts")
        inference = torch.is_inference_mode_enabled()
        self.cpu_experts += len(experts)
        fmt = self.cache.store.format_of

        def work() -> float:
            t0 = time.perf_counter()
            with torch.inference_mode(inference):
                for e, p in experts:
                    w = fmt(p, layer).weights(self.host_views(layer, e, p))
                    compute(e, lambda x, w=w: self.cpu_forward(w, x, gate))
            return time.perf_counter() - t0
        return self._cpu_pool.submit(work)

    def finish_cpu(self, fut) -> None:
        t0 = time.perf_counter()
        self.cpu_side_s += fut.result()
        self.cpu_wait_s += time.perf_counter() - t0

    def fill(self, layer: int, on_cpu: list[tuple[int, str]]) -> None:
        """The simulator's fill rule: a miss the CPU computed is copied into the cache in the background, only
        while the copy engine has nothing committed (a fill never delays a demand load or a prefetch; one at a
        time). Without it a cache whose misses all run on the CPU would never change after the prompt."""
        cache = self.cache
        for e, p in on_cpu:
            if cache.backlog_bytes() > 0:
                break
            if not cache.contains(layer, e, p):
                cache.fill(layer, e, p)
