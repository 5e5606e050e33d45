"""`moectl bench --model` runs the moectl rows at the precision asked for (--lowbit/--precision were silently
ignored there before), and the simulator's prediction of the run models that precision and --cpu-experts (the rows
`make gpu-check` compares)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_quantize import mixtral, q4  # noqa: E402,F401  (the fixtures: a tiny Mixtral and its q4g64 copies)

from moectl.benchmark.model import bench_model  # noqa: E402
from moectl.core.cache_model import LOW  # noqa: E402


@pytest.fixture(scope="module")
def model_q4(mixtral, q4):
    return mixtral, q4[0]


def _bench(model_q4, **kw):
    d, wd = model_q4
    return bench_model(str(d), str(wd), "cpu", None, 8, 8, 6, None, 1, "lru", "none", kw.pop("cpu_experts", "never"),
                       "float32", ("lru",), repeat=1, progress=False, **kw)


def test_bench_rows_run_and_predict_at_the_precision_asked_for(model_q4):
    full = _bench(model_q4)
    low = _bench(model_q4, lowbit="q4g64", precision="lowbit-only")
    ours, base = low["runs"]["moectl"], low["runs"]["lru"]
    assert (ours["lowbit"], ours["precision"]) == ("q4g64", "lowbit-only")
    assert (full["runs"]["moectl"]["lowbit"], full["runs"]["moectl"]["precision"]) == (None, "full")
    assert LOW in ours["pools"] and LOW not in base["pools"]          # the baselines stay full precision
    # low-bit misses move fewer bytes than full ones, in the run and in its prediction alike
    assert ours["bytes_per_token"] < full["runs"]["moectl"]["bytes_per_token"]
    assert low["predicted"]["moectl"]["bytes_per_token"] < full["predicted"]["moectl"]["bytes_per_token"]


def test_bench_prediction_models_cpu_experts(model_q4):
    r = _bench(model_q4, cpu_experts="always")
    assert r["runs"]["moectl"]["cpu_experts"] == "always" and r["runs"]["moectl"]["cpu_experts_per_token"] > 0
    # where a decode token's time went: the CPU worker computed (and a layer waited for it at most as long as the
    # expert stages took); the stages are part of the token; one figure per request
    m = r["runs"]["moectl"]
    assert m["cpu_side_ms_per_token"] > 0 and m["cpu_wait_ms_per_token"] <= m["expert_stage_ms_per_token"]
    assert 0 < m["device_side_ms_per_token"] <= m["expert_stage_ms_per_token"] <= m["decode_ms_per_token"]
    assert m["decode_ms_per_token_each"] == [m["decode_ms_per_token"]] and len(m["prefill_ms_each"]) == 1
    never = _bench(model_q4)["runs"]["moectl"]
    assert never["cpu_side_ms_per_token"] == 0 == never["cpu_wait_ms_per_token"]
    # misses computed on the CPU are not copied: neither the run nor its prediction moves expert bytes for them
    assert r["predicted"]["moectl"]["bytes_per_token"] < _bench(model_q4)["predicted"]["moectl"]["bytes_per_token"]
    assert "moectl prediction" not in r["notes"]
