"""The fast runtime's mechanics on CPU: one copy engine (demand overtakes queued prefetch), compute order,
CPU compute of misses by cost (lossless either way), the CPU side running concurrently, forced routing."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_factory import build_family  # noqa: E402
from test_runtime import LOSSLESS_ATOL, _engine_run, _reference_run, assert_runs_as_transformers  # noqa: E402

from moectl.errors import MoectlError  # noqa: E402
from moectl.runtime.engine import Engine  # noqa: E402
from moectl.runtime.loader import DEMAND, PREFETCH, CopyJob, Loader  # noqa: E402
from moectl.sim.cost import FixedCost  # noqa: E402


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    d = tmp_path_factory.mktemp("speed") / "mixtral"
    build_family("mixtral", d)
    return d


def _job(expert: int, priority: int, ran: list, delay: float = 0.0) -> CopyJob:
    def run(job, i, name):
        time.sleep(delay)
        ran.append((job.expert, name))
    return CopyJob(0, expert, expert, priority, [(n, lambda j, i, n=n: run(j, i, n)) for n in ("gate_up", "down")])


def test_demand_load_overtakes_queued_prefetches_synchronously():
    ran: list = []
    loader = Loader()                                       # the CPU mode: nothing runs until someone waits
    p1, p2 = loader.submit(_job(1, PREFETCH, ran)), loader.submit(_job(2, PREFETCH, ran))
    d = loader.submit(_job(3, DEMAND, ran))
    assert ran == []
    loader.wait(d)
    assert ran == [(3, "gate_up"), (3, "down")]             # both queued prefetches passed
    loader.wait(p2, chunk=0)                                # a prefetch needed now is promoted ahead of p1
    assert ran[2:] == [(2, "gate_up")]
    loader.cancel(p1)                                       # its slot is reused: it never runs
    loader.drain()
    assert ran[3:] == [(2, "down")] and p1.done == 0 and p1.finished


def test_threaded_demand_waits_one_chunk_then_overtakes():
    ran: list = []
    loader = Loader(threaded=True)
    started = threading.Event()

    def first(job, i, name):
        started.set()
        time.sleep(0.05)
        ran.append((job.expert, name))
    p1 = CopyJob(0, 1, 1, PREFETCH, [(n, lambda j, i, n=n: first(j, i, n)) for n in ("gate_up", "down")])
    loader.submit(p1)
    assert started.wait(5)                                  # p1's first chunk is in flight
    loader.submit(_job(2, PREFETCH, ran, 0.01))
    d = loader.submit(_job(3, DEMAND, ran, 0.01))
    loader.wait(d)
    loader.drain()
    loader.close()
    # the chunk in flight finished; then the demand load; then the rest of p1 (queued first), then p2
    assert ran == [(1, "gate_up"), (3, "gate_up"), (3, "down"), (1, "down"), (2, "gate_up"), (2, "down")]


def test_compute_order_landed_then_in_flight_then_demand(mixtral):
    eng = Engine.load(str(mixtral), cache_experts=16, emulate_device=True, progress=False)   # 4 slots per layer
    cache, layer = eng.cache, 1
    cache.loader.keep_log = True
    cache.pin(layer, [5])
    cache.acquire(layer, 5)["down"]                        # landed
    cache.unpin(layer, [5])
    assert cache.prefetch(layer, 3)                         # queued on the copy engine
    module = eng.adapter.moe_blocks(eng.model)[layer][1].experts
    order = []

    def compute(e, expert):
        order.append(e)
        expert(torch.zeros(1, eng.config.hidden_size))     # reads the weights: waits for their copy
    with torch.inference_mode():
        module._each_expert({0: "full", 3: "full", 5: "full"}, compute)
    assert order == [5, 3, 0]
    # the demand load of 0 was queued (by acquire) after the prefetch of 3, yet ran first on the copy engine
    assert [e for (l, e, _) in cache.loader.log if l == layer] == [5, 5, 0, 0, 3, 3]
    assert cache.landing(layer, 0) == cache.landing(layer, 3) == 0


def test_chunk_cap_cuts_matrices_into_row_ranges_and_stays_bit_identical(mixtral):
    prompt = torch.randint(2, 512, (1, 6), generator=torch.Generator().manual_seed(8))
    want = _engine_run(Engine.load(str(mixtral), cache_experts=8, emulate_device=True, progress=False), prompt, 4)
    eng = Engine.load(str(mixtral), cache_experts=8, emulate_device=True, progress=False)
    cache = eng.cache
    cache.chunk_bytes = 4096                                 # a gate_up matrix [256, 64] fp32 is 64 KiB: 16 chunks
    cache.loader.keep_log = True
    got = _engine_run(eng, prompt, 4)
    assert got[1] == want[1] and all(torch.equal(a, b) for a, b in zip(got[0], want[0]))     # bit-identical
    first = [c for l, e, c in cache.loader.log if (l, e) == cache.loader.log[0][:2]]
    rows = cache.format.views(cache.pool[0][0])["gate_up"].shape[0]
    assert [c for c in first if c.startswith("gate_up")] == [f"gate_up[{r}:{r + rows // 16}]"
                                                             for r in range(0, rows, rows // 16)]
    for l in range(len(cache.pool)):                        # every slot holds its expert's bytes exactly
        for e in cache.resident(l):
            assert torch.equal(cache.slot_bytes(l, e), cache.store.host(l, e))


def test_threaded_demand_load_waits_one_chunk_behind_a_started_prefetch_which_keeps_its_progress(mixtral):
    eng = Engine.load(str(mixtral), cache_experts=16, emulate_device=True, progress=False)
    cache, layer = eng.cache, 1
    cache.chunk_bytes = 16384                               # gate_up 4 chunks, down 2
    cache.loader = loader = Loader(threaded=True)
    loader.keep_log = True
    started, go, run_one = threading.Event(), threading.Event(), loader._run_one

    def held_first_chunk(job, i):                           # the prefetch's first chunk stays in flight until told
        if job.prefetch and i == 0:
            started.set()
            assert go.wait(5)
        return run_one(job, i)
    loader._run_one = held_first_chunk
    assert cache.prefetch(layer, 3)
    assert started.wait(5)
    cache.pin(layer, [0])
    weights = cache.acquire(layer, 0)                       # a demand load queued behind that chunk
    go.set()
    weights["down"]
    loader.drain()
    loader.close()
    order = [(e, c) for l, e, c in loader.log if l == layer]
    n = len(order) // 2                                     # 6 chunks each
    # one chunk of the prefetch, then all of the demand load, then the prefetch's other chunks (none run twice)
    assert [e for e, _ in order] == [3] + [0] * n + [3] * (n - 1)
    assert [c for e, c in order if e == 3] == [c for e, c in order if e == 0]
    assert cache.landing(layer, 3) == cache.landing(layer, 0) == 0


@pytest.mark.parametrize("load_s, expect_cpu", [(1.0, True), (1e-4, False)])
def test_cost_model_picks_cpu_when_fetch_is_slow_and_stays_lossless(mixtral, load_s, expect_cpu):
    prompt = torch.randint(2, 512, (1, 7), generator=torch.Generator().manual_seed(4))
    ref_logits, ref_ids = _reference_run(mixtral, prompt, 6)
    cost = FixedCost(load=load_s, expert=1e-3, cpu_expert=0.01)
    eng = Engine.load(str(mixtral), cache_experts=4, emulate_device=True, cpu_experts="auto", cost=cost,
                      progress=False)
    logits, ids = _engine_run(eng, prompt, 6)
    assert ids == ref_ids
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)) <= LOSSLESS_ATOL
    st = eng.cache.snapshot()
    if expect_cpu:               # every miss computed from host RAM; the cache only takes fills (no demand load)
        assert eng.runtime.cpu_experts == st["cpu_misses"] == st["misses"] > 0 and st["demand_loads"] == 0
        assert st["fills"] > 0
    else:
        assert eng.runtime.cpu_experts == 0 and st["misses"] > 0


class _EveryOther:
    """A placement sending every other missed expert to the CPU (half the misses)."""
    mode = "auto"

    def __init__(self):
        self.n = 0

    def decide(self, tokens=1, nbytes=None, lowbit=False, queue=None):
        self.n += 1
        return "cpu" if self.n % 2 else "fetch"


class Spans:
    """(start, end) of every call of the sides it wraps: what ran when, to tell concurrent work from serial."""

    def __init__(self):
        self.spans = {"device": [], "cpu": []}

    def wrap(self, side: str, fn, sleep_s: float):
        def timed(*args):
            t = time.perf_counter()
            time.sleep(sleep_s)                            # a slow side: the thread waits, as on a copy or a GEMV
            out = fn(*args)
            self.spans[side].append((t, time.perf_counter()))
            return out
        return timed

    def overlapped_cpu_s(self) -> float:
        """Seconds of CPU-side calls during which a device-side call ran too (0 when the two sides ran one after the
        other, whatever the machine's load)."""
        total = 0.0
        for a0, a1 in self.spans["cpu"]:
            cuts = sorted((max(a0, b0), min(a1, b1)) for b0, b1 in self.spans["device"] if b0 < a1 and a0 < b1)
            end = a0
            for c0, c1 in cuts:                            # the union of the device calls inside this CPU call
                total += max(0.0, c1 - max(c0, end))
                end = max(end, c1)
        return total

    def cpu_s(self) -> float:
        return sum(b - a for a, b in self.spans["cpu"])


def test_cpu_side_runs_concurrently_with_the_device_side(mixtral, monkeypatch):
    """Issue 18's overlap: a placement sending every other miss to the CPU, a fake slow device copy (4 ms a weight
    matrix) and a slow CPU expert (6 ms): the CPU side's experts run while the device side copies (their calls
    overlap in time: a serial runtime would overlap them never), and the output is the lossless one."""
    prompt = torch.randint(2, 512, (1, 5), generator=torch.Generator().manual_seed(5))
    want = _engine_run(Engine.load(str(mixtral), progress=False), prompt, 8)
    eng = Engine.load(str(mixtral), cache_experts=4, emulate_device=True, progress=False)
    eng.runtime.placement = _EveryOther()
    rt, loader = eng.runtime, eng.cache.loader
    spans = Spans()
    monkeypatch.setattr(loader, "_run_one", spans.wrap("device", loader._run_one, 0.004))
    monkeypatch.setattr(rt.cpu, "forward", spans.wrap("cpu", rt.cpu.forward, 0.006))
    logits, pkv, step = [], None, prompt
    out, pkv = eng.forward(step, pkv)
    logits.append(out[0])
    step = out[:, -1:].argmax(-1)
    for _ in range(8):
        out, pkv = eng.forward(step, pkv)
        logits.append(out[0])
        step = out[:, -1:].argmax(-1)
    assert rt.cpu_experts > 8 and eng.cache.snapshot()["misses"] > 8              # both sides had work
    # the two sides ran at the same time: a good share of the CPU side's time had a device copy running beside it
    assert spans.overlapped_cpu_s() > 0.25 * spans.cpu_s(), (spans.overlapped_cpu_s(), spans.cpu_s())
    assert [int(x[-1].argmax()) for x in logits] == want[1][:9]
    assert max((a - b).abs().max().item() for a, b in zip(logits, want[0])) <= LOSSLESS_ATOL


def test_replay_trace_forces_the_routing(mixtral, tmp_path):
    from moectl.artifacts.routing_jsonl import write_jsonl
    from moectl.core.trace import DECODE, PREFILL, Trace

    N, L, E = 9, 4, 8
    rng = np.random.default_rng(0)
    # the model's shape: a deeper trace is refused unless the model is a make-synthetic prefix (test_newcomer.py)
    ex = np.stack([np.stack([rng.choice(E, 2, replace=False) for _ in range(L)]) for _ in range(N)])
    tr = Trace("test", L, E, 2, ["r"] * N, np.arange(N, dtype=np.int32),
               np.array([PREFILL] * 4 + [DECODE] * 5, dtype=np.uint8), ex.astype(np.int16))
    path = write_jsonl(tr, tmp_path / "t.jsonl")
    eng = Engine.load(str(mixtral), cache_experts=8, emulate_device=True, replay_trace=str(path), progress=False)
    seen = {}

    class Obs:
        def on_route(self, layer, idx, w, hidden):
            seen.setdefault(layer, []).append(idx.tolist())
            assert torch.allclose(w.sum(-1), torch.ones(idx.shape[0]))
    eng.add_observer(Obs())
    _engine_run(eng, torch.tensor([[3, 4, 5, 6]]), 5)                 # 4 prefill rows, 5 decode rows
    for l in range(L):
        rows = [r for step in seen[l] for r in step]
        assert [sorted(r) for r in rows] == [sorted(r) for r in ex[:, l].tolist()]
    with pytest.raises(MoectlError, match="16 experts"):
        tr16 = Trace("x", L, 16, 2, ["r"], np.zeros(1, np.int32), np.zeros(1, np.uint8), np.zeros((1, L, 2), np.int16))
        Engine.load(str(mixtral), replay_trace=tr16, progress=False)


def test_threads_default_and_override(mixtral):
    from moectl.setting.threads import default_threads

    assert default_threads(64, 128) == 1                                # dispatch bound: one thread
    assert default_threads(4096, 14336) >= 1
    # driving a GPU leaves one core to the launching thread, from 4 cores up
    for cores, cpu_only, gpu in ((16, 16, 15), (4, 4, 3), (2, 2, 2), (1, 1, 1)):
        with mock.patch("os.sched_getaffinity", return_value=set(range(cores))):
            assert default_threads(4096, 14336) == cpu_only
            assert default_threads(4096, 14336, drives_gpu=True) == gpu
            assert default_threads(64, 128, drives_gpu=True) == 1
    eng = Engine.load(str(mixtral), threads=2, progress=False)
    assert eng.threads == 2 and torch.get_num_threads() == 2
    eng = Engine.load(str(mixtral), progress=False)
    assert eng.threads == 1 and torch.get_num_threads() == 1
    with pytest.raises(MoectlError, match="--threads"):
        Engine.load(str(mixtral), threads=0, progress=False)


def test_machine_figures_are_cached_per_machine(tmp_path, monkeypatch):
    from moectl.runtime import machine

    calls = []
    monkeypatch.setattr(machine, "measure", lambda device: calls.append(device) or
                        {"mem_read_gbps": 10.0, "cpu_expert_gbps": 4.0, "cpu_lowbit_gbps": 3.0, "copy_gbps": 6.0,
                         "device": device})
    a = machine.machine_figures("cpu", tmp_path / "m.json")
    b = machine.machine_figures("cpu", tmp_path / "m.json")
    assert calls == ["cpu"] and not a["cached"] and b["cached"] and b["cpu_expert_gbps"] == 4.0
    hw = machine.machine_hardware(b)
    assert hw.pcie_gbps == 6.0 and hw.cpu_mem_gbps == 4.0 and hw.cpu_lowbit_gbps == 3.0


def test_make_synthetic_writes_a_loadable_checkpoint_shard_by_shard(tmp_path, monkeypatch):
    import json as _json

    import yaml

    from moectl.commands.make_synthetic import make_synthetic

    shape = {"num_layers": 4, "moe_layers": 4, "hidden_size": 64, "intermediate_size": 96, "num_experts": 8,
             "top_k": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
             "dtype": "float32"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"name": "small", "family": "mixtral", "shape": shape}))
    made = []
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: made.append(a[0]) or randn(*a, **k))
    make_synthetic(shape=str(tmp_path / "s.yaml"), out=str(tmp_path / "ck"), layers=2, dtype=None, seed=0,
                   as_json=False)
    monkeypatch.undo()
    files = sorted(p.name for p in (tmp_path / "ck").glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]      # head shard + one per layer
    assert max(np.prod(s) for s in made) == 300 * 64                                 # one tensor at a time
    cfg = _json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["intermediate_size"] == 96
    assert_runs_as_transformers(tmp_path / "ck", torch.tensor([[5, 6, 7, 8]]), 3, cache_experts=2, emulate_device=True)
    with pytest.raises(MoectlError, match="not empty"):
        make_synthetic(shape=str(tmp_path / "s.yaml"), out=str(tmp_path / "ck"), layers=1, dtype=None, seed=0,
                       as_json=True)


