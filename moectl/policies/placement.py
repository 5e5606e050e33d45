"""Where a missed expert runs: fetched to the device, or computed on the CPU from host RAM (Fiddler,
llama.cpp's `--n-cpu-moe`, HOBBIT's CPU mode). Shared by the runtime and the simulator.

`--cpu-experts auto` compares, per missed expert, the copy (bytes of the precision served / host->device
bandwidth) plus its compute on the device with its compute on the CPU (bytes read at host memory bandwidth,
or FLOPs at CPU speed for many tokens), both from the same cost model (`moectl/sim/cost.py`); `never` always
fetches, `always` always computes on the CPU.

No device code; the cost model supplies `load_s(nbytes)`, `expert_s(tokens)` and `cpu_expert_s(tokens, nbytes, lowbit)`.
"""

from __future__ import annotations

from ..errors import MoectlError

FETCH, CPU = "fetch", "cpu"
CPU_EXPERT_MODES = ("auto", "never", "always")


class ComputePlacement:
    def __init__(self, mode: str = "never", cost=None):
        if mode not in CPU_EXPERT_MODES:
            raise MoectlError(f"unknown --cpu-experts {mode!r}; choose one of {', '.join(CPU_EXPERT_MODES)}")
        if mode == "auto" and cost is None:
            raise MoectlError("--cpu-experts auto needs a cost model (hardware profile or measured machine)")
        self.mode, self.cost = mode, cost

    def decide(self, tokens: int = 1, nbytes: float | None = None, lowbit: bool = False) -> str:
        """FETCH or CPU for one missed expert applied to `tokens` tokens, `nbytes` the copy's size (`lowbit`: a
        low-bit copy, which the CPU computes at its own measured rate)."""
        if self.mode != "auto":
            return CPU if self.mode == "always" else FETCH
        fetch = self.cost.load_s(nbytes) + self.cost.expert_s(tokens)
        return CPU if self.cost.cpu_expert_s(tokens, nbytes, lowbit) < fetch else FETCH

    def describe(self) -> str:
        return f"cpu experts: {self.mode}"
