"""Runtime == simulator at `--precision lowbit-only` with prefetch on (issue 29): no full-precision pool on either
side (`sizing.split_pools` gives every byte to low-bit slots), so predictions copy low-bit copies into the low-bit
pool or into low-bit staging buffers, fills of CPU-computed misses go there too, and the admission gate prices a
low-bit copy. The same scripted predictions (right ones at 0.95, a wrong one at 0.05) run through the runtime on an
emulated device and through the simulator on the trace it recorded; per layer and phase the cache counters agree.

Legend: L = MoE layers, E = experts."""

from __future__ import annotations

import pytest

from moectl.core.cache_model import LOW
from moectl.sim.cost import FixedCost


@pytest.fixture(scope="module")
def q4(tiny_small, tmp_path_factory):
    from moectl.quant.quantize import quantize_model

    wd = tmp_path_factory.mktemp("lowbit-only-q4")
    quantize_model(str(tiny_small), 4, 64, 1, workdir=str(wd), progress=False)
    return tiny_small, wd


class CpuCost(FixedCost):
    """Copies cheap (1 ms a full expert), layers slow (1 s): admission's arithmetic admits by confidence alone; a CPU
    expert costs 4 ms per token, so with --cpu-experts auto a layer's first decode miss runs on the CPU (a q4 copy +
    its device compute: about 9 ms), a second one behind it (8 ms) too, a third is fetched."""

    def cpu_expert_s(self, tokens: int = 1, nbytes: float | None = None, lowbit: bool = False) -> float:
        return 0.004 * tokens


def _load(ckpt, wd, **kw):
    from moectl.runtime.engine import Engine

    kw = {"emulate_device": True} | kw if "cache_experts" in kw else kw        # else in place, the reference
    return Engine.load(str(ckpt), progress=False, threads=1, workdir=str(wd), lowbit="q4g64",
                       precision="lowbit-only", **kw)


# --cpu-experts auto is checked without prefetch: with it, the emulated device's synchronous copy engine runs a
# prefetch only when its expert is used, so the fill rule ("the copy engine has nothing committed") sees a backlog
# the simulator's engine, running beside compute, has finished; that holds at full precision too (not a
# lowbit-only matter) and on CUDA, where copies run in the background, it does not arise.
@pytest.mark.parametrize("staging, admission, cpu", [(2, "off", "never"), (2, "on", "never"), (0, "off", "never"),
                                                     (0, "off", "auto")])
