"""Where a missed expert runs: fetched to the device, or computed on the CPU from host RAM (Fiddler,
llama.cpp's `--n-cpu-moe`, HOBBIT's CPU mode). Shared by the runtime and the simulator.

`--cpu-experts auto` sends each missed expert of a layer to the side that finishes it first: the copy engine
(bytes of the precision served / host->device bandwidth, behind the layer's earlier fetches, then its compute on the
device) or the CPU (bytes read at host memory bandwidth, or FLOPs at CPU speed for many tokens, behind the layer's
earlier CPU experts): list scheduling over a `LayerQueue`, one per layer and step, both sides from the same cost
model (`moectl/sim/cost.py`). Priced alone, each of a layer's misses looked cheaper on the CPU whenever one was,
so all of them queued on the CPU while the copy engine idled (q4 misses of Mixtral: 19.3 ms/token with auto against
17.0 with never, simulated at half the experts). `never` always fetches, `always` always computes on the CPU.

No device code; the cost model supplies `load_s(nbytes)`, `expert_s(tokens)` and `cpu_expert_s(tokens, nbytes, lowbit)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MoectlError

FETCH, CPU = "fetch", "cpu"
CPU_EXPERT_MODES = ("auto", "never", "always")


@dataclass
class LayerQueue:
    """What one layer's placement decisions have queued so far on each side (seconds)."""
    copy_s: float = 0.0                     # demand copies, serial on the copy engine
    cpu_s: float = 0.0                      # CPU experts, serial on the worker


class ComputePlacement:
    def __init__(self, mode: str = "never", cost=None):
        if mode not in CPU_EXPERT_MODES:
            raise MoectlError(f"unknown --cpu-experts {mode!r}; choose one of {', '.join(CPU_EXPERT_MODES)}")
        if mode == "auto" and cost is None:
            raise MoectlError("--cpu-experts auto needs a cost model (hardware profile or measured machine)")
        self.mode, self.cost = mode, cost

    def decide(self, tokens: int = 1, nbytes: float | None = None, lowbit: bool = False,
               queue: LayerQueue | None = None) -> str:
        """FETCH or CPU for one missed expert applied to `tokens` tokens, `nbytes` the copy's size (`lowbit`: a
        low-bit copy, which the CPU computes at its own measured rate); `queue`: the layer's earlier decisions
        (updated with this one), None: priced alone."""
        if self.mode != "auto":
            return CPU if self.mode == "always" else FETCH
        q = queue if queue is not None else LayerQueue()
        copy = self.cost.load_s(nbytes)
        cpu = self.cost.cpu_expert_s(tokens, nbytes, lowbit)
        if q.cpu_s + cpu < q.copy_s + copy + self.cost.expert_s(tokens, nbytes):
            q.cpu_s += cpu
            return CPU
        q.copy_s += copy
        return FETCH

    def describe(self) -> str:
        return f"cpu experts: {self.mode}"
