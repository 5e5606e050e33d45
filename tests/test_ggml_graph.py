"""A GGUF's whole forward as one ggml graph (moectl/runtime/ggml_model.py, `mg_model_eval` in the shim): on each
family it is written for, the F32 file's logits equal the safetensors original's through transformers (exact up
to summation order), prefill and decode; a quantized file gives the module path's tokens and logits within ggml's
activation rounding; a prompt's prefill equals feeding it a token at a time (the KV cache, the causal mask); the
KV cache grows past its first capacity; the cache's counters are the module path's; a run that needs the modules
(a gating policy, an observer) keeps them; a bad token id is one clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_build import write_gguf
from model_factory import save_tokenizer
from moectl.errors import MoectlError
from moectl.runtime.engine import Engine
from moectl.runtime import ggml_model
from moectl.runtime.ggml_model import GraphKV
from test_gguf_run import GGML_LOGITS_RTOL, PROMPT, STEPS, ggml_or_skip
from test_runtime import LOSSLESS_ATOL, _engine_run

FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"]
ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(family: str, root):
    from test_gguf_model import build_with_rope

    build_with_rope(family, root / "ckpt")             # qwen3_moe: linear rope scaling (freq_scale 1/2)
    save_tokenizer(root / "ckpt")
    return root / "ckpt"


@pytest.fixture(scope="module", params=FAMILIES)
def family_files(request, tmp_path_factory):
    """(family, checkpoint, F32 GGUF, Q8_0 dense + Q4_0 experts GGUF) of a tiny model of each family."""
    root = tmp_path_factory.mktemp(f"graph_{request.param}")
    ckpt = _checkpoint(request.param, root)
    f32 = write_gguf(ckpt, root / "F32.gguf")
    q = write_gguf(ckpt, root / "Q.gguf", dense_encoding=T.Q8_0, expert_encoding=T.Q4_0)
    return request.param, ckpt, f32, q


def _load(path, tmp_path, **kw):
    return Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path), **kw)


def test_f32_graph_equals_the_original(family_files, tmp_path, monkeypatch):
    """F32 weights: x stays f32 in every product, so the graph (llama.cpp's RoPE on the converter's Q/K rows, its
    routing, its attention) is checked against transformers' forward of the original within LOSSLESS_ATOL."""
    ggml_or_skip()
    family, ckpt, f32, _ = family_files
    want_logits, want = _engine_run(_load(ckpt, tmp_path / "s", emulate_device=True, cache_experts=4), PROMPT, STEPS)
    eng = _load(f32, tmp_path / "g")
    assert eng.graph is not None, eng.plan_note
    logits, got = _engine_run(eng, PROMPT, STEPS)
    assert got == want
    err = max((a - b).abs().max().item() for a, b in zip(logits, want_logits))
    assert err <= LOSSLESS_ATOL * 10, err           # one graph sums in ggml's order: a few ulps more than torch's
    assert logits[0].shape == want_logits[0].shape  # a prefill's logits: every position


def test_quantized_graph_equals_the_module_path(family_files, tmp_path, monkeypatch):
    """Q8_0 dense, Q4_0 experts: the same greedy tokens as the module path (MOECTL_GGML_GRAPH=0: the same ggml
    products, one at a time, attention in fp32), logits within ggml's activation rounding. The graph's cache is
    fp16 on such a file (llama.cpp's default); here fp32, as the module path's, so only the products differ."""
    ggml_or_skip()
    family, _, _, q = family_files
    eng = _load(q, tmp_path / "g")
    assert eng.graph is not None and "one ggml graph" in eng.plan_note
    assert eng.graph.kv_dtype == np.float16
    eng.graph.kv_dtype = torch.float32              # torch's name of it, as a caller may give it
    logits, got = _engine_run(eng, PROMPT, STEPS)
    monkeypatch.setenv("MOECTL_GGML_GRAPH", "0")
    mod = _load(q, tmp_path / "m")
    assert mod.graph is None and "MOECTL_GGML_GRAPH=0" in mod.plan_note
    want_logits, want = _engine_run(mod, PROMPT, STEPS)
    assert got == want
    scale = max(b.abs().max().item() for b in want_logits)
    assert max((a - b).abs().max().item() for a, b in zip(logits, want_logits)) <= GGML_LOGITS_RTOL * scale


