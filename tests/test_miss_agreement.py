"""Runtime == simulator with the miss decision in play (issue 29): `--cpu-experts auto` (misses computed on the CPU
where the cost model says so, filled into the cache in the background) and `--precision hobbit` (full / low-bit /
skip by rank score, two slot pools). Both call `policies/miss.py: decide_miss`; per layer, phase and pool, the
cache counters of the runtime's run equal the simulator's on the trace it recorded, and so do the CPU experts."""

from __future__ import annotations

import pytest

from moectl.core.cache_model import FULL, LOW, hit_rate
from moectl.sim.cost import FixedCost


class TokenCost(FixedCost):
    """Copies free (so a fill lands before anything else happens, as the CPU's synchronous copy engine makes it);
    a CPU expert costs 0.02 s per token and per full-size byte, a device one 0.05 s: decode misses run on the CPU,
    prefill misses of 3+ tokens are fetched, low-bit ones (fewer bytes) go to the CPU for longer."""

    def cpu_expert_s(self, tokens: int = 1, nbytes: float | None = None, lowbit: bool = False) -> float:
        return 0.02 * tokens * (1.0 if nbytes is None else nbytes / self.expert_bytes)


@pytest.fixture(scope="module")
def quantized(tiny_small, tmp_path_factory):
    from moectl.quant.quantize import quantize_model

    wd = tmp_path_factory.mktemp("agree-q4")
    quantize_model(str(tiny_small), 4, 64, 1, workdir=str(wd), progress=False)
    return tiny_small, wd


@pytest.mark.parametrize("setting", ["cpu-auto", "hobbit", "hobbit+cpu-auto"])
def test_runtime_and_simulator_agree_with_cpu_experts_and_hobbit(quantized, tmp_path, setting):
    import torch

    from moectl.calib.builtin_corpus import builtin_corpus
    from moectl.calib.profile import run_profile
    from moectl.policies import PolicyInputs, build_replacement
    from moectl.policies.placement import ComputePlacement
    from moectl.runtime.engine import Engine
    from moectl.sim.steps import trace_steps
    from moectl.sim.simulator import Simulator
    from moectl.artifacts.trace_dir import load_trace

    torch.set_num_threads(1)
    ckpt, wd = quantized
    cpu, hobbit = "cpu-auto" in setting, "hobbit" in setting
    probe = Engine.load(str(ckpt), emulate_device=True, cache_experts=4, progress=False)
    L, E, full = len(probe.moe_layer_ids), probe.adapter.num_experts, probe.store.expert_nbytes
    cost = TokenCost(load=0.0, attention=0.01, expert=0.05, expert_bytes=full)
    kw = dict(lowbit="q4g64", precision="hobbit", t1=0.3, t2=0.8, workdir=str(wd)) if hobbit else {}
    eng = Engine.load(str(ckpt), emulate_device=True, cache_experts=L * E // 2, replacement="lru", prefetch="none",
                      cpu_experts="auto" if cpu else "never", cost=cost, progress=False, **kw)
    out = tmp_path / "trace"
    run_profile(eng, builtin_corpus("validation")[:3], out, model_name="tiny", dataset="builtin:validation",
                max_tokens=40, generate=12)
    tr = load_trace(out)
    pools = {p: [eng.cache.state.capacity(l, p) for l in range(L)] for p in eng.cache.state.counts}
    nbytes = {p: eng.store.nbytes(p) for p in pools}
    inputs = PolicyInputs(L, E, tr.top_k)
    sim = Simulator(pools, {p: build_replacement("lru", inputs) for p in pools}, None, cost,
                    precision=eng.cache.precision, nbytes=nbytes,
                    placement=ComputePlacement("auto", cost) if cpu else None).run(trace_steps(tr))
    for p in pools:
        got = sim["cache"][p] if len(pools) > 1 else sim["cache"]
        for ph in ("prefill", "decode"):
            want = eng.cache.state.per_layer(ph, p)
            for k in ("hits", "misses", "evictions", "cpu_misses", "fills"):
                assert got[ph][k] == want[k], (p, ph, k)
    decode_tokens = sim["decode_tokens"]
    # the hit rate: a miss computed on the CPU is a miss on both sides (it was a hit rate of 1.0 with every miss
    # there), a fill no use; copies are free here, so the simulator's on-time hits are the cache's hits
    run = {k: sum(eng.cache.state.totals("decode", p)[k] for p in pools) for k in ("hits", "misses", "cpu_misses")}
    assert sim["hit_rate"] == pytest.approx(hit_rate(run)) and sim["cpu_misses"] == run["cpu_misses"]
    if cpu:
        assert eng.runtime.cpu_experts > 0 and eng.cache.stats.fills > 0
        assert sim["fill_copies_per_token"] > 0 and sim["cpu_experts_per_token"] > 0
        assert run["cpu_misses"] == round(sim["cpu_experts_per_token"] * decode_tokens) > 0
        assert sim["hit_rate"] < 1.0
        st = eng.cache.stats.as_dict()        # what generate --json and the status line print
        assert st["misses"] == st["demand_loads"] + st["cpu_misses"] and st["cpu_misses"] >= run["cpu_misses"]
        assert st["hit_rate"] == pytest.approx(st["hits"] / (st["hits"] + st["misses"]))
    if hobbit:               # both precisions missed, as both sides decided (copied in or computed on the CPU)
        assert set(pools) == {FULL, LOW}
        for p in (LOW, FULL):
            c = eng.cache.state.per_layer("decode", p)
            assert sum(c["misses"]) + sum(c["cpu_misses"]) > 0, p
