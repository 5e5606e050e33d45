"""`moectl quantize` and the low-bit tier: HQQ-exact copies, resumable writing, clear errors, and the precision
policies on the runtime (T1 = 1 bit-identical to lossless, q8 copies near lossless)."""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch

from moectl.errors import MoectlError
from moectl.artifacts.lowbit import copy_paths
from moectl.quant.quantize import quantize_model
from moectl.runtime.engine import Engine
from model_factory import build_family, save_tokenizer
from test_bad_input import assert_one_error, run_cli


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    d = tmp_path_factory.mktemp("q") / "mixtral"
    build_family("mixtral", d)
    save_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def q4(mixtral, tmp_path_factory):
    wd = tmp_path_factory.mktemp("q4wd")
    meta = quantize_model(str(mixtral), 4, 64, 1, workdir=str(wd), progress=False, method="hqq")
    return wd, meta


def test_stored_copy_dequantises_exactly_as_hqq(mixtral, q4):
    from hqq.core.quantize import Quantizer

    wd, meta = q4
    assert meta["bits"] == 4 and meta["group_size"] == 64 and meta["axis"] == 1
    assert meta["format"] == "moectl-lowbit-copies" and meta["version"] == 1 and len(meta["fingerprint"]) > 8
    assert len(meta["layers"]) == 4 and all(0.05 < x["rel_error"] < 0.12 for x in meta["layers"])
    assert (wd / "experts-q4g64.safetensors").exists() and not (wd / "experts-q4g64.parts").exists()
    from moectl.store.lowbit import LowbitCopies

    eng = Engine.load(str(mixtral), workdir=str(wd), progress=False)
    store = eng.store
    copies = LowbitCopies(wd, "q4g64", eng.fingerprint, eng.adapter, 4, torch.float32, progress=False)
    assert copies.expert_nbytes == meta["bytes_per_expert"] < store.expert_nbytes / 6    # fp32 -> 4 bit
    for layer, expert in [(0, 0), (3, 5)]:
        full = store.format.views(store.host(layer, expert))
        low = copies.format
        got = low.weights(low.views(copies.host(layer, expert)))
        for name in ("gate_up", "down"):
            W_q, m = Quantizer.quantize(full[name], nbits=4, group_size=64, axis=1, device="cpu")
            m["compute_dtype"] = torch.float32
            ref = Quantizer.dequantize(W_q, m)
            assert torch.equal(got[name], ref)                    # bit for bit HQQ's own dequantisation
            assert got[name].shape == full[name].shape


@pytest.fixture(params=["moectl-q4", "torch-int4"])
def q4_kernel(request, monkeypatch):
    """Which CPU kernel q4 copies are repacked for: moectl's own (moectl/kernels; skipped where it cannot be built)
    or torch's int4 kernel (what runs where moectl's cannot)."""
    from moectl import kernels
    from moectl.formats import cpu_layout as cpu_kernels

    if request.param == "moectl-q4" and kernels.library() is None:
        pytest.skip(f"moectl's CPU kernels cannot run here: {kernels.why_not()}")
    if request.param == "torch-int4":
        monkeypatch.setattr(cpu_kernels, "vnni_ok", lambda fmt: False)
    return request.param


def test_cpu_int4_kernel_matches_hqq_dequantisation(mixtral, q4, q4_kernel, monkeypatch):
    """On a CPU the q4 copies of a bf16 model are repacked for a CPU kernel (moectl's int8 x int4 one where it
    builds, else torch's int4 kernel); its logits match the dequantise-then-matmul path up to bf16 rounding and,
    for moectl's, the int8 activations (far closer than either is to lossless)."""
    from moectl.formats.int4_cpu import Int4CpuFormat
    from moectl.formats.vnni import VnniFormat
    from moectl.store import lowbit

    wd, _ = q4
    kw = dict(workdir=str(wd), lowbit="q4g64", precision="lowbit-only", progress=False, dtype="bfloat16")
    eng = Engine.load(str(mixtral), **kw)
    assert type(eng.store.lowbit.format) is {"moectl-q4": VnniFormat, "torch-int4": Int4CpuFormat}[q4_kernel]
    fast = _decode(eng)
    monkeypatch.setattr(lowbit, "cpu_kernel_format", lambda fmt: None)
    slow_eng = Engine.load(str(mixtral), **kw)
    assert type(slow_eng.store.lowbit.format).__name__ == "HqqFormat"
    slow = _decode(slow_eng)
    lossless = _decode(Engine.load(str(mixtral), workdir=str(wd), progress=False, dtype="bfloat16"))
    assert (fast - slow).abs().max() <= 0.25 * (slow - lossless).abs().max()   # bf16 rounding, not a different model