def test_fp16_cache_is_llamacpps_default_within_its_rounding(family_files, tmp_path):
    """A quantized file's cache is fp16 (llama.cpp's default, read by flash attention), an F32 file's fp32; the
    fp16 cache's logits are the fp32 cache's within fp16's rounding of K and V (~1e-3 relative), prefill and
    decode, and a cache of the other dtype is refused. The cache's dtype is numpy's; torch's names of fp16 and fp32
    set it too, the same dtype."""
    ggml_or_skip()
    _, _, f32, q = family_files
    assert _load(f32, tmp_path / "f").graph.kv_dtype == np.float32
    g = _load(q, tmp_path / "q").graph
    ids = np.array([[5, 17, 42, 9, 100, 7, 3, 64, 11, 2]])
    runs = {}
    for dtype, named in ((np.float16, torch.float16), (np.float32, torch.float32)):
        g.kv_dtype = named
        assert g.kv_dtype == dtype
        pre, kv = g.forward(ids[:, :6])
        assert kv.k.dtype == dtype and kv.v.dtype == dtype
        steps = [g.forward(ids[:, t:t + 1], kv)[0] for t in range(6, 10)]
        runs[dtype] = np.concatenate([pre, *steps], axis=1)             # [1, 10, V]
    a, b = runs[np.float16], runs[np.float32]
    assert a.dtype == b.dtype == np.float32 and a.shape == (1, 10, g.V)
    scale = float(np.abs(b).max())
    err = float(np.abs(a - b).max())
    assert 0 < err <= 2e-2 * scale, (err, scale)       # not the same cache, and fp16's rounding only
    with pytest.raises(ValueError, match="KV cache"):
        g.forward(ids[:, :1], GraphKV(g.n_layer, g.KV, 4, np.float16))
    for other in (torch.bfloat16, np.float64):
        with pytest.raises(ValueError, match="fp16 or fp32"):
            g.kv_dtype = other
    with pytest.raises(ValueError, match="fp16 or fp32"):
        GraphKV(g.n_layer, g.KV, 4, torch.bfloat16)


def test_prefill_equals_token_by_token_and_the_cache_grows(family_files, tmp_path, monkeypatch):
    """A prompt's prefill (the causal mask over its own tokens) gives, at every position, the logits of feeding it
    one token at a time (each attending the cache); a cache made for 2 positions grows (its filled rows kept) and
    changes nothing; `last_only` is the last row; a prompt in chunks (llama.cpp's ubatch) is the same prompt."""
    ggml_or_skip()
    _, _, f32, _ = family_files
    g = _load(f32, tmp_path).graph
    ids = np.array([[5, 17, 42, 9, 100, 7, 3, 64, 11, 2]])
    full, kv = g.forward(ids)
    assert full.shape == (1, 10, g.V) and full.dtype == np.float32 and kv.pos == 10
    small = g.new_kv(2)
    for t in range(ids.shape[1]):
        one, small = g.forward(ids[:, t:t + 1], small)
        assert np.allclose(one[0, 0], full[0, t], atol=1e-4, rtol=1e-4), t
    assert small.capacity >= 10 and small.pos == 10
    last, _ = g.forward(ids, None, last_only=True)
    assert last.shape == (1, 1, g.V) and np.allclose(last[0, 0], full[0, -1], atol=1e-5)
    # the ids as a list, a flat array or a torch tensor: the same forward, bit for bit
    for same in (ids[0].tolist(), ids[0], torch.from_numpy(ids)):
        assert np.array_equal(g.forward(same)[0], full)
    # a prompt longer than a graph's chunk: chunks of 4 tokens, each attending the ones before (the cache)
    monkeypatch.setattr(ggml_model, "CHUNK", 4)
    done = []
    chunked, kv = g.forward(ids, None, on_chunk=lambda d, t: done.append((d, t)))
    assert done == [(4, 10), (8, 10), (10, 10)] and kv.pos == 10 and g.last_ids.shape == (g.n_layer, 10, g.U)
    assert g.last_ids.dtype == np.int32
    assert np.allclose(chunked, full, atol=1e-4, rtol=1e-4)
    last, _ = g.forward(ids, None, last_only=True)
    assert last.shape == (1, 1, g.V) and np.allclose(last[0, 0], full[0, -1], atol=1e-4, rtol=1e-4)


