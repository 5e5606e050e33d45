"""The host data path at tiny size: in-place experts, reads straight into slots, slots touched at start-up,
honest memory errors, generate's timing fields."""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_factory import build_family, save_tokenizer  # noqa: E402
from test_runtime import _engine_run, _reference_run, run_cli  # noqa: E402

from moectl.errors import MoectlError  # noqa: E402
from moectl.core.recipes import format_bytes  # noqa: E402
from moectl.runtime.device_cache import DeviceCache  # noqa: E402
from moectl.store.facts import header_dense_nbytes, kv_reserve_nbytes  # noqa: E402
from moectl.runtime.engine import Engine  # noqa: E402
from moectl.runtime.cache import InPlaceExperts  # noqa: E402
from moectl.store import checkpoint as ckpt_mod  # noqa: E402
from moectl.store import memory  # noqa: E402


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp") / "mixtral"
    build_family("mixtral", d)
    save_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def mixtral_fused(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp") / "mixtral-fused"
    build_family("mixtral", d, fused=True)
    return d


def _within(t: torch.Tensor, owner: torch.Tensor) -> bool:
    lo = owner.data_ptr()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + owner.numel() * owner.element_size()


@pytest.mark.parametrize("fused", [False, True])
def test_in_place_computes_on_the_store_and_is_lossless(mixtral, mixtral_fused, fused):
    path = mixtral_fused if fused else mixtral
    prompt = torch.randint(2, 512, (1, 9), generator=torch.Generator().manual_seed(5))
    ref_logits, ref_ids = _reference_run(path, prompt, 8)
    eng = Engine.load(str(path), cache_experts=4, progress=False)     # a small N changes nothing in place
    assert isinstance(eng.cache, InPlaceExperts) and not hasattr(eng.cache, "pool")      # no slot memory at all
    assert eng.cache.slots_per_layer == [8] * 4
    used = []                                                          # the weights every expert call computes on
    orig = eng.adapter.expert_forward
    eng.adapter.expert_forward = lambda w, x, g: (used.append((w["gate_up"], w["down"])), orig(w, x, g))[1]
    logits, ids = _engine_run(eng, prompt, 8)
    assert ids == ref_ids
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)) <= 1e-5
    # Every call ran on views of the store's own [E, P] buffers: no expert byte was copied anywhere.
    owners = eng.store.buffers
    assert used and all(any(_within(gu, o) and _within(dn, o) for o in owners) for gu, dn in used)
    assert all(gu.untyped_storage().data_ptr() in {o.untyped_storage().data_ptr() for o in owners}
               for gu, _ in used)
    st = eng.cache.snapshot()
    assert st["misses"] == 0 and st["bytes_loaded"] == 0 and st["hits"] == len(used)


def test_emulate_device_keeps_slots_and_copies(mixtral):
    eng = Engine.load(str(mixtral), cache_experts=4, emulate_device=True, progress=False)
    assert isinstance(eng.cache, DeviceCache) and eng.cache.slots_per_layer == [1] * 4
    eng.forward(torch.tensor([[5, 6, 7]]))
    assert eng.cache.snapshot()["misses"] > 0
    with pytest.raises(MoectlError, match="only applies to --device cpu"):
        Engine.load(str(mixtral), device="cuda", emulate_device=True, progress=False)


def _record_reads(monkeypatch):
    reads = []
    orig = ckpt_mod.read_at

    def spy(fd, buf, offset):
        addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr() if len(buf) else 0
        reads.append((addr, len(buf), offset, threading.current_thread().name))
        return orig(fd, buf, offset)

    monkeypatch.setattr(ckpt_mod, "read_at", spy)
    return reads


@pytest.mark.parametrize("fused", [False, True])
def test_disk_miss_reads_the_expert_once_straight_into_its_slot(mixtral, mixtral_fused, fused, monkeypatch):
    path = str(mixtral_fused if fused else mixtral)
    ram = Engine.load(path, progress=False)
    disk = Engine.load(path, cache_experts=8, offload="disk", progress=False)
    cache, store = disk.cache, disk.store
    reads = _record_reads(monkeypatch)
    for layer, expert in [(0, 3), (2, 7), (0, 5), (0, 1)]:          # the last one evicts (2 slots per layer)
        reads.clear()
        w = cache.acquire(layer, expert)
        slot = cache.state.slot(layer, expert)
        dst = cache.pool[layer][slot]
        # One positioned read per on-disk tensor range of the expert, every byte read once, all into the slot.
        assert len(reads) == len(store.ranges[layer][expert])
        assert sum(n for _, n, _, _ in reads) == store.expert_nbytes
        assert sorted(off for _, _, off, _ in reads) == sorted(r.offset for r in store.ranges[layer][expert])
        assert all(dst.data_ptr() <= a and a + n <= dst.data_ptr() + store.expert_nbytes for a, n, _, _ in reads)
        assert torch.equal(dst, ram.store.host(layer, expert))
        assert w["gate_up"].data_ptr() == dst.data_ptr()
    waited = cache.snapshot()["load_wait_s"]
    assert waited > 0                                                  # the forward waited for those reads
    reads.clear()
    cache.acquire(0, 1)                                                # a hit reads nothing
    assert reads == []
    assert cache.snapshot()["misses"] == 4 and cache.snapshot()["load_wait_s"] == waited


