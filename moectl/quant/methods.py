"""How `moectl quantize` picks each group's scale and zero: `hqq` (HQQ's optimiser) or `rtn` (round to nearest).

Both write the same packed HQQ layout (`HqqFormat`: codes, one scale and one zero per group), so every reader,
kernel and cost figure is the same; only the time to make the copies and their error differ.

- `rtn`: affine round-to-nearest, min/max of each group -> scale and zero (HQQ's `Quantizer.quantize` with
  `optimize=False`). One pass over the weights: a Mixtral expert (3 x 14336 x 4096) in ~5.5 s of one CPU
  core (half of it the dequantise and error sum that give the descriptor's per-layer error).
- `hqq`: HQQ's half-quadratic optimiser refines every zero and scale (20 iterations over the weights): 68-136 s
  of CPU per Mixtral expert (5-10 hours for Mixtral on 2 cores), seconds on a GPU.

The default is `rtn` on a CPU and `hqq` on a GPU: the measured gap between the two on the trained tiny model
(perplexity 274.650 vs 274.638 at q4g64; docs/benchmarks.md, "`moectl quantize` on a CPU") does not pay for
10-25x the CPU time.
"""

from __future__ import annotations

from ..errors import MoectlError

METHODS = ("rtn", "hqq")


def default_method(device: str) -> str:
    return "hqq" if device.startswith("cuda") else "rtn"


def check_method(method: str | None, device: str) -> str:
    """The method to use (`None` = the device's default), or a clear error."""
    if method is None:
        return default_method(device)
    if method not in METHODS:
        raise MoectlError(f"--method {method!r}: choose {' or '.join(METHODS)}")
    return method


def optimize(method: str) -> bool:
    """HQQ's `optimize` flag for `method`."""
    return method == "hqq"
