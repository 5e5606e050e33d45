"""How the next token is picked, and how drafted ones are accepted: numpy only, so a torch-free engine and the torch
engine pick the same tokens from the same logits and seed (this module imports no torch, not even in a function;
tests/test_sampling.py checks it in a subprocess).

Legend: V = vocabulary, K = tokens drafted in a speculative pass.

Callers hand in numpy float32 logits. A torch caller converts once first: `logits.float().cpu().numpy()`
(`speculative.as_numpy` does it, and passes numpy through).

The distribution (`sampling_probs`): softmax(logits / temperature), cut to the top-p nucleus (the smallest set of the
most likely tokens whose mass reaches top_p; the top token always stays), renormalised. Probabilities are float32
[V], like the logits: exp in float32 (after subtracting the max, every term is in (0, 1], no underflow that matters
for sampling), but every sum and the cumulative sums a draw searches are float64, so 152k terms add up without a
float32 drift of up to ~1% at the tail of a cumulative sum. The nucleus is found by sorting values, not indices: the
largest k (np.partition; k = 256, then x8, then all) until their mass reaches top_p (`_nucleus`): exact, and many
times cheaper than torch's full argsort. Ties are broken by token id (the lower first), as torch.argmax does for
greedy, so the kept set does not depend on a sort's tie order (nor on the CPU's SIMD sort).

The generator is numpy's PCG64 seeded with `seed mod 2**64` (a negative seed wraps, as torch.Generator's did); a draw
is one uniform number searched in the float64 cumulative sum of the distribution (inverse CDF), so a seed gives the
same tokens on any machine and either engine.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023; speculative.py's docstring has the loop): draft i is
accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order; at the first rejection the token is drawn from the
residual norm(max(0, p_i - q_i)); when all K are accepted a bonus token is drawn from p_K. Each emitted token is then
distributed exactly as p (`token_distribution`).
"""

from __future__ import annotations

import numpy as np

from ..errors import MoectlError

_FIRST_TOP_K = 256     # the nucleus search's first top-k (a peaked next-token distribution's nucleus fits)
_GROW = 8              # how much the top-k grows when its mass is short of top_p


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax(logits / temperature) over the last axis, float32 [..., V] (sums in float64)."""
    x = np.asarray(logits, dtype=np.float32)
    e = np.exp((x - x.max(-1, keepdims=True)) / np.float32(temperature))
    return (e / e.sum(-1, keepdims=True, dtype=np.float64)).astype(np.float32)


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """p [V] cut to its top-p nucleus and renormalised (float32 [V]).

    Only the probabilities' values are sorted (no argsort: a value sort is several times cheaper), and only the
    largest k of them while their mass falls short of top_p. The kept count n follows from the values alone (ties
    have equal mass, so the mass ahead of each rank does not depend on how ties are ordered); the kept set is then
    every token above the n-th value t, and of the tokens equal to t the lowest ids, to make n."""
    V = p.shape[-1]
    k = min(V, _FIRST_TOP_K)
    while True:
        top = np.partition(p, V - k)[V - k:] if k < V else p                 # [k] the k largest values
        sorted_p = np.sort(top)[::-1].astype(np.float64)                     # [k] largest first
        mass = np.cumsum(sorted_p)                                            # [k] mass up to each rank
        # a token outside the top k has at least mass[-1] ahead of it: when that reaches top_p it is cut
        if mass[-1] >= top_p or k == V:
            break
        k = V if k * _GROW > V // 4 else k * _GROW                           # a full value sort is cheap
    n = max(1, int(np.searchsorted(mass - sorted_p, top_p, side="left")))   # ranks with less than top_p ahead
    t = np.float32(sorted_p[n - 1])
    keep = p > t                                                              # [V]
    keep[np.flatnonzero(p == t)[:n - int(keep.sum())]] = True                # ties at the edge: the lower ids
    return np.where(keep, p / np.float32(mass[n - 1]), np.float32(0)).astype(np.float32)


def sampling_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The distribution [..., V] sampling draws from: softmax(logits / temperature), cut to the top-p nucleus."""
    probs = softmax(logits, temperature)
    if top_p >= 1.0:
        return probs
    if probs.ndim == 1:
        return _nucleus(probs, top_p)
    rows = probs.reshape(-1, probs.shape[-1])
    return np.stack([_nucleus(r, top_p) for r in rows]).reshape(probs.shape)


