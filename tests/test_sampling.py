"""runtime/sampling.py (issue 42): the numpy sampling both engines share. The distribution against hand-computed
cases, the nucleus search against a plain full sort, the inverse-CDF draw, seeds, frequencies, greedy ties, the
engine replayed by hand, and that the module imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moectl.runtime.sampling import (Sampling, accept_greedy, accept_sampled, draw, make_rng, sampling_probs,
                                     softmax)

P4 = np.array([0.5, 0.25, 0.15, 0.1])
ORDER = np.array([2, 0, 3, 1])                    # where P4's tokens sit in the vocabulary: not in sorted order


def _logits(p: np.ndarray) -> np.ndarray:
    """Logits [V] whose softmax is p, the tokens scattered by ORDER."""
    out = np.empty(len(p), dtype=np.float32)
    out[ORDER] = np.log(p)
    return out


def _scatter(p: list[float]) -> np.ndarray:
    out = np.zeros(len(p))
    out[ORDER] = p
    return out


@pytest.mark.parametrize("top_p,expected", [
    (1.0, [0.5, 0.25, 0.15, 0.1]),                 # no cut
    (0.7, [2 / 3, 1 / 3, 0, 0]),                   # mass ahead 0, .5 kept; .75 >= .7 cut
    (0.75, [2 / 3, 1 / 3, 0, 0]),                  # the third has exactly .75 ahead: not < .75, cut
    (0.8, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),
    (0.3, [1, 0, 0, 0]),                           # the top token alone reaches it
    (0.0, [1, 0, 0, 0]),                           # the top token always stays
])
def test_nucleus_kept_set_and_renormalisation_by_hand(top_p, expected):
    probs = sampling_probs(_logits(P4), 1.0, top_p)
    assert probs.dtype == np.float32 and probs.shape == (4,)
    np.testing.assert_allclose(probs, _scatter(expected), atol=1e-6, rtol=0)


def test_ties_at_the_nucleus_edge_keep_the_lower_ids():
    """[.2, .4, .2, .2], top-p .5: .4 then one of the three .2s (mass ahead .4 < .5; the next has .6): token 0."""
    logits = np.log(np.array([0.2, 0.4, 0.2, 0.2], dtype=np.float32))
    np.testing.assert_allclose(sampling_probs(logits, 1.0, 0.5), [1 / 3, 2 / 3, 0, 0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(sampling_probs(logits, 1.0, 0.7), [0.25, 0.5, 0.25, 0], atol=1e-6, rtol=0)


def test_temperature_sharpens_by_hand():
    """T = 0.5 squares the probabilities: [.25, .0625, .0225, .01] / .345; top-p .9 then keeps the first two
    (mass ahead of the third: .3125/.345 = .906)."""
    sq = P4 ** 2 / (P4 ** 2).sum()
    np.testing.assert_allclose(sampling_probs(_logits(P4), 0.5, 1.0), _scatter(list(sq)), atol=1e-6, rtol=0)
    np.testing.assert_allclose(sampling_probs(_logits(P4), 0.5, 0.9),
                               _scatter([0.25 / 0.3125, 0.0625 / 0.3125, 0, 0]), atol=1e-6, rtol=0)


def _reference(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The definition with a full sort (what torch's version did): float64 throughout."""
    p = np.exp((logits - logits.max()) / temperature).astype(np.float64)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    sp = p[order]
    keep = np.cumsum(sp) - sp < top_p
    keep[0] = True
    out = np.zeros_like(p)
    out[order[keep]] = sp[keep] / sp[keep].sum()
    return out


@pytest.mark.parametrize("scale,top_p", [(8.0, 0.95), (1.0, 0.95), (0.05, 0.5), (3.0, 0.999)])
def test_nucleus_search_equals_a_full_sort(scale, top_p):
    """Peaked (nucleus inside the first top-256) to flat (thousands kept: the top-k grows 256 -> 2048 -> 16384 ->
    all): the same kept set and the same probabilities as sorting the whole vocabulary."""
    logits = (np.random.default_rng(1).standard_normal(20000) * scale).astype(np.float32)        # [V]
    got, ref = sampling_probs(logits, 0.8, top_p), _reference(logits, 0.8, top_p)
    assert np.array_equal(got > 0, ref > 0)
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=1e-4)
    assert abs(float(got.sum(dtype=np.float64)) - 1.0) < 1e-5


def test_rows_are_independent():
    rows = np.stack([_logits(P4), _logits(P4[::-1].copy()) * 2])             # [2, V]
    both = sampling_probs(rows, 0.8, 0.8)
    for r in range(2):
        np.testing.assert_array_equal(both[r], sampling_probs(rows[r], 0.8, 0.8))


def test_minus_infinity_logits_are_never_drawn():
    logits = np.array([1.0, -np.inf, 0.5, -np.inf], dtype=np.float32)
    probs = sampling_probs(logits, 0.8, 1.0)
    assert probs[1] == probs[3] == 0
    rng = make_rng(0)
    assert {draw(probs, rng) for _ in range(500)} == {0, 2}


class _FixedUniform:
    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("u,token", [(0.0, 1), (0.49, 1), (0.5, 3), (0.74, 3), (0.75, 4), (0.999999, 4)])
def test_draw_is_the_inverse_cdf_of_one_uniform(u, token):
    """Over the tokens with mass, in id order: [0, .5) -> 1, [.5, .75) -> 3, [.75, 1) -> 4 (0 and 2 have none)."""
    probs = np.array([0.0, 0.5, 0.0, 0.25, 0.25], dtype=np.float32)
    assert draw(probs, _FixedUniform(u)) == token