def test_interrupted_quantize_resumes_to_an_identical_file(mixtral, q4, tmp_path):
    wd = tmp_path / "wd"
    seen = []

    def stop(layer, expert):
        seen.append((layer, expert))
        if (layer, expert) == (2, 3):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_model(str(mixtral), 4, 64, 1, workdir=str(wd), progress=False, on_expert=stop, method="hqq")
    json_path, parts = copy_paths(wd, "q4g64")
    assert not json_path.exists()
    assert sorted(p.name for p in parts.iterdir()) == ["layer-000.safetensors", "layer-001.safetensors"]
    seen.clear()
    meta = quantize_model(str(mixtral), 4, 64, 1, workdir=str(wd), progress=False, method="hqq",
                          on_expert=lambda layer, expert: seen.append((layer, expert)))
    assert {l for l, _ in seen} == {2, 3} and len(seen) == 16                  # only the unfinished layers redone
    ref_wd, ref_meta = q4
    assert (wd / "experts-q4g64.safetensors").read_bytes() == (ref_wd / "experts-q4g64.safetensors").read_bytes()
    assert meta["layers"] == ref_meta["layers"]
    again = quantize_model(str(mixtral), 4, 64, 1, workdir=str(wd), progress=False, method="hqq")
    assert again.get("up_to_date")                                             # finished: nothing redone


def test_copies_of_other_bits_group_or_model_are_clear_errors(mixtral, q4, tmp_path, capsys, monkeypatch):
    wd, _ = q4
    other = tmp_path / "wd"
    other.mkdir()
    for suffix in (".json", ".safetensors"):                                    # q4g64 files renamed to q2g64
        shutil.copy(wd / f"experts-q4g64{suffix}", other / f"experts-q2g64{suffix}")
    with pytest.raises(MoectlError, match="holds q4g64 copies, not the q2g64"):
        Engine.load(str(mixtral), workdir=str(other), lowbit="q2g64", progress=False)
    with pytest.raises(MoectlError, match="no low-bit copies q4g32"):
        Engine.load(str(mixtral), workdir=str(wd), lowbit="q4g32", progress=False)
    # another model's copies (an OLMoE checkpoint quantized into the same directory layout)
    olmoe = tmp_path / "olmoe"
    build_family("olmoe", olmoe)
    owd = tmp_path / "owd"
    quantize_model(str(olmoe), 4, 64, 1, workdir=str(owd), progress=False)
    mwd = tmp_path / "mwd"
    shutil.copytree(owd, mwd)
    with pytest.raises(MoectlError, match="made for model olmoe.*loaded is mixtral"):
        Engine.load(str(mixtral), workdir=str(mwd), lowbit="q4g64", progress=False)
    capsys.readouterr()
    code, out, err = run_cli(["quantize", "--model", str(mixtral), "--workdir", str(tmp_path / "x"), "--bits", "5"],
                             capsys, monkeypatch)
    assert_one_error(code, err, "--bits 5")
    code, out, err = run_cli(["quantize", "--model", str(mixtral), "--workdir", str(tmp_path / "x"),
                              "--group-size", "12"], capsys, monkeypatch)
    assert_one_error(code, err, "multiple of 8")
    code, out, err = run_cli(["generate", "--model", str(mixtral), "--prompt", "x", "--precision", "lowbit-only"],
                             capsys, monkeypatch)
    assert_one_error(code, err, "--lowbit")


