"""A GGUF's experts in place on the CPU through ggml, as llama.cpp computes them: a prefill's layer is one ggml graph
(`kernels/ggml.py: experts_routed`, llama.cpp's build_moe_ffn over all T tokens) with the per-expert path's logits and
the cache's bookkeeping; GPT-OSS's MXFP4 experts with their biases and clamped SwiGLU (`mg_moe_oai`) equal the
dequantised path within ggml's q8 activation rounding, decode and prefill.

Legend: T = tokens, K = top-k, H = hidden size, A = stacked experts, I = expert intermediate size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_build import model_from_gguf, write_gguf
from model_factory import save_tokenizer
from moectl.kernels import ggml
from moectl.runtime import offloaded
from moectl.runtime.engine import Engine
from test_gguf_run import GGML_LOGITS_RTOL, PROMPT, STEPS, ggml_or_skip, q4km  # noqa: F401 (q4km: a fixture)
from test_runtime import LOSSLESS_ATOL, _engine_run


@pytest.fixture(autouse=True)
def _ggml(monkeypatch):
    monkeypatch.setenv("MOECTL_GGML", "1")
    ggml_or_skip()


class _CountingLibrary:
    """The shim with each graph call counted (under the MoE layer being computed, `layer`); mg_new, which starts
    a threadpool, is not a graph."""

    def __init__(self, lib, calls: Counter):
        self._lib, self._calls, self.layer = lib, calls, None

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not name.startswith("mg_") or name == "mg_new" or self.layer is None:
            return fn
        calls, layer = self._calls, self.layer

        class Counted:
            def __getattr__(self, attr):           # argtypes, restype: the real function's
                return getattr(fn, attr)

            def __setattr__(self, attr, value):
                setattr(fn, attr, value)

            def __call__(self, *args):
                calls[layer, name] += 1
                return fn(*args)
        return Counted()


def count_ggml_calls(monkeypatch) -> Counter:
    """{(MoE layer, shim function): calls} made while a layer's experts are computed, from now on."""
    calls: Counter = Counter()
    lib = _CountingLibrary(ggml.require(), calls)
    monkeypatch.setattr(ggml, "require", lambda: lib)
    forward = offloaded.OffloadedExperts.forward

    def counted(self, *args):
        lib.layer = self.layer
        try:
            return forward(self, *args)
        finally:
            lib.layer = None
    monkeypatch.setattr(offloaded.OffloadedExperts, "forward", counted)
    return calls


def per_expert(monkeypatch) -> None:
    """The path before the fused prefill: each routed expert its own ggml calls on its tokens."""
    monkeypatch.setattr(offloaded, "experts_routed", lambda *a, **k: None)


def test_prefill_is_one_ggml_graph_per_layer(q4km, tmp_path, monkeypatch):
    """A 6-token prefill of the Q4_K/Q6_K file: each MoE layer's experts are one `mg_moe` call (llama.cpp's
    mul_mat_id graph over ids [T, K]), where the per-expert path made two calls per routed expert; the logits equal
    that path's up to the order of the top-k sum (the same q8 x, the same products), the cache saw the same
    accesses (hits, misses, expert calls), and the tokens are those of transformers' forward of gguf's reference
    dequantisation, logits within GGML_LOGITS_RTOL. (The dense part is dequantised here: with it in place too, x
    is quantized before every matrix, and this random model's routing flips, which moves its logits further; the
    dense part in place has its own test, test_gguf_dense_in_place.py.)"""
    from moectl.runtime import load

    monkeypatch.setattr(load, "dense_mapped", lambda *a: {})
    monkeypatch.setattr(load, "dense_in_place_names", lambda files: frozenset())     # the lean load's, from the header
    with monkeypatch.context() as m:
        per_expert(m)
        calls_before = count_ggml_calls(m)
        old = Engine.load(str(q4km), progress=False, threads=1, workdir=str(tmp_path / "old"))
        want, _ = old.forward(PROMPT)
    for layer in (0, 1):                        # per routed expert (>= 2 a layer): gate_up, then down
        assert calls_before[layer, "mg_mul_mat2"] == calls_before[layer, "mg_mul_mat"] >= 2
    assert sum(calls_before.values()) == 2 * sum(calls_before[layer, "mg_mul_mat"] for layer in (0, 1))
    calls = count_ggml_calls(monkeypatch)
    eng = Engine.load(str(q4km), progress=False, threads=1, workdir=str(tmp_path / "new"))
    got, _ = eng.forward(PROMPT)
    assert calls == Counter({(0, "mg_moe"): 1, (1, "mg_moe"): 1})
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert eng.runtime.expert_calls == old.runtime.expert_calls == 2 * 6 * 2
    assert (eng.cache.stats.hits, eng.cache.stats.misses) == (old.cache.stats.hits, old.cache.stats.misses)
    with torch.no_grad():
        ref = model_from_gguf(q4km)(input_ids=PROMPT).logits
    assert torch.equal(got[0].argmax(-1), ref[0].argmax(-1))
    assert (got - ref).abs().max() <= GGML_LOGITS_RTOL * ref.abs().max()


