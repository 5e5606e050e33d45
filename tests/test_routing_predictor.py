"""The routing-only predictor beats a frequency baseline on held-out traces, round-trips through its
config/state_dict, and cuts demand loads in the simulator when used for prefetch."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from moectl.policies import LRU, RoutingPrefetch
from moectl.predictors.routing import RoutingPredictor, multi_hot, train_routing_predictor
from moectl.sim.steps import trace_steps
from moectl.sim.simulator import Simulator
from moectl.artifacts.trace_dir import load_trace
from moectl.core.trace import DECODE, Trace

from shared_data import SHARED_TRACES as SHARED, needs_shared  # noqa: E402
L, E, K = 8, 16, 2


def synthetic(seed: int, n: int = 300, types: int = 24) -> Trace:
    """A 'model' where each token type has a fixed routing path (shared across traces: same table seed), and
    text that often repeats recent tokens: the structure real decode routing has (token identity + locality)."""
    table = np.random.default_rng(123)
    paths = np.stack([np.stack([table.choice(E, K, replace=False) for _ in range(L)]) for _ in range(types)])
    rng = np.random.default_rng(seed)
    seq = []
    for i in range(n):
        seq.append(seq[-rng.integers(1, 6)] if len(seq) > 6 and rng.random() < 0.6 else int(rng.integers(types)))
    ex = paths[seq].astype(np.int16)                                   # [N, L, K]
    return Trace("synthetic", L, E, K, ["r"] * n, np.arange(n, dtype=np.int32), np.full(n, DECODE, np.uint8), ex)


def held_out_recall(pred: RoutingPredictor, test: Trace, train: list[Trace], d: int = 1) -> tuple[float, float]:
    """Top-K recall at lookahead d of the predictor and of the training-popularity baseline on `test`."""
    pop = sum(multi_hot(t).sum(0) for t in train)                      # [L, E]
    st, k = pred.new_state(), test.top_k
    got = base = total = 0
    for r in range(test.num_tokens):
        for l in range(test.num_layers):
            st.observe(l, test.experts[r, l])
            if l + d < test.num_layers:
                truth = set(test.experts[r, l + d].tolist())
                p = pred.predict(st, d)
                got += len(truth & set(np.argsort(-p)[:k].tolist()))
                base += len(truth & set(np.argsort(-pop[l + d])[:k].tolist()))
                total += len(truth)
        st.end_token()
    return got / total, base / total


@pytest.fixture(scope="module")
def trained():
    train = synthetic(1)
    pred, metrics = train_routing_predictor([train], lookahead=[1, 2], epochs=4)
    return pred, metrics, train


def test_beats_frequency_baseline_on_held_out_synthetic(trained):
    pred, metrics, train = trained
    test = synthetic(2)
    for d in (1, 2):
        rec, freq = held_out_recall(pred, test, [train], d)
        assert rec > freq + 0.25, (d, rec, freq)
    m = metrics["lookahead"]["1"]
    assert m["recall"] > m["recall_popularity"]


def test_config_state_dict_round_trip(trained):
    pred, _, train = trained
    again = RoutingPredictor.from_config(pred.config())
    again.load_state_dict({k: v.clone() for k, v in pred.state_dict().items()})
    assert all(v.dtype == torch.float32 for v in pred.state_dict().values())
    s1, s2 = pred.new_state(), again.new_state()
    for l in range(3):
        s1.observe(l, train.experts[0, l]), s2.observe(l, train.experts[0, l])
    np.testing.assert_allclose(pred.predict(s1, 1), again.predict(s2, 1), rtol=1e-6)
    assert pred.predict(s1, L) is None                                 # past the last layer


def test_routing_prefetch_cuts_demand_loads(trained):
    pred, _, _ = trained
    test = synthetic(3)
    steps, caps = trace_steps(test), [4] * L
    none = Simulator(caps, LRU()).run(steps)
    pf = Simulator(caps, LRU(), RoutingPrefetch(pred, per_layer=K, min_score=0.3)).run(steps)
    assert pf["demand_loads_per_token"] < 0.75 * none["demand_loads_per_token"]


@needs_shared
def test_beats_frequency_on_real_traces_of_another_prompt():
    train = load_trace(SHARED / "olmoe.math.jsonl").select(slice(0, 192))
    test = load_trace(SHARED / "olmoe.code.jsonl").select(slice(0, 96))
    pred, _ = train_routing_predictor([train], lookahead=[1], epochs=2)
    rec, freq = held_out_recall(pred, test, [train], 1)
    assert rec > freq + 0.1, (rec, freq)