def _decode(eng, steps=6):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    logits, pkv = eng.forward(ids)
    out = [logits[0, -1]]
    for t in range(steps):
        logits, pkv = eng.forward(torch.tensor([[11 + t]]), pkv)
        out.append(logits[0, -1])
    return torch.stack(out)


def test_t1_one_is_bit_identical_to_lossless(mixtral, q4):
    wd, _ = q4
    kw = dict(cache_experts=8, emulate_device=True, workdir=str(wd), progress=False)
    lossless = _decode(Engine.load(str(mixtral), **kw))
    eng = Engine.load(str(mixtral), lowbit="q4g64", precision="hobbit", t1=1.0, t2=1.0, **kw)
    assert torch.equal(_decode(eng), lossless)
    st = eng.cache.snapshot()
    assert st["misses"] > 0 and st["low_misses"] == 0 and st["skips"] == 0
    # the default thresholds do load low-bit copies and change the output (a bit)
    hob = Engine.load(str(mixtral), lowbit="q4g64", **kw)
    out = _decode(hob)
    assert hob.cache.snapshot()["low_misses"] > 0 and not torch.equal(out, lossless)


def test_skip_renormalises_the_kept_weights(mixtral, q4):
    """T1 = T2 = 0: every missed non-top-1 expert is skipped; the output equals top-1 routing with the full
    routed weight on the top-1 expert (Mixtral's two weights sum to 1)."""
    wd, _ = q4
    eng = Engine.load(str(mixtral), lowbit="q4g64", t1=0.0, t2=0.0, cache_experts=4, emulate_device=True,
                      workdir=str(wd), progress=False)
    calls = []
    orig = eng.adapter.expert_forward
    eng.adapter.expert_forward = lambda w, x, g: (calls.append(1), orig(w, x, g))[1]
    block = eng.model.model.layers[0].mlp
    x = torch.randn(1, eng.config.hidden_size)
    idx, wts = torch.tensor([[3, 5]]), torch.tensor([[0.7, 0.3]])
    eng.cache.begin_step("decode")
    with torch.inference_mode():
        y = block.experts(x, idx, wts)                  # nothing resident: 3 full (top-1), 5 skipped
        assert len(calls) == 1 and eng.cache.stats.skips == 1
        ref = orig(eng.cache.acquire(0, 3), x, block.experts.apply_gate)
    assert torch.allclose(y, ref * 1.0, atol=1e-6)


def test_q8_copies_stay_near_lossless(tiny_small, tmp_path):
    from moectl.calib.dataset import load_calibration
    from moectl.calib.fidelity import token_windows, window_nll

    wd = tiny_small.parent
    quantize_model(str(tiny_small), 8, 64, 1, workdir=str(wd), progress=False)
    lossless = Engine.load(str(tiny_small), workdir=str(wd), progress=False)
    q8 = Engine.load(str(tiny_small), workdir=str(wd), lowbit="q8g64", precision="lowbit-only", progress=False)
    windows = token_windows(lossless.tokenizer, load_calibration("builtin"), 128, 1024)
    a, b = window_nll(lossless, windows), window_nll(q8, windows)
    ppl_a, ppl_b = math.exp(a["nll"] / a["scored"]), math.exp(b["nll"] / b["scored"])
    assert abs(ppl_b / ppl_a - 1) < 0.002, (ppl_a, ppl_b)
    assert ppl_b != ppl_a                                    # the q8 copies were really used


