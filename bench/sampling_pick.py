"""One decode token's pick on a 151936-token vocabulary (Qwen's): numpy `runtime/sampling.py` against the torch
sampling it replaced (issue 42), greedy and sampled (temperature 0.8, top-p 0.95: moectl's default).

The torch side is the old code, kept here as the reference: `logits.float().cpu()`, then argmax, or softmax, a full
descending sort, the cumulative-sum cut, a scatter back and torch.multinomial with a seeded torch.Generator. The
numpy side is what the engine runs now: `as_numpy(logits)` (the one conversion) then `Sampling.pick`. Both start
from the same torch float32 logits [V] on the CPU, one thread each.

Logits: standard normal x scale, so the nucleus holds from a few tokens (scale 12, a peaked next-token guess) to
most of the vocabulary (scale 0.5, a flat one: the worst case for the nucleus search). Each row is the median ms of
`--repeat` picks; "+ms" is numpy minus torch (negative: numpy is cheaper).

Usage (a quiet machine):  python bench/sampling_pick.py [--repeat 200] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from moectl.runtime.sampling import Sampling
from moectl.runtime.speculative import as_numpy


def torch_pick(logits: torch.Tensor, greedy: bool, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """The sampling moectl ran before sampling.py (speculative.py's Sampling.pick, torch)."""
    logits = logits.float().cpu()
    if greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    keep = torch.cumsum(sorted_p, -1) - sorted_p < top_p
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)
    probs = probs / probs.sum(-1, keepdim=True)
    return int(torch.multinomial(probs, 1, generator=gen))


def median_ms(fn, repeat: int) -> float:
    fn()                                                           # warm: first-call allocations
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=200, help="picks timed per row (the median is printed)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size V")
    a = ap.parse_args()
    torch.set_num_threads(1)                                       # a pick runs on the decode thread
    print(f"{'pick':<22}{'nucleus':>9}{'torch ms':>11}{'numpy ms':>11}{'+ms':>9}")
    for name, greedy, scale in (("greedy", True, 3.0), ("sampled, peaked", False, 12.0),
                                ("sampled, normal", False, 3.0), ("sampled, flat", False, 0.5)):
        logits = torch.from_numpy((np.random.default_rng(0).standard_normal(a.vocab) * scale).astype(np.float32))
        s, gen = Sampling(greedy, 0.8, 0.95, seed=0), torch.Generator().manual_seed(0)
        nucleus = "-" if greedy else str(int((s.probs(as_numpy(logits)) > 0).sum()))
        t_torch = median_ms(lambda: torch_pick(logits, greedy, 0.8, 0.95, gen), a.repeat)
        t_numpy = median_ms(lambda: s.pick(as_numpy(logits)), a.repeat)
        print(f"{name:<22}{nucleus:>9}{t_torch:>11.3f}{t_numpy:>11.3f}{t_numpy - t_torch:>+9.3f}")


if __name__ == "__main__":
    main()