def test_counters_are_the_module_paths(family_files, tmp_path, monkeypatch):
    """generate's stats: hits (each expert a step routes, once per layer) and experts per token in the decode
    phase as the module path counts them; the KV cache's bytes in device_held_bytes."""
    ggml_or_skip()
    _, _, _, q = family_files
    runs = {}
    for graph in ("1", "0"):
        monkeypatch.setenv("MOECTL_GGML_GRAPH", graph)
        eng = _load(q, tmp_path / graph)
        r = eng.generate(input_ids=PROMPT, max_new_tokens=6, stop_at_eos=False)
        runs[graph] = (r.token_ids, eng.cache.stats.as_dict()["decode"], r.stats)
    (tok_g, dec_g, st_g), (tok_m, dec_m, st_m) = runs["1"], runs["0"]
    assert tok_g == tok_m and dec_g == dec_m and dec_g["hits"] > 0
    assert st_g["misses"] == 0 and st_g["device_held_bytes"] > st_m["device_held_bytes"] - 1  # KV counted


class RouteRecorder:
    """An observer of the layers (as profile and the predictors are): the layer of each routing it is shown."""

    def __init__(self):
        self.seen: list[int] = []

    def on_route(self, layer, idx, weights, hidden):
        self.seen.append(layer)


def test_runs_that_need_the_modules_keep_them(family_files, tmp_path):
    """A gating policy (adaptive top-k) is not in the graph: the module path, said in the load's note. An observer
    added before a sequence starts (profile, predictors) gets the module path for that sequence."""
    ggml_or_skip()
    _, _, _, q = family_files
    eng = _load(q, tmp_path / "a", gating="score:0.5")
    assert eng.graph is None and "module path (--gating" in eng.plan_note
    eng = _load(q, tmp_path / "b")
    obs = RouteRecorder()
    eng.add_observer(obs)
    _, pkv = eng.forward(PROMPT)
    assert not isinstance(pkv, GraphKV) and obs.seen
    eng.remove_observer(eng.runtime.observers[0])
    _, pkv = eng.forward(PROMPT)
    assert isinstance(pkv, GraphKV)


def test_bad_token_id_is_one_error(family_files, tmp_path):
    ggml_or_skip()
    _, _, _, q = family_files
    eng = _load(q, tmp_path)
    with pytest.raises(MoectlError, match="outside the vocabulary"):
        eng.forward(torch.tensor([[1, eng.graph.V]]))
    with pytest.raises(MoectlError, match="outside the vocabulary"):
        eng.graph.forward([1, 2 ** 32 + 1])                # not wrapped into the vocabulary by the int32 cast
    with pytest.raises(MoectlError, match="one sequence of token ids"):
        eng.graph.forward(np.ones((2, 3), dtype=np.int64))
    with pytest.raises(MoectlError, match="integers, not float"):
        eng.graph.forward([1.0, 2.5])