def test_budget_split_and_inspect_memory_figures(mixtral, q4, capsys, monkeypatch):
    from moectl.core.sizing import split_pools

    full, low = split_pools([2, 2, 2, 2], 8, 1000, 100, 0.25)        # 8000 bytes: 6 full slots + 20 low-bit slots
    assert full == [2, 2, 1, 1] and low == [5, 5, 5, 5]
    full, low = split_pools([2, 2, 2, 2], 8, 1000, 100, 1.0)         # lowbit-only: no full pool at all
    assert full == [0] * 4 and low == [8] * 4                        # 80 asked, capped at E
    wd, meta = q4
    eng = Engine.load(str(mixtral), workdir=str(wd), lowbit="q4g64", cache_experts=8, emulate_device=True,
                      lowbit_fraction=0.5, progress=False)
    nf, nl = eng.store.expert_nbytes, eng.store.nbytes("low")
    n_low = (8 * nf - 4 * nf) // nl                                  # half the bytes: 4 full slots, the rest low-bit
    assert eng.cache.slots_per_layer == [1] * 4 and n_low == 25
    assert [tuple(p.shape) for p in eng.cache.pools["low"]] == [(7, nl), (6, nl), (6, nl), (6, nl)]
    with pytest.raises(MoectlError, match="--lowbit-fraction"):
        Engine.load(str(mixtral), workdir=str(wd), lowbit="q4g64", lowbit_fraction=1.5, progress=False)
    code, out, err = run_cli(["inspect", "--model", str(mixtral), "--workdir", str(wd), "--lowbit", "q4g64",
                              "--offload", "disk", "--device", "cuda", "--json"], capsys, monkeypatch)
    assert code == 0, err
    m = json.loads(out)["memory"]
    assert m["bytes_per_expert_full"] == nf and m["bytes_per_expert_lowbit"] == nl == meta["bytes_per_expert"]
    assert m["host"]["full_copies"] == 0 and m["host"]["lowbit_copies"] == 32 * nl      # bf16 on disk, q4 in RAM
    assert m["host"]["cache_buffers"] == 4 * nf                                         # pinned staging per full slot
    assert m["device_total"] == m["dense_bytes"] + m["kv_reserve_bytes"] + 4 * nf + 4 * nl
    code, out, err = run_cli(["inspect", "--model", str(mixtral), "--workdir", str(wd), "--json"], capsys, monkeypatch)
    assert json.loads(out)["memory"]["host"]["full_copies"] == 32 * nf


def test_generate_reports_low_bit_loads(mixtral, q4, capsys, monkeypatch):
    wd, meta = q4
    code, out, err = run_cli(["generate", "--model", str(mixtral), "--workdir", str(wd), "--prompt", "a b c", "-n", "6",
                              "--greedy", "--lowbit", "q4g64", "--t1", "0", "--t2", "1", "--cache-experts", "8",
                              "--emulate-device",
                              "--prefetch", "none", "--json"], capsys, monkeypatch)
    assert code == 0, err
    st = json.loads(out)["stats"]
    assert st["low_misses"] > 0 and st["full_misses"] + st["low_misses"] == st["misses"]
    full = meta["full_bytes_per_expert"]
    assert st["bytes_loaded"] == st["full_misses"] * full + st["low_misses"] * meta["bytes_per_expert"]