def test_runtime_and_simulator_agree_at_lowbit_only_with_prefetch(q4, tmp_path, staging, admission, cpu):
    import torch

    from moectl.calib.builtin_corpus import builtin_corpus
    from moectl.calib.profile import run_profile
    from moectl.policies import LRU
    from moectl.policies.admission import make_admission
    from moectl.policies.placement import ComputePlacement
    from moectl.setting.pools import precision_pools
    from moectl.sim.steps import trace_steps
    from moectl.sim.simulator import Simulator
    from moectl.artifacts.trace_dir import load_trace
    from moectl.core.trace import PREFILL
    from test_runtime_admission import Scripted

    torch.set_num_threads(1)
    ckpt, wd = q4
    texts = builtin_corpus("validation")[:3]
    probe = _load(ckpt, wd, cache_experts=4, prefetch="none")
    L, E, full = len(probe.moe_layer_ids), probe.adapter.num_experts, probe.store.expert_nbytes
    low = probe.store.nbytes(LOW)
    cost = CpuCost(load=0.001, attention=1.0, expert=0.03, expert_bytes=full)
    n = L * E // 8                                                  # full experts' bytes: a quarter of E in q4

    def profile(prefetch, out):
        eng = _load(ckpt, wd, cache_experts=n, prefetch=prefetch, admission=admission, cost=cost, staging=staging,
                    cpu_experts=cpu)
        run_profile(eng, texts, out, model_name="tiny", dataset="builtin:validation", max_tokens=40, generate=12)
        return eng, load_trace(out)

    _, tr0 = profile("none", tmp_path / "none")
    decode = [r for r in range(len(tr0.phase)) if tr0.phase[r] != PREFILL]
    future = [(l, sorted(int(e) for e in tr0.experts[r, l] if e >= 0)) for r in decode for l in range(L)]
    predict = cpu == "never"                                        # see above
    eng, tr = profile(Scripted(future, L, E) if predict else "none", tmp_path / "scripted")
    assert (tr.experts == tr0.experts).all()                        # prefetch never changes the routing
    state = eng.cache.state
    # one sizing: the runtime's pools are the simulator's split of the same bytes, and have no full-precision pool
    pools = {p: [state.capacity(l, p) for l in range(L)] for p in state.counts}
    assert pools == precision_pools([n // L] * L, eng.cache.precision, full, low, E)
    assert list(pools) == [LOW] and eng.cache.pf_precision == LOW and state.staging == staging
    sim = Simulator(pools, {LOW: LRU()}, Scripted(future, L, E) if predict else None, cost, precision=eng.cache.precision,
                    nbytes={"full": full, LOW: low}, staging=staging,
                    placement=ComputePlacement("auto", cost) if cpu != "never" else None,
                    admission=make_admission(admission, cost, tr.top_k, cpu_experts=cpu, staged=staging > 0)
                    ).run(trace_steps(tr))
    for ph in ("prefill", "decode"):
        want = state.per_layer(ph, LOW)
        for k in ("prefetches", "hits", "misses", "evictions", "cpu_misses", "fills"):
            assert sim["cache"][ph][k] == want[k], (ph, k)
    dec = state.per_layer("decode", LOW)
    if predict:                                     # low-bit copies were prefetched, and used
        assert sum(dec["prefetches"]) > 0 and sum(dec["prefetch_used"]) > 0
    if cpu != "never":
        assert eng.runtime.cpu_experts > 0 and eng.cache.stats.fills > 0
        assert sim["cpu_experts_per_token"] > 0
    st = eng.cache.snapshot()
    assert st["full_misses"] == 0 and st["low_misses"] > 0


def test_lowbit_only_streams_prefill_misses_through_low_bit_staging_buffers(q4):
    """`--prefill stream` at lowbit-only: a prefill's misses stream through two staging buffers of low-bit size
    (nothing enters the cache, each one a low-bit miss), and the tokens equal the q4 experts computed in place."""
    import torch

    torch.set_num_threads(1)
    ckpt, wd = q4
    want = _load(ckpt, wd, prefetch="none").generate("The cache keeps", max_new_tokens=6, stop_at_eos=False)
    eng = _load(ckpt, wd, cache_experts=2, prefetch="none", prefill="stream")
    cache = eng.cache
    assert cache.streaming and list(cache.state.counts) == [LOW]
    assert tuple(cache.stage_bufs.shape) == (2, eng.store.nbytes(LOW))          # two low-bit staging buffers
    got = eng.generate("The cache keeps", max_new_tokens=6, stop_at_eos=False)
    pre = cache.state.per_layer("prefill", LOW)
    assert sum(pre["misses"]) > 0 and sum(pre["evictions"]) == 0                # streamed: nothing evicted
    assert got.token_ids == want.token_ids


def test_live_views_count_the_low_bit_pool(q4):
    """serve's cache page and /metrics (runtime/live_view.py) at lowbit-only: the low-bit slots and their hits, not the
    absent full pool's zeros."""
    from moectl.runtime.live_view import layer_hits, residency

    ckpt, wd = q4
    eng = _load(ckpt, wd, emulate_device=True, cache_experts=8, prefetch="none", cpu_experts="never")
    eng.generate(input_ids=[5, 9, 13, 2, 7], max_new_tokens=6, stop_at_eos=False)
    rows, res = layer_hits(eng.cache), residency(eng.cache)
    low = [eng.cache.state.capacity(layer, "low") for layer in range(eng.cache.state.num_layers)]
    assert eng.cache.precisions == ["low"] and sum(low) > 0
    assert [r["slots"] for r in res] == low
    assert all(set(r["resident"].values()) <= {"q4g64"} for r in res) and any(r["resident"] for r in res)
    stats = eng.cache.stats.as_dict()
    assert sum(r["hits"] for r in rows) == stats["hits"] and sum(r["misses"] for r in rows) == stats["misses"] > 0
