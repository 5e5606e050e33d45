"""Replacement and prefetch policies on hand-made sequences where the right answer is known, Belady's
bound on the shared traces, and gate-reuse on a synthetic hidden-state trace from a tiny Mixtral."""

from __future__ import annotations


import numpy as np
import pytest

from moectl.errors import MoectlError
from moectl.policies import (PREFETCH_NAMES, REPLACEMENT_NAMES, Belady, EAMPrefetch, GateReuse, Hobbit, LFU, LRU,
                             MLPPrefetch, MoEInfinity, Ours, make_prefetch, make_replacement)
from moectl.sim.steps import trace_steps
from moectl.sim.simulator import Simulator
from moectl.artifacts.trace_dir import load_trace
from moectl.core.trace import DECODE, HiddenSamples, Trace

from shared_data import TRACE_FILES, needs_shared


def play(policy, seq, layer=0, cap=2, request_breaks=()):
    """Replay single-expert accesses through one pool of `cap` slots; return the evicted experts in order."""
    resident, evicted = [], []
    for t, e in enumerate(seq):
        if t in request_breaks:
            policy.on_request_start(str(t))
        policy.on_route(layer, [e])
        if e in resident:
            policy.on_hit(layer, e, t)
        else:
            if len(resident) == cap:
                v = policy.victim(layer, [x for x in resident if x != e], t)
                resident.remove(v)
                policy.on_evict(layer, v, t)
                evicted.append(v)
            resident.append(e)
            policy.on_insert(layer, e, t)
        policy.on_token_end(t)
    return evicted


def test_lru_evicts_least_recent():
    assert play(LRU(), [1, 2, 1, 3]) == [2]


def test_lfu_evicts_least_frequent_and_resets_per_request():
    assert play(LFU(), [1, 1, 2, 3]) == [2]          # LRU would evict 1
    # after a new request the counts restart: 2 used once after the break beats 1's stale count
    assert play(LFU(), [1, 1, 2, 2, 3], request_breaks=(3,)) == [1]


def test_hobbit_weights_select_lru_or_lfu_behaviour():
    assert play(Hobbit(4, w_lru=1, w_lfu=0, w_lhu=0, w_fld=0), [1, 1, 2, 3]) == [1]   # pure recency
    assert play(Hobbit(4, w_lru=0, w_lfu=1, w_lhu=0, w_fld=0), [1, 1, 2, 3]) == [2]   # pure frequency


def test_hobbit_high_precision_uses_count_only_when_gate_weight_is_high():
    h = Hobbit(4, w_lru=0, w_lfu=0, w_lhu=1, w_fld=0, t1=0.6)
    h.on_route(0, [1, 2], [0.9, 0.1])     # expert 2's score = 0.9 > t1: a low-precision use
    assert h.H[(0, 1)] == 1 and h.H[(0, 2)] == 0
    assert h.victim(0, [1, 2], 0) == 2


def test_moe_infinity_uses_matched_eam():
    L, E = 2, 4
    past = np.zeros((L, E))
    past[0, 3] = 10                                  # past requests used expert 3 at layer 0 a lot
    past[0, 0] = 5
    m = MoEInfinity(L, E, eamc=[past])
    m.on_route(0, [0])
    # candidates 1, 2, 3: 3 has the highest predicted likelihood, 1 and 2 none -> one of them goes
    assert m.victim(0, [1, 2, 3], 0) in (1, 2)
    assert m.victim(0, [0, 3], 0) == 0               # 0: 5 counts < 3: 10 counts
    # empty collection: the live request's own counts decide
    m2 = MoEInfinity(L, E)
    for e in (2, 2, 1):
        m2.on_route(0, [e])
    assert m2.victim(0, [1, 2], 0) == 1


def test_belady_evicts_farthest_next_use():
    b = Belady()
    future = [[[e]] for e in [1, 2, 3, 1, 2]]        # steps of one layer
    b.set_future(future)
    b.on_token_end(0), b.on_token_end(1)            # now at step 2 (expert 3 arrives)
    assert b.victim(0, [1, 2], 2) == 2              # 1 is used at step 3, 2 at step 4
    assert b.victim(0, [1, 5], 2) == 5              # never used again goes first


def test_ours_keeps_frequent_recent_experts():
    # 1 is used 3 times, then one-off experts stream through: a decayed count keeps 1, LRU would not
    assert 1 not in play(Ours(1, 8, beta=0.0), [1, 1, 1, 2, 3, 4, 1], cap=2)
    assert 1 in play(LRU(), [1, 1, 1, 2, 3, 4, 1], cap=2)


def test_ours_remembers_what_followed_a_matching_token():
    # a loop 1 -> 2 -> 3 -> 1 -> 2: when 1 returns with 2 and 3 resident, 2 followed 1 last time, so 3 goes
    # (Belady's choice); decayed counts alone (beta=0) evict the older 2, as LRU would
    assert play(Ours(1, 8, beta=0.0), [1, 2, 3, 1]) == [1, 2]
    assert play(Ours(1, 8, beta=4.0), [1, 2, 3, 1]) == [1, 3]