def _stacked_layer(A=4, H=256, I=256, enc=T.Q8_0):
    """A layer's stacked gate/up/down bytes (ggml's quantizer) and each expert's {gate_up, down} `GgmlLinear`s
    pointing into them, as `GgufMappedFormat` makes them."""
    gen = torch.Generator().manual_seed(5)
    raw = {p: np.ascontiguousarray(np.stack([ggml.quantize(enc, torch.randn(n, k, generator=gen) * 0.05)
                                             for _ in range(A)]))
           for p, (n, k) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items()}
    row = {p: r.nbytes // A for p, r in raw.items()}
    base = {p: (r.ctypes.data, A) for p, r in raw.items()}
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    experts = {e: ggml.expert_weights({p: (enc, raw[p].ctypes.data + e * row[p], shapes[p]) for p in raw}, raw,
                                      (e, base))
               for e in range(A)}
    return raw, experts


def test_routed_experts_skip_ids_they_are_not_given():
    """`experts_routed` over ids [T, K] with a dropped entry (-1, adaptive gating) and an expert the plan skipped (not
    given): those add nothing (weight 0, as llama.cpp's graph needs a valid id: it reads each), the rest is the
    per-expert sum; experts not rows of the same stacked tensors are refused (None: one by one)."""
    raw, experts = _stacked_layer()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    ids = torch.tensor([[0, -1], [2, 1], [3, 0]])
    w = torch.tensor([[0.7, 0.0], [0.4, 0.6], [0.5, 0.5]])
    given = {e: experts[e] for e in (0, 2, 3)}                          # expert 1 skipped
    y = ggml.experts_routed(x, given, ids, w)
    want = torch.zeros(3, 256)
    for t in range(3):
        for k in range(2):
            e = int(ids[t, k])
            if e in given:
                g = given[e]
                want[t] += w[t, k] * g["down"](torch.nn.functional.silu(g["gate_up"](x[t:t + 1])[:, :256])
                                               * g["gate_up"](x[t:t + 1])[:, 256:])[0]
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    lone = ggml.expert_weights({p: (T.Q8_0, raw[p].ctypes.data, s) for p, s in
                                {"gate": (256, 256), "up": (256, 256), "down": (256, 256)}.items()}, raw)
    assert ggml.experts_routed(x, {0: lone, 2: experts[2]}, ids, w) is None


# --- GPT-OSS --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_oss_ggufs(tmp_path_factory):
    """A random GPT-OSS (4 layers, 8 experts, top-2) and its GGUFs: F32, and MXFP4 experts as llama.cpp ships them
    (F32 biases)."""
    from test_gguf_model import build_with_rope

    root = tmp_path_factory.mktemp("gpt_oss_ggml")
    build_with_rope("gpt_oss", root / "ckpt")
    save_tokenizer(root / "ckpt")
    return {enc.name: write_gguf(root / "ckpt", root / f"oss-{enc.name}.gguf", expert_encoding=enc)
            for enc in (T.F32, T.MXFP4)} | {"ckpt": root / "ckpt"}


def test_gpt_oss_f32_gguf_through_ggml_is_the_original(gpt_oss_ggufs, tmp_path, monkeypatch):
    """GPT-OSS's F32 GGUF in place: experts mapped for ggml (GgmlBiasedLinear), each layer one `mg_moe_oai` graph in
    the prefill and in each decode step; F32 weights leave x unquantized, so the wiring (the biases where they lie,
    gate/up, swiglu_oai's alpha and limit) is checked exactly: logits and greedy tokens of the safetensors
    original within the lossless tolerance. The module path's (`MOECTL_GGML_GRAPH=0`; the one-graph forward is
    tests/test_ggml_graph_gpt_oss.py's)."""
    from moectl.formats.gguf_ggml import GgufMappedFormat

    monkeypatch.setenv("MOECTL_GGML_GRAPH", "0")
    kw = dict(progress=False, threads=1)
    want_logits, want = _engine_run(Engine.load(str(gpt_oss_ggufs["ckpt"]), workdir=str(tmp_path / "s"), **kw),
                                    PROMPT, STEPS)
    calls = count_ggml_calls(monkeypatch)
    eng = Engine.load(str(gpt_oss_ggufs["F32"]), workdir=str(tmp_path / "g"), **kw)
    assert all(isinstance(f, GgufMappedFormat) for f in eng.store.formats)
    logits, got = _engine_run(eng, PROMPT, STEPS)
    assert calls == Counter({(layer, "mg_moe_oai"): 1 + STEPS for layer in range(4)})   # prefill, steps
    assert got == want
    assert max((a - b).abs().max().item() for a, b in zip(logits, want_logits)) <= LOSSLESS_ATOL


def _layer_pairs(eng: Engine, deq: Engine) -> list:
    """Hooks on `eng`'s MoE layers computing `deq`'s same layer on the same input (x, routing): [(eng's output,
    deq's output)] per layer call, so the comparison is the experts' alone (no routing drift across layers)."""
    mods = lambda e: [m for m in e.model.modules() if isinstance(m, offloaded.OffloadedExperts)]   # noqa: E731
    pairs = []
    for mine, theirs in zip(mods(eng), mods(deq)):
        def hook(module, args, out, theirs=theirs):
            deq.cache.begin_step(eng.cache.state.phase)
            pairs.append((out, theirs(*args)))
        mine.register_forward_hook(hook)
    return pairs


def test_gpt_oss_mxfp4_experts_through_ggml_equal_the_dequantised(gpt_oss_ggufs, tmp_path, monkeypatch):
    """GPT-OSS's MXFP4 GGUF in place: each MoE layer's output through ggml (`mg_moe_oai`: x quantized to q8_0 per 32
    as llama.cpp does) equals the dequantised path's (`MOECTL_GGML=0`: gguf's MXFP4 dequantisation, fp32 x) on the
    same input and routing within 2 % (q8_0's rounding of x and of the activations, per element up to d/2 of a
    block's max/127: measured 0.4-0.8 % per layer call here; the whole model's logits move more, 19 %, as a 4-layer
    random model's routing flips), in the 6-token prefill and in decode steps; the per-expert ggml path
    (`experts_routed` refused) gives the fused one's logits. The module path's (`MOECTL_GGML_GRAPH=0`)."""
    monkeypatch.setenv("MOECTL_GGML_GRAPH", "0")
    kw = dict(progress=False, threads=1)
    path = str(gpt_oss_ggufs["MXFP4"])
    monkeypatch.setenv("MOECTL_GGML", "0")
    deq = Engine.load(path, workdir=str(tmp_path / "d"), **kw)
    monkeypatch.setenv("MOECTL_GGML", "1")
    eng = Engine.load(path, workdir=str(tmp_path / "g"), **kw)
    from moectl.formats.gguf_ggml import GgufMappedFormat

    assert isinstance(eng.store.formats[0], GgufMappedFormat) and not isinstance(deq.store.formats[0],
                                                                                 GgufMappedFormat)
    pairs = _layer_pairs(eng, deq)
    logits, _ = _engine_run(eng, PROMPT, 3)
    assert len(pairs) == 4 * 4                                              # prefill + 3 decode steps, 4 layers
    for step, (got, want) in enumerate(pairs):
        assert (got - want).norm() <= 0.02 * want.norm(), (step, (got - want).norm() / want.norm())
    assert pairs[0][0].shape[0] == PROMPT.shape[1] and pairs[-1][0].shape[0] == 1
    with monkeypatch.context() as m:
        per_expert(m)
        one_by_one = Engine.load(path, workdir=str(tmp_path / "p"), **kw)
        logits_pe, _ = _engine_run(one_by_one, PROMPT, 0)
    assert torch.allclose(logits_pe[0], logits[0], rtol=1e-5, atol=1e-5 * logits[0].abs().max().item())


def test_gpt_oss_cpu_experts_side_through_ggml(gpt_oss_ggufs, tmp_path):
    """`--cpu-experts always` (the CPU side of a GPU run, emulated) on GPT-OSS's F32 GGUF: misses computed by ggml
    from the RAM tier's bytes with the biases (`GgufExpertFormat.cpu_weights` -> GgmlBiasedLinear, GPT-OSS's
    expert_forward on callables); F32 weights leave x unquantized: the safetensors original's tokens and logits
    within the lossless tolerance."""
    kw = dict(progress=False, threads=1, emulate_device=True, cache_experts=4)          # one slot a layer
    want_logits, want = _engine_run(Engine.load(str(gpt_oss_ggufs["ckpt"]), workdir=str(tmp_path / "s"), **kw),
                                    PROMPT, 4)
    eng = Engine.load(str(gpt_oss_ggufs["F32"]), workdir=str(tmp_path / "g"), cpu_experts="always", **kw)
    w = eng.store.format_of("full", 0).cpu_weights(eng.runtime.cpu.host_views(0, 1))
    assert isinstance(w["gate_up"], ggml.GgmlBiasedLinear) and isinstance(w["down"], ggml.GgmlBiasedLinear)
    logits, got = _engine_run(eng, PROMPT, 4)
    assert eng.runtime.cpu_experts > 0
    assert got == want
    assert max((a - b).abs().max().item() for a, b in zip(logits, want_logits)) <= LOSSLESS_ATOL


KERNELS_CHILD = r"""
import json, os, sys
import numpy as np
from moectl.kernels import ggml
fallback = ggml.threads()                       # no --threads set, no torch: the CPU count
ggml.set_threads(3)
h = ggml.handle()
mapped = np.memmap(sys.argv[1], dtype=np.uint8, mode="r")
ggml.register_stable(mapped)                    # the repack's stable range, as a GGUF's map registers
print("RESULT " + json.dumps({"fallback": fallback, "cpus": os.cpu_count(), "set": ggml.threads(),
                              "why": ggml.why_not(), "same_handle": ggml.handle(3) == h != 0,
                              "registered": len(ggml._registered), "torch": "torch" in sys.modules}))
"""


def test_ggml_kernels_load_without_torch(tmp_path):
    """kernels/ggml.py in a fresh process: the shim loads, its threads are the CPU count until a run sets them
    (then those), a handle is made for them and kept, a mapped range is registered, and torch is never imported."""
    root = Path(__file__).resolve().parents[1]
    blob = tmp_path / "blob"
    blob.write_bytes(bytes(4096))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", KERNELS_CHILD, str(blob)], cwd=root, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert res == {"fallback": os.cpu_count(), "cpus": os.cpu_count(), "set": 3, "why": None, "same_handle": True,
                   "registered": 1, "torch": False}


def test_threads_are_torchs_count_where_torch_is_loaded(monkeypatch):
    """With torch loaded and no --threads set, ggml's threads are torch's intra-op count (as before kernels/ggml.py
    stopped importing torch); a set count wins."""
    monkeypatch.setattr(ggml, "_THREADS", [])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ggml.threads() == 2
        ggml.set_threads(5)
        assert ggml.threads() == 5
    finally:
        torch.set_num_threads(before)
