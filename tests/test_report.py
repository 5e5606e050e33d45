"""`moectl report`: plots are real PNGs, Belady >= LRU, and the numbers are right on hand-made traces.

Legend: N = tokens, L = MoE layers, K = top-k, E = experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moectl.calib.report import analyze, hit_rates, reuse_stats, usage_entropy
from moectl.policies.base import LRU
from moectl.core.trace import Trace

from shared_data import SHARED_TRACES, needs_shared  # noqa: E402

OLMOE = SHARED_TRACES / "olmoe.math.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _trace(ids: list[list[int]], requests: list[str] | None = None, E: int = 3) -> Trace:
    """One-layer trace: ids[t] = experts of token t."""
    N, K = len(ids), max(len(i) for i in ids)
    ex = np.full((N, 1, K), -1, np.int16)
    for t, i in enumerate(ids):
        ex[t, 0, :len(i)] = i
    return Trace("toy", 1, E, K, requests or ["a"] * N, np.arange(N, dtype=np.int32), np.ones(N, np.uint8), ex)


@needs_shared
def test_report_on_olmoe_writes_pngs_and_belady_beats_lru_everywhere(cli, tmp_path):
    r = cli(["report", "--traces", str(OLMOE), "--out", str(tmp_path / "rep"), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert set(s["plots"]) == {"usage_heatmap", "reuse_distance", "hit_rate"}
    for path in s["plots"].values():
        data = Path(path).read_bytes()
        assert Path(path).parent == tmp_path / "rep" and data[:8] == PNG_MAGIC and len(data) > 5000
    assert s["tokens"] == 512 and s["requests"] == 1 and s["layers"] == 16 and s["experts"] == 64
    assert s["cache_sizes"][0] == 8 and s["cache_sizes"][-1] == 64
    lru, bel = np.array(s["lru_hit_rate_per_layer"]), np.array(s["belady_hit_rate_per_layer"])
    assert (bel >= lru - 1e-12).all()                                    # MIN is the limit, at every size and layer
    assert (np.array(s["belady_hit_rate"]) > np.array(s["lru_hit_rate"])).any()
    assert np.all(np.diff(s["lru_hit_rate"]) >= -1e-9) and np.all(np.diff(s["belady_hit_rate"]) >= -1e-9)
    # a full cache misses only each expert's first use
    first_use = (1 - s["reuse_within_request"] - s["reuse_across_requests"])
    assert s["belady_hit_rate"][-1] == pytest.approx(1 - first_use, abs=1e-3)
    assert all(0 < h < 6 for h in s["entropy_bits"]) and s["entropy_max_bits"] == 6.0


def test_hit_rates_by_hand():
    t = _trace([[0], [1], [2], [0], [1], [2]])                 # cyclic: LRU's worst case
    from moectl.policies import Belady as _belady

    assert hit_rates(t, LRU, [1, 2, 3]).tolist() == [[0.0, 0.0, 0.5]]
    # MIN with 2 slots: miss 0, 1, 2 (evicts 1, used last), hit 0, miss 1 (evicts 0), hit 2
    assert hit_rates(t, _belady, [1, 2, 3]).tolist() == [[0.0, 2 / 6, 0.5]]


def test_current_token_experts_are_never_evicted():
    t = _trace([[0, 1], [2, 0], [1, 2]], E=3)
    # pool of 2 = K. Token 1 needs 2 and 0: 2 misses and 1 (not 0, the LRU one) must go, so 0 hits;
    # token 2 needs 1 and 2: 1 misses, evicts 0, 2 hits. Plain LRU without pinning would evict 0 and hit nothing.
    assert hit_rates(t, LRU, [2]).tolist() == [[2 / 6]]


def test_reuse_within_and_across_requests_and_entropy():
    t = _trace([[0], [0], [1], [0], [1], [2]], requests=["a", "a", "a", "b", "b", "b"])
    r = reuse_stats(t)
    # a: 0 cold, 0 within (distance 1), 1 cold; b: 0 across, 1 across, 2 cold
    assert (r["within"].tolist(), r["across"].tolist(), r["cold"].tolist()) == ([1], [2], [3])
    assert r["distances"].tolist() == [1]
    assert usage_entropy(np.array([[2, 2, 0, 0], [1, 1, 1, 1]])).tolist() == [1.0, 2.0]
    a = analyze(t)
    assert a["cache_sizes"] == [1, 2, 3] and a["requests"] == 2 and a["top_expert_share"][0] == 0.5


def test_report_errors_are_clear(cli, tmp_path):
    r = cli(["report", "--traces", str(tmp_path / "missing.jsonl")])
    assert r.exit_code != 0 and "does not exist" in str(r.exception)
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"format": "moe-routing-v1", "model": "m", "num_layers": 1, "num_experts": 3, "top_k": 1}\n'
                   '{"request": "a", "pos": 0, "phase": "decode", "experts": [[0]]}\n')
    r = cli(["report", "--traces", str(bad), "--cache-sizes", "0,9"])
    assert r.exit_code != 0 and "cache sizes must be between" in str(r.exception)
    r = cli(["report", "--traces", str(bad), "--phase", "prefill"])
    assert r.exit_code != 0 and "no prefill tokens" in str(r.exception)