def bench_workdir(tmp_path, monkeypatch):
    """A workdir with a plan (slots [3, 5]) and fixed machine figures, for `bench --model`."""
    import yaml

    from moectl.runtime import machine

    monkeypatch.setattr(machine, "measure", lambda device: {"mem_read_gbps": 20.0, "cpu_expert_gbps": 5.0,
                                                            "copy_gbps": 10.0, "device": device})
    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "plan.yaml").write_text(yaml.safe_dump({"format": "moectl-plan-v1", "fingerprint": None, "slots": [3, 5]}))
    return wd


def test_bench_model_json_reports_every_field_and_baseline(tiny_small, tmp_path, capsys, monkeypatch):
    import json as _json

    from test_runtime import run_cli

    wd = bench_workdir(tmp_path, monkeypatch)
    code, out, err = run_cli(["bench", "--model", str(tiny_small), "--workdir", str(wd), "--prompt-len", "8",
                              "--gen-len", "5", "--repeat", "1", "--cache-experts", "8", "--json"], capsys)
    assert code == 0, err
    js = _json.loads(out)
    assert set(js["runs"]) == {"moectl", "moectl-plan", "all-resident", "transformers", "on-demand", "lru"}
    fields = ("ttft_ms", "prefill_tokens_per_s", "decode_ms_per_token")
    cached = ("hit_rate", "bytes_per_token", "stall_ms_per_token", "predictor_ms_per_token", "cpu_experts_per_token")
    for name, r in js["runs"].items():
        assert all(r[f] > 0 for f in fields), name
        assert r["prefill_tokens_per_s"] == pytest.approx(8 / (r["prefill_ms"] / 1e3))
        if name != "transformers":
            assert all(f in r for f in cached), name
    runs = js["runs"]
    assert runs["moectl-plan"]["slots_per_layer"] == [3, 5] and runs["moectl"]["slots_per_layer"] == [4, 4]
    assert runs["on-demand"]["slots_per_layer"] == [1, 1] and runs["on-demand"]["prefetch"] == "none"
    assert runs["all-resident"]["hit_rate"] == 1.0 and runs["all-resident"]["bytes_per_token"] == 0
    # fewer slots, no prefetch: no better hit rate than the same cache with LRU; bytes follow the misses
    assert runs["on-demand"]["hit_rate"] <= runs["lru"]["hit_rate"]
    assert runs["lru"]["bytes_per_token"] == pytest.approx(
        runs["lru"]["decode_misses"] * js["bytes_per_expert"] / runs["lru"]["decode_steps"])
    for name in ("moectl", "moectl-plan"):
        p = js["predicted"][name]
        assert js["measured_over_predicted"][name] == pytest.approx(runs[name]["decode_ms_per_token"]
                                                                    / p["decode_ms_per_token"])
        assert p["hit_rate"] == pytest.approx(runs[name]["hit_rate"])    # same routing, same cache rules
    assert js["all_resident_over_transformers"] == pytest.approx(runs["all-resident"]["decode_ms_per_token"]
                                                                 / runs["transformers"]["decode_ms_per_token"])
    assert js["machine"]["copy_gbps"] == 10.0