def make_rng(seed: int | None) -> np.random.Generator:
    """The generator of a sampled generation: PCG64 of `seed mod 2**64`, or fresh entropy when seed is None."""
    return np.random.Generator(np.random.PCG64(None if seed is None else int(seed) % 2**64))


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a distribution [V] (need not sum to exactly 1): one uniform number, inverse CDF over the tokens
    with mass (a token of probability 0 is never drawn)."""
    support = np.flatnonzero(probs)                                  # [S] the tokens with mass
    cdf = np.cumsum(probs[support], dtype=np.float64)                # [S]
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(support[min(i, len(support) - 1)])                  # (u * total rounding up to total: the last)


def accept_probability(p: np.ndarray, q: np.ndarray, x: int) -> float:
    """min(1, p(x) / q(x)) for a draft x sampled from q (so q(x) > 0)."""
    return min(1.0, float(p[x]) / float(q[x])) if float(q[x]) > 0 else 0.0


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)) [V]: what a rejection draws from. (p == q never rejects; p is returned for safety.)"""
    r = np.maximum(np.asarray(p, dtype=np.float64) - q, 0.0)
    total = float(r.sum())
    return r / total if total > 0 else np.asarray(p, dtype=np.float64)


def token_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The exact distribution [V] of the token emitted at one position: draw x ~ q, keep it with min(1, p/q),
    else draw from the residual. Equal to p for every q (the tests check it on constructed cases)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    keep = np.where(q > 0, np.minimum(q, p), 0.0)                    # q(x) min(1, p(x)/q(x))
    return keep + (1.0 - keep.sum()) * residual(p, q)


def accept_greedy(drafts: list[int], target_logits: np.ndarray) -> tuple[int, int]:
    """(accepted drafts, the token that follows them) for greedy decoding; `target_logits` [K+1,V]."""
    best = np.argmax(target_logits, axis=-1).tolist()                # [K+1]
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def accept_sampled(drafts: list[int], p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """(accepted drafts, the token that follows them) by speculative sampling; p [K+1,V] target, q [K,V] draft."""
    for i, x in enumerate(drafts):
        if rng.random() >= accept_probability(p[i], q[i], x):
            return i, draw(residual(p[i], q[i]), rng)
    return len(drafts), draw(p[len(drafts)], rng)                    # every draft accepted: a bonus token


class Sampling:
    """How a generation picks tokens: greedy (argmax of the float32 logits, the first on ties), or temperature +
    top-p drawn with a PCG64 generator seeded by `seed`. `pick(logits [V])` -> (token, the distribution [V] it was
    drawn from, or None when greedy). Logits are numpy float32 (a torch caller: `logits.float().cpu().numpy()`)."""

    def __init__(self, greedy: bool, temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None):
        self.greedy = greedy or temperature <= 0
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self._rng = None

    @property
    def rng(self) -> np.random.Generator:
        """The generator, made at its first draw: a greedy run draws nothing and never imports numpy.random (~15 ms
        of a torch-free `generate -n 1`, docs/gguf.md "stop 54"). Seeded, its draws are the same whenever it is
        made."""
        if self._rng is None:
            self._rng = make_rng(self.seed)
        return self._rng

    def probs(self, logits: np.ndarray) -> np.ndarray:
        return sampling_probs(logits, self.temperature, self.top_p)

    def pick(self, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
        if np.isnan(logits).any():              # a broken forward: no token is right (torch's multinomial raised)
            raise MoectlError("the model's logits hold NaN (a broken forward or weights): no token to pick")
        if self.greedy:
            return int(np.argmax(logits)), None
        probs = self.probs(logits)
        return draw(probs, self.rng), probs

    def accept(self, drafts: list[int], target_logits: np.ndarray, q: np.ndarray | None) -> tuple[int, int]:
        """(accepted drafts, the next token) of a verification pass; `target_logits` [K+1,V], q [K,V] (None when
        greedy)."""
        if self.greedy:
            return accept_greedy(drafts, target_logits)
        return accept_sampled(drafts, self.probs(target_logits), q, self.rng)