def test_disk_prefetch_reads_on_the_background_thread_and_stays_lossless(mixtral, monkeypatch):
    path = str(mixtral)
    prompt = torch.tensor([[7, 8, 9]])
    want = _engine_run(Engine.load(path, progress=False), prompt, 6)
    eng = Engine.load(path, cache_experts=8, offload="disk", prefetch="gate-reuse", progress=False)
    reads = _record_reads(monkeypatch)
    got = _engine_run(eng, prompt, 6)
    assert got[1] == want[1]
    assert max((a - b).abs().max().item() for a, b in zip(got[0], want[0])) == 0.0
    st = eng.cache.snapshot()
    assert st["prefetches"] > 0
    background = [r for r in reads if r[3].startswith("moectl-reader")]
    assert len(background) == st["prefetches"] * len(eng.store.ranges[0][0])
    assert len(reads) - len(background) == st["misses"] * len(eng.store.ranges[0][0])


def test_slots_are_allocated_and_touched_at_start_up(mixtral):
    eng = Engine.load(str(mixtral), cache_experts=32, emulate_device=True, progress=False)
    cache = eng.cache
    ptrs = [p.data_ptr() for p in cache.pool]
    assert [tuple(p.shape) for p in cache.pool] == [(8, eng.store.expert_nbytes)] * 4   # uint8 [S, N]
    assert eng.store.expert_nbytes == eng.store.layout.numel * 4                        # fp32, no padding
    pages = sum(p.numel() * p.element_size() for p in cache.pool) // resource.getpagesize()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for layer in range(4):
        for e in range(8):
            cache.acquire(layer, e)                                   # first write into every slot
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert pages > 500 and faults < pages // 5, (faults, pages)       # the pages were faulted in at start-up
    assert [p.data_ptr() for p in cache.pool] == ptrs                 # the same buffers, never reallocated


def _needs(path):
    from moectl.store.facts import load_config
    from moectl.store.checkpoint import Checkpoint

    config, adapter = load_config(Path(path))
    ckpt = Checkpoint(path)
    return (header_dense_nbytes(ckpt, adapter, torch.float32), kv_reserve_nbytes(config, torch.float32),
            adapter.layout().numel * 4)


def test_too_little_memory_is_one_clear_error_with_options(mixtral, monkeypatch, capsys):
    dense, kv, x = _needs(mixtral)
    need = dense + kv + 32 * x                                        # in place: dense + every expert + KV
    free = dense + kv + 6 * x + x // 2                                # room for 6 disk slots, not the RAM tier
    monkeypatch.setenv(memory.FREE_ENV, str(free))
    with pytest.raises(MoectlError) as e:
        Engine.load(str(mixtral), progress=False)
    msg = str(e.value)
    assert f"needs {format_bytes(need)}" in msg and f"{format_bytes(free)} is free ({memory.FREE_ENV})" in msg
    assert f"experts in RAM {format_bytes(32 * x)}" in msg and f"dense weights {format_bytes(dense)}" in msg
    assert "--offload disk --cache-experts 6" in msg
    assert sum(Engine.load(str(mixtral), offload="disk", cache_experts=6, progress=False).cache.slots_per_layer) == 6
    with pytest.raises(MoectlError, match="--cache-experts 6"):
        Engine.load(str(mixtral), offload="disk", cache_experts=12, progress=False)
    monkeypatch.setenv(memory.FREE_ENV, "1KB")
    code, out, err = run_cli(["generate", "--model", str(mixtral), "--prompt", "x"], capsys)
    assert code == 2 and "not enough host memory" in err and "No configuration of this model fits" in err
    assert "Traceback" not in err + out


def test_allocation_failure_while_loading_is_not_a_corrupt_file(mixtral, monkeypatch, capsys):
    real = torch.empty

    def failing(*a, **k):
        if a and a[0] == (8, 3 * 64 * 128 * 4):             # the RAM tier's uint8 [E, N] buffers (fp32)
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 786432 bytes")
        return real(*a, **k)

    monkeypatch.setattr(torch, "empty", failing)             # store/memory.py: host_empty's torch.empty
    code, out, err = run_cli(["generate", "--model", str(mixtral), "--prompt", "x"], capsys)
    assert code == 2, err
    assert "out of memory while reading experts into RAM" in err and "--offload disk" in err
    assert "corrupt" not in err and "Traceback" not in err + out