def test_registry():
    for name in REPLACEMENT_NAMES:
        assert make_replacement(name, num_layers=4, num_experts=8).name == name
    assert make_prefetch("none").predict(0) == []
    assert set(PREFETCH_NAMES) == {"none", "gate-reuse", "eam", "routing", "mlp", "aux-gate", "oracle"}
    with pytest.raises(MoectlError):
        make_replacement("fifo")
    with pytest.raises(MoectlError, match="predictor"):
        make_prefetch("routing")


def test_eam_prefetch_follows_matched_request():
    L, E = 4, 8
    a, b = np.zeros((L, E)), np.zeros((L, E))
    a[0, 0] = a[1, 1] = a[2, 2] = a[3, 3] = 10        # request type A: experts 0,1,2,3
    b[0, 4] = b[1, 5] = b[2, 6] = b[3, 7] = 10        # type B: 4,5,6,7
    p = EAMPrefetch(L, E, eamc=[a, b], match_k=1, depth=2, per_layer=1)
    p.observe(0, [4])
    got = p.predict(0)
    assert [(l, e) for l, e, _ in got] == [(1, 5), (2, 6)]
    assert got[0][2] > got[1][2]                      # nearer layer scores higher (proximity decay)


def test_mlp_prefetch_accepts_a_predictor_object():
    class Stub:
        def predict_scores(self, layer, hidden):
            assert hidden.shape == (16,)
            return {layer + 1: np.eye(8)[3] + 0.1, layer + 2: np.eye(8)[5], layer + 5: np.eye(8)[0]}

    p = MLPPrefetch(Stub(), depth=2, per_layer=1)
    p.observe(0, [1, 2], None, np.zeros(16, dtype=np.float16))
    assert [(l, e) for l, e, _ in p.predict(0)] == [(1, 3), (2, 5)]
    p.observe(0, [1, 2], None, None)                  # no hidden state, no prediction
    assert p.predict(0) == []


# ----------------------------------------------------------------------------- gate reuse on a tiny Mixtral

@pytest.fixture(scope="module")
def tiny_hidden_trace():
    """A decode-like trace of a tiny random Mixtral with every row's MoE inputs and the router weights,
    captured by forward hooks on the routers."""
    torch = pytest.importorskip("torch")
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
                        pad_token_id=1, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    L, N = cfg.num_hidden_layers, 96
    hid, idx = {}, {}

    def hook(i):
        def f(mod, args, out):
            hid[i], idx[i] = args[0].detach().reshape(-1, 64), out[2].detach().reshape(-1, 2)
        return f

    hs = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.randint(2, 512, (1, N)))
    for h in hs:
        h.remove()
    experts = np.stack([idx[i].numpy() for i in range(L)], 1).astype(np.int16)          # [N, L, K]
    moe_inputs = np.stack([hid[i].numpy() for i in range(L)], 1).astype(np.float16)     # [N, L, D]
    routers = {i: model.model.layers[i].mlp.gate.weight.detach().numpy().copy() for i in range(L)}
    return Trace("tiny-random-mixtral", L, 8, 2, ["r0"] * N, np.arange(N, dtype=np.int32),
                 np.full(N, DECODE, np.uint8), experts,
                 hidden=HiddenSamples(np.arange(N), moe_inputs, np.zeros((N, 64), np.float16)), routers=routers)


def test_gate_reuse_predicts_next_layer_on_tiny_mixtral(tiny_hidden_trace):
    tr = tiny_hidden_trace
    g = GateReuse(tr.routers, depth=1, per_layer=2)
    hit = total = 0
    for r in range(tr.num_tokens):
        for l in range(tr.num_layers - 1):
            g.observe(l, list(tr.experts[r, l]), None, tr.hidden.moe_inputs[r, l])
            pred = {e for _, e, _ in g.predict(l)}
            hit += len(pred & set(tr.experts[r, l + 1].tolist()))
            total += 2
    assert hit / total > 0.5                      # random guessing gets 2/8 = 0.25


def test_gate_reuse_cuts_demand_loads_in_simulation(tiny_hidden_trace):
    from moectl.sim.simulate import capacities, hidden_lookup

    tr = tiny_hidden_trace
    steps, caps = trace_steps(tr), capacities(tr, fraction=0.5)
    none = Simulator(caps, LRU()).run(steps)
    gate = Simulator(caps, LRU(), GateReuse(tr.routers, depth=1, per_layer=2)).run(
        steps, hidden_of=hidden_lookup(tr))
    assert gate["demand_loads_per_token"] < 0.7 * none["demand_loads_per_token"]


# ----------------------------------------------------------------------------- Belady bounds everyone

@needs_shared
@pytest.mark.parametrize("path", TRACE_FILES, ids=lambda p: p.stem)
def test_belady_bounds_every_policy_on_shared_traces(path):
    tr = load_trace(path)
    tr = tr.select(slice(0, min(tr.num_tokens, 128)))        # first 128 rows: keeps the suite fast
    steps = trace_steps(tr)
    for f in (0.25, 0.5):
        caps = [max(tr.top_k, round(f * tr.num_experts))] * tr.num_layers
        bel = Simulator(caps, Belady()).run(steps)["hit_rate"]
        for name in REPLACEMENT_NAMES:
            if name == "belady":
                continue
            pol = make_replacement(name, num_layers=tr.num_layers, num_experts=tr.num_experts)
            assert Simulator(caps, pol).run(steps)["hit_rate"] <= bel + 1e-12, (name, f)