def test_a_plan_with_low_bit_pools_is_run_as_planned(mixtral, q4, tmp_path, capsys, monkeypatch):
    """A plan.yaml holding low-bit slots per layer (`plan-cache --lowbit`) gives the runtime exactly those pools
    when its copy set is loaded, and is one clear error without it."""
    import yaml

    wd = tmp_path / "wd"
    shutil.copytree(q4[0], wd)
    from moectl.core.sizing import DEVICE_LIBRARY_BYTES

    code, _, err = run_cli(["plan-cache", "--model", str(mixtral), "--workdir", str(wd), "--budget",
                            str(20_000_000 + DEVICE_LIBRARY_BYTES),                # 20 MB besides the libraries'
                            "--kv-tokens", "64"], capsys, monkeypatch)
    assert code == 0, err
    f = wd / "plan.yaml"
    d = yaml.safe_load(f.read_text())
    L = len(d["slots"])
    d["slots_low"], d["lowbit"] = [2] * L, "q4g64"
    d["preload"] = {"low": [[l % 3, 3] for l in range(L)]}                  # loaded into the low-bit pools at start
    d["policies"] |= {"precision": "lowbit-only", "lowbit": "q4g64"}
    f.write_text(yaml.safe_dump(d))
    eng = Engine.load(str(mixtral), workdir=str(wd), emulate_device=True, lowbit="q4g64", plan="auto",
                      progress=False)
    assert eng.cache.slots_per_layer == d["slots"]
    assert [eng.cache.state.capacity(l, "low") for l in range(L)] == [2] * L
    assert eng.cache.precision.name == "lowbit-only"                       # the plan's precision policy
    assert [sorted(eng.cache.resident(l, "low")) for l in range(L)] == [sorted({l % 3, 3}) for l in range(L)]
    for l in range(L):
        slot = eng.cache.state.slot(l, 3, "low")
        assert torch.equal(eng.cache.pools["low"][l][slot], eng.store.host(l, 3, "low"))
    assert eng.cache.stats.misses == 0 and eng.cache.stats.preload_bytes == 2 * L * eng.store.nbytes("low")
    res = eng.generate(input_ids=[5, 9, 3], max_new_tokens=4)
    assert res.stats["low_misses"] > 0 and res.stats["full_misses"] == 0
    with pytest.raises(MoectlError, match="pass --lowbit q4g64"):
        Engine.load(str(mixtral), workdir=str(wd), emulate_device=True, plan="auto", progress=False)
    # where misses run comes from the plan too (moectl-q4: plan-cache --cpu-experts auto), unless the command says
    d["policies"]["cpu_experts"] = "always"
    f.write_text(yaml.safe_dump(d))
    kw = dict(workdir=str(wd), emulate_device=True, lowbit="q4g64", plan="auto", progress=False)
    eng = Engine.load(str(mixtral), **kw)
    assert eng.runtime.placement.mode == "always"
    assert eng.generate(input_ids=[5, 9, 3], max_new_tokens=4).stats["cpu_experts"] > 0
    assert Engine.load(str(mixtral), cpu_experts="never", **kw).runtime.placement is None


def test_a_gpu_slot_dequantises_the_cpu_kernel_layout(mixtral, q4, q4_kernel):
    """With --cpu-experts on a GPU one host copy of a q4 expert serves both sides, in the CPU kernel's layout; a slot
    copied to the device is dequantised there. The same function, run here on the CPU, gives HQQ's own weights (up
    to the bf16 rounding of zero') and the kernel's products; on another device `weights` returns dense matrices
    (shapes checked on the meta device)."""
    from moectl.formats import int4_cpu, vnni
    from moectl.store.lowbit import LowbitCopies

    assert int4_cpu.int4pack_layout() is not None            # x86 builds (AVX2, AVX-512) pack in row blocks
    wd, _ = q4
    eng = Engine.load(str(mixtral), workdir=str(wd), progress=False, dtype="bfloat16")
    hqq = LowbitCopies(wd, "q4g64", eng.fingerprint, eng.adapter, 4, torch.bfloat16, progress=False)
    kern = LowbitCopies(wd, "q4g64", eng.fingerprint, eng.adapter, 4, torch.bfloat16, progress=False, cpu_kernel=True)
    if q4_kernel == "moectl-q4":
        assert isinstance(kern.format, vnni.VnniFormat)
        linear = vnni.VnniLinear
        deq = lambda v, name, shape: vnni.dequantize(v[f"{name}.q4"], v[f"{name}.sm"], *shape)  # noqa: E731
        tol = 0.03                                           # int8 activations (ggml's Q8_0 for its Q4_0 dots)
    else:
        assert isinstance(kern.format, int4_cpu.Int4CpuFormat)
        linear = int4_cpu.Int4Linear
        deq = lambda v, name, shape: int4_cpu.dequantize(v[f"{name}.int4"], v[f"{name}.sz"], 64)  # noqa: E731
        tol = 0.02
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for layer, expert in [(0, 0), (3, 5)]:
        ref = hqq.format.weights(hqq.format.views(hqq.host(layer, expert)))
        v = kern.format.views(kern.host(layer, expert))
        on_cpu = kern.format.weights(v)
        for name in ("gate_up", "down"):
            w = deq(v, name, ref[name].shape)
            assert w.shape == ref[name].shape and w.dtype == torch.bfloat16
            assert (w.float() - ref[name].float()).abs().max() <= 0.01 * ref[name].float().abs().max()
            assert isinstance(on_cpu[name], linear)
            xi = x if name == "gate_up" else torch.randn(3, w.shape[1]).to(torch.bfloat16)
            y = on_cpu[name](xi).float()
            assert (y - xi.float() @ w.float().t()).abs().max() <= tol * y.abs().max()
        meta = kern.format.weights({k: torch.empty_like(t, device="meta") for k, t in v.items()})
        assert all(meta[n].shape == ref[n].shape and not isinstance(meta[n], linear) for n in ("gate_up", "down"))