def test_qwen2_moe_shared_expert_is_required_and_counts(tmp_path):
    """Qwen2-MoE's graph reads its shared expert (ffn_{gate,up,down}_shexp and the gate ffn_gate_inp_shexp, which
    llama.cpp's qwen2moe requires): a file without one of them is named for the load's note (other families go
    without). The shared expert moves the tiny model's logits far more than test_f32_graph_equals_the_original's
    tolerance, so that test checks it: the graph without it is ~1e-1 away, where it must be within 1e-4."""
    names = {f"blk.0.{t}" for t in ggml_model.layer_tensors("qwen2_moe").values()}
    assert ggml_model.gguf_tensors_missing(names, 1, "qwen2_moe") is None
    for gone in ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):
        missing = ggml_model.gguf_tensors_missing(names - {f"blk.0.{gone}.weight"}, 1, "qwen2_moe")
        assert missing is not None and f"blk.0.{gone}.weight" in missing
    assert ggml_model.gguf_tensors_missing(names - {"blk.0.attn_q.bias"}, 1, "qwen2_moe") is None   # optional
    plain = {f"blk.0.{t}" for f, t in ggml_model.LAYER_TENSORS.items() if f not in ggml_model.OPTIONAL}
    assert ggml_model.gguf_tensors_missing(plain, 1, "qwen3_moe") is None        # no shared expert there
    ggml_or_skip()
    ckpt = _checkpoint("qwen2_moe", tmp_path)
    g = _load(write_gguf(ckpt, tmp_path / "F32.gguf"), tmp_path / "g").graph
    ids = np.array([[5, 17, 42, 9, 100, 7]])
    with_shared, _ = g.forward(ids)
    for layer in g.layers:
        layer.shexp_gate = ggml_model.MgW()                 # NULL data: the graph builds no shared expert
    without, _ = g.forward(ids)
    assert float(np.abs(with_shared - without).max()) > 100 * LOSSLESS_ATOL * 10


TORCH_FREE_CHILD = r"""
import json, sys, types
import numpy as np
from moectl.kernels import ggml
from moectl.runtime import ggml_model
from moectl.store.gguf.files import GgufFiles
ggml.set_threads(1)
config = types.SimpleNamespace(**json.loads(sys.argv[2]))         # the config's attributes, as a plain view
files = GgufFiles(sys.argv[1])
why = ggml_model.why_not(config)
graph = ggml_model.GgmlModel.from_gguf(types.SimpleNamespace(files=files), config)
ids = json.loads(sys.argv[3])
logits, kv = graph.forward(np.array([ids]))
prefill_ids = graph.last_ids.copy()
step, kv = graph.forward([ids[0]], kv)                           # a decode step on the cache: a list of ids
np.savez(sys.argv[4], logits=logits, step=step, prefill_ids=prefill_ids, last_ids=graph.last_ids,
         k=kv.k[:, :kv.pos], v=kv.v[:, :kv.pos])
print("RESULT " + json.dumps({"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules,
                              "why": why, "kv_dtype": str(graph.kv_dtype), "kv_pos": kv.pos,
                              "swa": swa.tolist() if (swa := ggml_model.swa_layers(config)) is not None else None}))
"""