def test_a_seed_draws_the_same_sequence_and_another_seed_another():
    probs = sampling_probs(_logits(P4), 1.0, 1.0)
    seq = [[draw(probs, rng) for _ in range(64)] for rng in (make_rng(7), make_rng(7), make_rng(8))]
    assert seq[0] == seq[1] and seq[0] != seq[2]
    # Sampling(seed=) is that generator: its picks are the draws; a negative seed wraps mod 2**64
    s = Sampling(False, 1.0, 1.0, seed=7)
    assert [s.pick(_logits(P4))[0] for _ in range(64)] == seq[0]
    a, b = Sampling(False, seed=-1), Sampling(False, seed=2**64 - 1)
    assert [a.pick(_logits(P4))[0] for _ in range(32)] == [b.pick(_logits(P4))[0] for _ in range(32)]


def test_draw_frequencies_match_the_probabilities():
    """20000 seeded draws: every token's frequency within 4 standard deviations of its probability (seed 0 is
    fixed, so this is deterministic; the bound is what a correct sampler meets with p > 0.9999 per token)."""
    probs = sampling_probs(_logits(P4), 1.0, 0.8)                    # [.5, .25, .15, 0]/.9 scattered
    rng, n = make_rng(0), 20000
    counts = np.bincount([draw(probs, rng) for _ in range(n)], minlength=4)
    p = probs.astype(np.float64)
    assert counts[p == 0].sum() == 0
    assert np.all(np.abs(counts / n - p) <= 4 * np.sqrt(p * (1 - p) / n))


def test_greedy_is_the_first_argmax_as_torch():
    logits = np.array([1.0, 3.0, 3.0, 0.0], dtype=np.float32)
    s = Sampling(True)
    assert s.pick(logits) == (1, None) == (int(torch.argmax(torch.from_numpy(logits))), None)
    assert Sampling(False, temperature=0.0).pick(logits) == (1, None)          # temperature 0 is greedy
    rows = np.array([[0, 2, 2], [5, 5, 0]], dtype=np.float32)                  # [K+1, V]
    assert accept_greedy([1], rows) == (1, 0) == s.accept([1], rows, None)


def test_sampling_accept_uses_its_generator():
    """accept() draws with the Sampling's own generator: the same seed, the same (accepted, next) sequence as
    accept_sampled on make_rng(seed) with the nucleus probabilities."""
    rows = np.stack([_logits(P4), _logits(P4[::-1].copy())])        # target [K+1=2, V]
    q = sampling_probs(_logits(np.array([0.1, 0.2, 0.3, 0.4])), 1.0, 1.0)[None]   # draft [K=1, V]
    s, rng = Sampling(False, 1.0, 0.9, seed=3), make_rng(3)
    p = sampling_probs(rows, 1.0, 0.9)
    for x in (0, 1, 2, 3) * 8:
        assert s.accept([x], rows, q) == accept_sampled([x], p, q, rng)


def test_the_module_imports_no_torch():
    src = Path(__file__).resolve().parents[1] / "moectl" / "runtime" / "sampling.py"
    names = {a.name for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {"__future__", "numpy", "errors"}, names         # not even in a function (errors: moectl's)
    code = "import sys, moectl.runtime.sampling; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=src.parents[2])
    assert out.stdout.strip() == "[]"


def test_generate_draws_from_sampling_with_its_seed(tiny_small):
    """The engine's sampled tokens are Sampling(seed)'s picks on its logits, step by step (replayed here through
    the same forwards): what a torch-free engine does with the same logits gives the same tokens."""
    from moectl.runtime.engine import Engine
    from moectl.runtime.speculative import as_numpy

    eng = Engine.load(str(tiny_small), progress=False, threads=1)
    prompt = [5, 97, 211, 42, 300, 17, 88, 150]
    kw = dict(greedy=False, temperature=0.8, top_p=0.95, seed=11)
    res = eng.generate(input_ids=prompt, max_new_tokens=8, stop_at_eos=False, **kw)
    s = Sampling(False, 0.8, 0.95, seed=11)
    logits, pkv = eng.forward(torch.tensor([prompt]), last_only=True)
    replay = [s.pick(as_numpy(logits[0, -1]))[0]]
    while len(replay) < 8:
        logits, pkv = eng.forward(torch.tensor([[replay[-1]]]), pkv)
        replay.append(s.pick(as_numpy(logits[0, -1]))[0])
    assert res.token_ids == replay
    assert eng.generate(input_ids=prompt, max_new_tokens=8, stop_at_eos=False, **kw).token_ids == replay


def test_softmax_rows_sum_to_one():
    x = np.random.default_rng(2).standard_normal((3, 151936)).astype(np.float32) * 5      # [rows, V]
    s = softmax(x, 0.8)
    assert s.dtype == np.float32
    np.testing.assert_allclose(s.sum(-1, dtype=np.float64), 1.0, atol=1e-5)


def test_nan_logits_are_one_error_not_a_token():
    from moectl.errors import MoectlError

    logits = np.zeros(8, dtype=np.float32)
    logits[3] = np.nan
    for greedy in (True, False):
        with pytest.raises(MoectlError, match="NaN"):
            Sampling(greedy, 0.8, 0.95, seed=0).pick(logits)
