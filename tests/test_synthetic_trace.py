"""Synthetic routing traces (`moectl trace synthesize`, moectl/synth/trace.py): fitted statistics reproduced,
carried across shapes as documented, deterministic per seed, bad input one error line.

Legend: L = MoE layers, E = experts, K = top-k.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moectl.errors import MoectlError
from moectl.sim.simulate import capacities, cost_for, simulate
from moectl.synth.trace import SYNTHETIC_FORMAT_VERSION, RoutingStats, fit_stats, synthesize
from moectl.artifacts.trace_dir import load_trace

from shared_data import SHARED_TRACES, needs_shared
from test_bad_input import assert_one_error, run_cli

MATH = SHARED_TRACES / "gptoss.math.jsonl"


def top_quarter(s: RoutingStats) -> np.ndarray:
    """[L] share of the routing the top 25 % of a layer's experts take."""
    return s.shares[:, : s.num_experts // 4].sum(1)


@pytest.fixture(scope="module")
def math_fit():
    real = load_trace(MATH)
    fitted = fit_stats(real)
    return real, fitted, synthesize(fitted, 512, seed=1, model=real.model)


@needs_shared
def test_same_shape_reproduces_popularity_and_reuse(math_fit):
    real, want, syn = math_fit
    got = fit_stats(syn)
    assert (syn.num_layers, syn.num_experts, syn.top_k) == (24, 32, 4) and syn.num_tokens == 512
    assert "synthetic" in syn.source and "gpt-oss-20b" in syn.source
    assert abs(got.reuse.mean() - want.reuse.mean()) < 0.02               # 0.423 in the real trace
    assert np.abs(got.reuse - want.reuse).mean() < 0.04                    # per layer (0.18 .. 0.59 in the real one)
    assert abs(got.reuse_far.mean() - want.reuse_far.mean()) < 0.03
    assert np.abs(top_quarter(got) - top_quarter(want)).mean() < 0.04      # popularity skew, per layer
    assert np.abs(got.shares - want.shares).sum(1).mean() < 0.2           # whole sorted distribution (L1)
    # a generator without reuse would sit at chance (0.23 here), one without skew at top share 0.25
    assert got.reuse.mean() > want.chance_reuse().mean() + 0.15 and top_quarter(got).mean() > 0.5


@needs_shared
def test_same_shape_lru_hit_rate_close_to_the_real_trace(math_fit):
    """What the scoreboard depends on: the simulated LRU hit rate at 25 % cached matches the real trace's."""
    real, _, syn = math_fit

    def hit(t):
        cost = cost_for(t, "rtx4090-pcie4")
        return simulate(t, capacities(t, fraction=0.25), "lru", "none", cost, belady=False).hit_rate

    assert abs(hit(syn) - hit(real)) < 0.05                                 # real 0.615


@needs_shared
def test_scaled_statistics_keep_skew_and_stickiness(math_fit):
    _, src, _ = math_fit
    same = src.scaled(24, 32, 4)
    np.testing.assert_allclose(same.shares, src.shares, atol=1e-4)         # only unused experts get MIN_SHARE
    np.testing.assert_allclose(same.reuse, src.reuse, atol=1e-3)
    big = src.scaled(36, 128, 4)
    assert big.shares.shape == (36, 128) and np.allclose(big.shares.sum(1), 1)
    assert (np.diff(big.shares, axis=1) <= 1e-12).all()                   # still sorted high to low
    assert abs(top_quarter(big).mean() - top_quarter(src).mean()) < 0.02   # skew over rank fraction kept
    r0, r0b = src.chance_reuse().mean(), big.chance_reuse().mean()
    assert r0b < r0 / 2                                                     # chance repeats are rarer at 128 experts
    stick = lambda s: ((s.reuse - s.chance_reuse()) / (1 - s.chance_reuse())).mean()
    assert abs(stick(big) - stick(src)) < 0.02                              # the stickiness is what carries over
    assert big.reuse[0] == pytest.approx(src.scaled(36, 128, 4).reuse[0])  # first layer maps to the first


@needs_shared
def test_deterministic_for_a_seed(math_fit):
    _, fitted, syn = math_fit
    small = fitted.scaled(6, 32, 4)
    a, b = synthesize(small, 40, seed=3), synthesize(small, 40, seed=3)
    np.testing.assert_array_equal(a.experts, b.experts)
    assert not np.array_equal(a.experts, synthesize(small, 40, seed=4).experts)
    ex = syn.experts.astype(int)
    assert (ex >= 0).all() and (ex < 32).all() and (np.diff(ex, axis=2) > 0).all()   # K distinct ids, sorted


@needs_shared
def test_cli_writes_a_trace_at_the_recipe_shape(tmp_path, capsys, monkeypatch):
    out = tmp_path / "t.jsonl"
    code, stdout, err = run_cli(["trace", "synthesize", "--like", str(MATH), "--model", "gpt-oss-120b", "--tokens",
                                 "64", "--requests", "2", "--seed", "5", "--out", str(out), "--json"], capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(stdout)
    t = load_trace(out)
    assert (t.num_layers, t.num_experts, t.top_k, t.num_tokens) == (36, 128, 4, 64) == \
        (info["layers"], info["experts"], info["top_k"], info["tokens"])
    assert t.model == "openai/gpt-oss-120b" and t.source.startswith("synthetic")
    assert t.extra["synthetic"]["seed"] == 5 and len(t.request_slices()) == 2
    head = json.loads(out.read_text().splitlines()[0])                       # says what it is on its first line
    assert head["format"] == "moe-routing-v1" and head["synthetic"]["format_version"] == SYNTHETIC_FORMAT_VERSION
    assert (head["num_layers"], head["num_experts"], head["top_k"]) == (36, 128, 4)
    assert head["source"].startswith("synthetic") and "gpt-oss-20b" in head["synthetic"]["fitted_on"]
    assert info["target"]["reuse"] < info["like"]["reuse"]                 # less chance reuse at 128 experts
    d = tmp_path / "dir"
    code, _, err = run_cli(["trace", "synthesize", "--like", str(MATH), "--model", "gpt-oss-120b", "--tokens", "64",
                            "--requests", "2", "--seed", "5", "--out", str(d)], capsys, monkeypatch)
    assert code == 0, err
    np.testing.assert_array_equal(load_trace(d).experts, t.experts)         # same seed, either format


def test_bad_shapes_are_errors():
    s = RoutingStats(2, 8, 2, np.full((2, 8), 1 / 8), np.full(2, 0.4), np.full(2, 0.3))
    for shape in ((2, 4, 4), (2, 4, 5), (0, 8, 2), (2, 8, 0)):
        with pytest.raises(MoectlError, match="top-k|>= 1"):
            s.scaled(*shape)
    with pytest.raises(MoectlError, match="tokens"):
        synthesize(s, 1)


@needs_shared
@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model"], "no recipe 'no-such-model'"),
    (["--model", "gpt-oss-120b", "--tokens", "1"], "tokens >= 2"),
    (["--model", "gpt-oss-120b", "--tokens", "4", "--requests", "5"], "requests"),
    (["--model", "gpt-oss-120b", "--like", "/no/such.jsonl"], "does not exist"),
    (["--model", "gpt-oss-120b", "--out", "/proc/no-such/t.jsonl"], "cannot write the trace"),
])
def test_cli_bad_input(args, needle, tmp_path, capsys, monkeypatch):
    like = [] if "--like" in args else ["--like", str(MATH)]
    out = [] if "--out" in args else ["--out", str(tmp_path / "t.jsonl")]
    code, _, err = run_cli(["trace", "synthesize", *like, *args, *out], capsys, monkeypatch)
    assert_one_error(code, err, needle)