def torch_free_forward(path, ids: list[int], tmp_path) -> tuple[dict, dict]:
    """The graph of the GGUF at `path` built and run in a fresh process without torch (`TORCH_FREE_CHILD`: a
    prefill of `ids`, then a decode step of ids[0]): (what it says of itself, its arrays)."""
    from moectl.store.gguf.model import GgufModel

    config = GgufModel(path).config.to_dict()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "child.npz"
    p = subprocess.run([sys.executable, "-c", TORCH_FREE_CHILD, str(path), json.dumps(config, default=str),
                        json.dumps(ids), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return res, dict(np.load(out))


def check_torch_free_forward(path, tmp_path, swa: list[int] | None = None) -> None:
    """The torch-free process's graph (`torch_free_forward`) imported neither torch nor transformers, read the
    namespace config as the Engine's reads transformers' (`why_not` None, the sliding-window layers `swa`), and its
    logits, routed experts and KV cache are the Engine's graph forward's on the same ids, bit for bit."""
    ids = [5, 17, 42, 9, 100, 7]
    res, child = torch_free_forward(path, ids, tmp_path)
    assert res == {"torch": False, "transformers": False, "why": None, "kv_dtype": "float16", "kv_pos": 7,
                   "swa": swa}
    eng = _load(path, tmp_path / "e")
    want, kv = eng.forward(torch.tensor([ids]))
    want_ids = eng.graph.last_ids.copy()
    want_step, kv = eng.forward(torch.tensor([ids[:1]]), kv)
    assert isinstance(want, torch.Tensor) and want.dtype == torch.float32 and want.shape == (1, len(ids), eng.graph.V)
    assert torch.equal(torch.from_numpy(child["logits"]), want)
    assert torch.equal(torch.from_numpy(child["step"]), want_step)
    assert child["prefill_ids"].shape == (eng.graph.n_layer, len(ids), eng.graph.U)
    assert np.array_equal(child["prefill_ids"], want_ids) and np.array_equal(child["last_ids"], eng.graph.last_ids)
    assert np.array_equal(child["k"], kv.k[:, :kv.pos]) and np.array_equal(child["v"], kv.v[:, :kv.pos])


def test_graph_runs_without_torch(family_files, tmp_path):
    """A fresh process builds the graph from the file's tensors (`GgufFiles`, the config's attributes as a plain
    namespace of its `to_dict()`) and runs a prefill and a decode step with neither torch nor transformers imported;
    its logits, routed experts and KV cache are the Engine's graph forward's on the same ids, bit for bit."""
    ggml_or_skip()
    check_torch_free_forward(family_files[3], tmp_path)


def _own_copies(family: str, tmp_path, dense):
    """A tiny checkpoint of `family` with moectl's ggml-q4_0 copies: (checkpoint, Engine.load's keywords for a
    lowbit-only run, the dense part bf16 or `dense` ggml blocks)."""
    from model_factory import build_family
    from moectl.quant.quantize import quantize_model

    ckpt = tmp_path / "ckpt"
    build_family(family, ckpt)
    save_tokenizer(ckpt)
    wd = tmp_path / "wd"
    quantize_model(str(ckpt), 4, 64, 1, workdir=str(wd), progress=False, fmt="ggml-q4_0")
    return ckpt, dict(workdir=str(wd), lowbit="ggml-q4_0", precision="lowbit-only", progress=False, threads=1,
                      dtype="bfloat16", dense_lowbit=dense)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dense", [None, "q4"])
def test_own_ggml_copies_take_the_graph(family, dense, tmp_path, monkeypatch):
    """moectl's own copies (`quantize --format ggml-q4_0`, `--precision lowbit-only`), the dense part bf16 or ggml
    blocks (`--dense-lowbit q4`): the graph reads the loaded modules and the copies' rows (NEOX RoPE on
    transformers' Q/K order) and gives the module path's tokens, logits within ggml's activation rounding."""
    ggml_or_skip()
    ckpt, kw = _own_copies(family, tmp_path, dense)
    eng = Engine.load(str(ckpt), **kw)
    assert eng.graph is not None, eng.plan_note
    monkeypatch.setenv("MOECTL_GGML_GRAPH", "0")
    want_logits, want = _engine_run(Engine.load(str(ckpt), **kw), PROMPT, STEPS)
    # the module path's tokens fed to the graph (teacher forcing: bf16 rounding between the module path's ops can
    # flip a near tie of this random model, and one flip changes every later step)
    logits, kv, step = [], None, PROMPT
    for nxt in want:
        out, kv = eng.forward(step, kv)
        logits.append(out[0])
        step = torch.tensor([[nxt]])
    scale = max(b.float().abs().max().item() for b in want_logits)
    tol = 4 * GGML_LOGITS_RTOL * scale                              # the module path rounds to bf16 between ops
    for a, b, w in zip(logits, want_logits, want):
        assert (a.float() - b.float()).abs().max().item() <= tol
        top2 = b[-1].float().topk(2).values
        if top2[0] - top2[1] > 2 * tol:                             # a clear choice is the same choice
            assert int(a[-1].argmax()) == w


def mapping_of(address: int) -> tuple[str, str]:
    """(permissions, file) of the mapping that holds `address` (/proc/self/maps)."""
    import os

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("reads /proc/self/maps (Linux)")
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= address < hi:
                return parts[1], parts[5].strip() if len(parts) > 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("family,dense", [("mixtral", None), ("mixtral", "q4"), ("qwen3_moe", "q4")])
def test_own_ggml_copies_are_repacked_as_llama_cpps(family, dense, tmp_path, monkeypatch):
    """On the CPU the copies are mapped from their shard and registered: ggml's CPU_REPACK makes a contiguous copy of
    each layer's gate, up and down stacks (the strided rows of the copies' buffer) as llama.cpp repacks a Q4_0 file,
    those copies take exactly the copies' bytes (`inspect`'s and the host check's figure for them), the mapped
    pages they copied leave the process, and the graph gives the unrepacked graph's (MOECTL_GGML_REPACK=0) tokens.
    Its logits: within 1e-5 of their scale with bf16 dense weights (fp32 summation order; measured 0: the bf16
    conversion before each dense product absorbs it); with `--dense-lowbit q4` within ggml's activation rounding
    (x quantized to q8_0 before each product: a summation-order difference may flip a code; measured 1.4 % of the
    scale on this 64-wide random model, the module-path comparison's bound is 20 %)."""
    ggml_or_skip()
    import gc

    import numpy as np
    from moectl.kernels import ggml
    from moectl.models.dense_cpu import GgmlDenseLinear

    monkeypatch.setenv("MOECTL_GGML_REPACK", "1")
    ckpt, kw = _own_copies(family, tmp_path, dense)
    gc.collect()
    before = ggml.repack_stats()
    eng = Engine.load(str(ckpt), **kw)
    assert eng.graph is not None, eng.plan_note
    low = eng.store.lowbit
    assert low.mapped and isinstance(low.buffers[0].numpy(), np.ndarray)
    fmt = low.format
    taken = [name for name, t in fmt.tensors if ggml.repacks(fmt.encoding, tuple(t.shape))]
    if not taken:
        pytest.skip("this CPU's ggml repacks none of this model's expert matrices")
    # the dense part's ggml blocks (--dense-lowbit q4: attention Q4_0) are registered too: repacked where ggml
    # takes them
    dense = [m.matrix for m in eng.model.modules() if isinstance(m, GgmlDenseLinear)
             and ggml.repacks(m.matrix.encoding, m.matrix.shape)]
    logits, ids = _engine_run(eng, PROMPT, STEPS)
    made = {k: ggml.repack_stats()[k] - before[k] for k in before}
    L, E = low.num_layers, low.num_experts
    per_expert = sum(t.nbytes for _, t in fmt.tensors)
    assert made["copies"] == len(taken) * L + len(dense)                 # one contiguous stack per matrix kind
    assert made["bytes"] == L * E * sum(t.nbytes for name, t in fmt.tensors if name in taken) + \
        sum(m.data.nbytes for m in dense)
    if len(taken) == 3:
        assert made["bytes"] - sum(m.data.nbytes for m in dense) == low.nbytes == L * E * per_expert   # not more
    assert len(dense) < made["repacked"] <= len(taken) * L * E + len(dense) and made["graphs"] > 0
    for b in low.buffers:                   # a private map of the shard: the shim may drop the pages it copied
        perms, file = mapping_of(b.data_ptr())                           # (test_ggml_repack checks that it does)
        assert perms.endswith("p") and file.startswith(kw["workdir"]) and file.endswith(".safetensors"), (perms, file)

    monkeypatch.setenv("MOECTL_GGML_REPACK", "0")
    off = Engine.load(str(ckpt), **kw)
    want_logits, want = _engine_run(off, PROMPT, STEPS)
    assert ids == want
    scale = max(b.abs().max().item() for b in want_logits)
    err = max((a - b).abs().max().item() for a, b in zip(logits, want_logits))
    assert err <= (1e-5 if dense is None else GGML_LOGITS_RTOL) * scale, (err, scale)


def test_a_run_in_place_asks_for_the_file_in_the_background(family_files, tmp_path, monkeypatch):
    """A run computing where the weights lie asks the kernel for the mapped file (MADV_WILLNEED) at load: its first
    tokens touch every expert, and a page not cached would be a disk read inside a token."""
    ggml_or_skip()
    from moectl.store.gguf.files import GgufFiles

    _, _, _, q = family_files
    asked = []
    real = GgufFiles.will_need
    monkeypatch.setattr(GgufFiles, "will_need", lambda self: asked.append(self.paths[0]) or real(self))
    _load(q, tmp_path)
    assert asked == [q]


def decode_kept_and_rebuilt(g, prompt: np.ndarray, steps: int, monkeypatch, kv_capacity: int = 2):
    """`steps` greedy decode steps after `prompt` twice: with the shim keeping a decode step's graph (the default)
    and with a graph built every step (MOECTL_GGML_NO_GRAPH_REUSE). -> for each: (logits [steps, V], routed ids
    [steps, L, U], graphs built). The cache starts at `kv_capacity` positions, so it grows (new buffers) on the way."""
    runs = []
    for rebuild in (False, True):
        if rebuild:
            monkeypatch.setenv("MOECTL_GGML_NO_GRAPH_REUSE", "1")
        else:
            monkeypatch.delenv("MOECTL_GGML_NO_GRAPH_REUSE", raising=False)
        built = ggml_model.graphs_built()
        logits, kv = g.forward(prompt, g.new_kv(kv_capacity), last_only=True)
        rows, ids = [], []
        for _ in range(steps):
            tok = int(np.argmax(logits[0, -1]))
            logits, kv = g.forward([tok], kv)
            rows.append(logits[0, 0].copy())
            ids.append(g.last_ids[:, 0].copy())
        runs.append((np.stack(rows), np.stack(ids), ggml_model.graphs_built() - built))
    monkeypatch.delenv("MOECTL_GGML_NO_GRAPH_REUSE", raising=False)
    return runs


def test_a_decode_step_keeps_its_graph_and_gives_the_rebuilt_ones_logits(family_files, tmp_path, monkeypatch):
    """A decode step reuses the graph the last step built (llama.cpp's graph reuse) while the model, its cache
    buffers and the 256-position bucket its attention views are unchanged; the step's token, position, cache row and
    mask are data. 300 steps cross a bucket and the cache's growths: the logits and routed experts equal, bit for
    bit, those of a graph built each step, and far fewer graphs are built."""
    ggml_or_skip()
    _, _, _, q = family_files
    g = _load(q, tmp_path).graph
    (kept, kept_ids, kept_built), (rebuilt, rebuilt_ids, rebuilt_built) = decode_kept_and_rebuilt(
        g, np.array([5, 17, 42, 9]), 300, monkeypatch)
    assert np.array_equal(kept, rebuilt) and np.array_equal(kept_ids, rebuilt_ids)
    assert np.isfinite(kept).all() and (kept_ids >= 0).all()
    assert rebuilt_built == 1 + 300
    # the prefill, then one graph per cache buffer (capacities 4, 8, ..., 512) and per bucket within one (256, 512)
    assert 1 + 1 <= kept_built <= 1 + 9


def test_a_kept_decode_graph_is_not_taken_for_another_models(family_files, tmp_path, monkeypatch):
    """Two models (the F32 and the quantized file) decoding in turn on one thread: each step rebuilds for the other
    model (the descriptor differs) and gives that model's own logits."""
    ggml_or_skip()
    _, _, f32, q = family_files
    a, b = _load(f32, tmp_path / "a").graph, _load(q, tmp_path / "b").graph
    want = {}
    for name, g in (("a", a), ("b", b)):
        logits, kv = g.forward([5, 17, 42], None, last_only=True)
        want[name] = [g.forward([t], kv)[0][0, 0].copy() for t in (7, 3, 64)]
    kvs = {name: g.forward([5, 17, 42], None, last_only=True)[1] for name, g in (("a", a), ("b", b))}
    for i, t in enumerate((7, 3, 64)):
        for name, g in (("a", a), ("b", b)):
            got, kvs[name] = g.forward([t], kvs[name])
            assert np.array_equal(got[0, 0], want[name][i]), (name, i)