def _q4(mixtral, wd, **kw):
    return Engine.load(str(mixtral), workdir=str(wd), lowbit="q4g64", precision="lowbit-only", progress=False,
                       dtype="bfloat16", **kw)


def test_q4_misses_computed_on_the_cpu_fill_the_cache_and_equal_the_in_place_q4_run(mixtral, q4):
    """`--precision lowbit-only --lowbit q4g64 --cpu-experts always` (moectl-q4's runtime): a q4 miss is computed on
    the CPU from its packed host copy, then copied into the cache while the copy engine idles (the simulator's
    fill), so later uses hit; the output equals every expert computed in place from the same q4 copies."""
    wd, _ = q4
    want = _decode(_q4(mixtral, wd))                                            # in place: no cache, no copies
    eng = _q4(mixtral, wd, cache_experts=4, emulate_device=True, cpu_experts="always")
    got = _decode(eng)
    st = eng.cache.snapshot()
    assert eng.runtime.cpu_experts > 8
    assert st["fills"] > 0 and st["demand_loads"] == 0                          # no demand load: misses ran on the CPU
    assert st["misses"] == st["cpu_misses"] == eng.runtime.cpu_experts           # ... and count as misses
    assert st["low_hits"] > 0                                                   # filled experts served later uses
    assert torch.equal(got, want)


def test_q4_cpu_side_runs_concurrently_with_the_device_side(mixtral, q4, monkeypatch):
    """Issue 18's overlap, at q4: a placement sending every other q4 miss to the CPU, a fake slow device copy
    (4 ms a chunk) and a slow CPU expert (6 ms): the CPU side's experts run while the device side copies (their
    calls overlap in time), and the output equals the in-place run of the same q4 weights."""
    from test_speed import Spans, _EveryOther

    wd, _ = q4
    want = _decode(_q4(mixtral, wd))
    eng = _q4(mixtral, wd, cache_experts=4, emulate_device=True)
    rt, loader = eng.runtime, eng.cache.loader
    rt.placement = _EveryOther()
    spans = Spans()
    monkeypatch.setattr(loader, "_run_one", spans.wrap("device", loader._run_one, 0.004))
    monkeypatch.setattr(rt.cpu, "forward", spans.wrap("cpu", rt.cpu.forward, 0.006))
    got = _decode(eng)
    st = eng.cache.snapshot()
    assert rt.cpu_experts > 8 and st["demand_loads"] > 8                         # both sides had work
    assert spans.overlapped_cpu_s() > 0.25 * spans.cpu_s(), (spans.overlapped_cpu_s(), spans.cpu_s())
    assert torch.equal(got, want)


def test_lowbit_only_in_place_keeps_no_full_precision_experts_in_ram(mixtral, q4):
    """Issue 28: in place at --precision lowbit-only the full-precision experts stay in the file (never read), so
    host RAM holds the low-bit copies plus dense, as llama.cpp's does; the output is that of the q4 copies computed
    on an emulated device with every expert cached (the same weights, another path)."""
    wd, _ = q4
    eng = _q4(mixtral, wd)
    assert eng.store.buffers is None and eng.store.lowbit is not None          # no full-precision experts in RAM
    L, E = len(eng.moe_layer_ids), eng.adapter.num_experts
    full = _q4(mixtral, wd, cache_experts=L * E, emulate_device=True)
    assert full.store.buffers is not None                                      # a device path still has them
    assert torch.equal(_decode(eng), _decode(full))