def test_generate_timings(mixtral, monkeypatch, capsys):
    from moectl.runtime import generation as engine_mod

    eng = Engine.load(str(mixtral), progress=True)
    monkeypatch.setattr(engine_mod, "PREFILL_PROGRESS_AFTER_S", 0.0)    # a "long" prefill: the bar shows
    res = eng.generate("def forward(self, input):", max_new_tokens=6, greedy=True, stop_at_eos=False)
    st = res.stats
    assert "prefill" in capsys.readouterr().err
    assert 0 < st["prefill_ms"] <= st["ttft_ms"]
    # ttft = prefill + the first token's sampling; decode steps come after it; together within the wall time.
    assert st["ttft_ms"] - st["prefill_ms"] < 0.5 * st["ttft_ms"]
    assert st["decode_ms_per_token"] > 0
    assert st["ttft_ms"] + 5 * st["decode_ms_per_token"] <= st["seconds"] * 1000
    assert 0 < st["host_rss_gb"] <= st["host_peak_rss_gb"]
    monkeypatch.setattr(engine_mod, "PREFILL_PROGRESS_AFTER_S", 1.0)
    code, out, err = run_cli(["generate", "--model", str(mixtral), "--prompt", "x = ", "--greedy",
                              "--max-new-tokens", "4", "--json"], capsys)
    assert code == 0, err
    js = json.loads(out)["stats"]
    for k in ("tokens_per_s", "hit_rate", "misses", "bytes_loaded", "bytes_per_token", "load_wait_s",
              "prefill_ms", "ttft_ms", "decode_ms_per_token", "host_rss_gb"):
        assert k in js, k
    assert js["prefill_ms"] <= js["ttft_ms"] and js["misses"] == 0 and js["host_rss_gb"] > 0.05


def test_a_big_demand_read_is_split_over_threads_each_byte_once(mixtral, monkeypatch):
    from moectl.store import expert_store

    monkeypatch.setattr(expert_store, "PARALLEL_READ_MIN", 1)          # tiny experts count as big here
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(ckpt_mod.Checkpoint, "cached", lambda self, r: True)   # the bytes are in the page cache
    ram = Engine.load(str(mixtral), progress=False)
    disk = Engine.load(str(mixtral), cache_experts=8, offload="disk", progress=False)
    reads = _record_reads(monkeypatch)
    disk.cache.acquire(1, 6)
    dst = disk.cache.pool[1][disk.cache.state.slot(1, 6)]
    spans = sorted((a - dst.data_ptr(), n) for a, n, _, _ in reads)
    assert len({t for *_, t in reads}) == 2                             # two threads shared the read
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))   # no gap, no overlap
    assert spans[-1][0] + spans[-1][1] == disk.store.expert_nbytes
    assert torch.equal(dst, ram.store.host(1, 6))


def test_a_demand_read_from_the_disk_itself_is_one_sequential_stream(mixtral, monkeypatch):
    """Not in the page cache: one thread reads the expert front to back (two interleaved streams are slower on a
    disk); the bytes are the same."""
    from moectl.store import expert_store

    monkeypatch.setattr(expert_store, "PARALLEL_READ_MIN", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(ckpt_mod.Checkpoint, "cached", lambda self, r: False)
    ram = Engine.load(str(mixtral), progress=False)
    disk = Engine.load(str(mixtral), cache_experts=8, offload="disk", progress=False)
    reads = _record_reads(monkeypatch)
    disk.cache.acquire(1, 6)
    dst = disk.cache.pool[1][disk.cache.state.slot(1, 6)]
    assert {t for *_, t in reads} == {threading.current_thread().name}
    starts = [a - dst.data_ptr() for a, *_ in reads]
    assert starts == sorted(starts) and starts[0] == 0                  # front to back
    assert sum(n for _, n, _, _ in reads) == disk.store.expert_nbytes
    assert torch.equal(dst, ram.store.host(1, 6))


def test_page_cache_probe_tells_a_read_file_from_an_evicted_one(tmp_path):
    # A probe that misses may start the kernel's readahead around its page, so no page is probed twice while
    # evicted: the tmpfs check and the assertion probe pages 16 MB apart (readahead windows are far smaller).
    f = tmp_path / "shard.bin"
    f.write_bytes(os.urandom(32 << 20))
    far = 16 << 20
    fd = os.open(f, os.O_RDONLY)
    try:
        os.pread(fd, 32 << 20, 0)
        assert ckpt_mod.in_page_cache(fd, 4096) and ckpt_mod.in_page_cache(fd, far)   # just read: in the cache
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if getattr(os, "RWF_NOWAIT", None) is None:
            return                                                      # no probe here: it says True, as tested
        if ckpt_mod.in_page_cache(fd, 4096):
            pytest.skip("this filesystem keeps the file cached (tmpfs-like): nothing to evict")
        assert not ckpt_mod.in_page_cache(fd, far)
        os.pread(fd, 8192, far + 4096)
        assert ckpt_mod.in_page_cache(fd, far + 4096)
    finally:
        os.close(fd)