def test_streamed_prefill_equals_the_reference_and_leaves_the_cache_alone(mixtral):
    prompt = torch.randint(2, 512, (1, 24), generator=torch.Generator().manual_seed(6))
    ref_logits, ref_ids = _reference_run(mixtral, prompt, 4)
    eng = Engine.load(str(mixtral), cache_experts=8, emulate_device=True, prefill="stream", prefetch="none",
                      progress=False)
    eng.cache.loader.keep_log = True
    used = {}

    class Obs:
        def on_route(self, layer, idx, w, hidden):
            if idx.shape[0] > 1:
                used[layer] = sorted(set(idx.reshape(-1).tolist()))
    eng.add_observer(Obs())
    out, pkv = eng.forward(prompt)                                          # the prefill alone
    st = eng.cache.snapshot()
    assert st["prefill"]["misses"] == sum(len(v) for v in used.values()) and st["prefill"]["evictions"] == 0
    assert all(eng.cache.resident(l) == [] for l in range(4))              # nothing entered the cache
    log = eng.cache.loader.log                      # every used expert streamed, layer by layer, ascending ids
    assert [(l, e) for l, e, c in log if c == "gate_up"] == [(l, e) for l in range(4) for e in used[l]]
    logits, ids, step = [out[0]], [int(out[0, -1].argmax())], None
    for _ in range(4):
        out, pkv = eng.forward(torch.tensor([[ids[-1]]]), pkv)
        logits.append(out[0])
        ids.append(int(out[0, -1].argmax()))
    assert ids == ref_ids
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)) <= LOSSLESS_ATOL
    assert eng.cache.snapshot()["decode"]["misses"] > 0
    with pytest.raises(MoectlError, match="--prefill"):
        Engine.load(str(mixtral), prefill="fast", progress=False)


def test_threaded_copy_engine_in_the_runtime_is_lossless(mixtral):
    """The worker-thread mode (what CUDA runs, minus streams and events) driving a real cache with prefetches:
    copies land on the worker while this thread computes; results equal the reference."""
    prompt = torch.randint(2, 512, (1, 6), generator=torch.Generator().manual_seed(7))
    ref_logits, ref_ids = _reference_run(mixtral, prompt, 8)
    eng = Engine.load(str(mixtral), cache_experts=8, emulate_device=True, prefetch="gate-reuse", progress=False)
    eng.cache.loader = Loader(threaded=True)
    eng.cache.loader.keep_log = True
    logits, ids = _engine_run(eng, prompt, 8)
    eng.cache.loader.drain()
    assert ids == ref_ids
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)) <= LOSSLESS_ATOL
    st = eng.cache.snapshot()
    assert st["prefetches"] > 0 and st["misses"] > 0
    assert len(eng.cache.loader.log) >= 2 * st["misses"]          # every demand load ran on the worker
    eng.cache.loader.close()
