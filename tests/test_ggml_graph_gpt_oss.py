"""GPT-OSS's whole forward as one ggml graph (llama.cpp's openai-moe graph: `mg_model_eval` with sinks, the
sliding-window layers' mask, q/k/v/o biases, YaRN, post_attention_norm, the router's bias, softmax_weight gating,
biased experts with swiglu_oai), against the module path (`MOECTL_GGML_GRAPH=0`: transformers' GPT-OSS modules,
the experts through ggml's `mg_moe_oai`) over a prompt longer than the sliding window, then decode steps.

YaRN: ggml's rope truncates the correction range (floor / ceil, `ggml_rope_yarn_corr_dims`), as llama.cpp runs
every YaRN model; GPT-OSS's config says `truncate: false` and transformers follows it. The exact comparisons here
give the module path llama.cpp's truncated range (`_llamacpp_yarn`), so what is compared is the graph's wiring;
`test_module_path_as_shipped_is_within_the_yarn_difference` bounds what the difference does to this model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_build import write_gguf
from model_factory import family_configs, save_tokenizer
from moectl.runtime import ggml_model
from moectl.runtime.engine import Engine
from moectl.runtime.ggml_model import GraphKV
from test_gguf_run import GGML_LOGITS_RTOL, ggml_or_skip
from test_runtime import LOSSLESS_ATOL

WINDOW = 4                                                    # the sliding window: the prompt is 2.5 of it
PROMPT = torch.tensor([[5, 17, 42, 9, 100, 7, 3, 64, 11, 2]])
STEPS = 6


def _forward(g, ids, kv=None, last_only=False):
    """The graph's forward with its numpy logits as a tensor (the module path's are), no copy."""
    logits, kv = g.forward(ids, kv, last_only)
    return torch.from_numpy(logits), kv


@pytest.fixture(scope="module")
def oss_files(tmp_path_factory):
    """A random 4-layer GPT-OSS (8 experts, top-2, sliding window 4 on layers 0 and 2, the config's YaRN: factor
    32, betas 32 / 1 -- the ones llama.cpp uses whatever the file says) and its GGUFs: F32, and llama.cpp's
    MXFP4_MOE layout (MXFP4 experts, F32 biases) with Q8_0 dense matrices."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("graph_gpt_oss")
    cfg = family_configs()["gpt_oss"]
    cfg.sliding_window = WINDOW
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2     # llama.cpp's swa pattern 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():               # random init leaves biases and sinks at 0: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for layer in model.model.layers:    # sinks that matter: a head's sink takes a visible share of its softmax
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks))
    ckpt = root / "ckpt"
    model.eval().save_pretrained(ckpt)
    save_tokenizer(ckpt)
    return {"F32": write_gguf(ckpt, root / "F32.gguf"),
            "MXFP4": write_gguf(ckpt, root / "MXFP4.gguf", expert_encoding=T.MXFP4, dense_encoding=T.Q8_0)}


@pytest.fixture
def _llamacpp_yarn(monkeypatch):
    """The module path with llama.cpp's YaRN correction range (truncated), for the exact comparisons."""
    from moectl.store.gguf import config as gguf_config

    real = gguf_config._rope

    def truncated(files, cfg):
        real(files, cfg)
        if cfg.get("rope_parameters", {}).get("rope_type") == "yarn":
            cfg["rope_parameters"]["truncate"] = True

    monkeypatch.setattr(gguf_config, "_rope", truncated)


def _load(path, tmp_path, **kw):
    return Engine.load(str(path), progress=False, threads=1, workdir=str(tmp_path), **kw)


class _Routes:
    """The module path's routed experts per forward: [L, T, U], each row's ids sorted."""

    def __init__(self):
        self.layers = []

    def on_route(self, layer, idx, weights, hidden):
        self.layers.append(idx.sort(dim=-1).values.to(torch.int32))

    def take(self) -> torch.Tensor:
        out, self.layers = torch.stack(self.layers), []
        return out


def _run(eng: Engine, steps: int, routes: _Routes | None = None, forced: list | None = None):
    """Prompt then `steps` greedy decode steps (`forced`: these tokens fed instead of the argmax): the logits of
    each forward, the tokens chosen, and each forward's routed experts [L, T, U] (sorted per row)."""
    logits, ids, ids_routed, kv, step = [], [], [], None, PROMPT
    for i in range(steps + 1):
        out, kv = eng.forward(step, kv)
        logits.append(out[0].float())
        ids.append(int(out[0, -1].argmax()))
        if routes is not None:
            ids_routed.append(routes.take())
        else:
            assert isinstance(kv, GraphKV)
            ids_routed.append(torch.from_numpy(np.sort(eng.graph.last_ids, axis=-1)))
        step = torch.tensor([[forced[i] if forced else ids[-1]]])
    return logits, ids, ids_routed


def _module_path(path, tmp_path, monkeypatch, steps=STEPS, forced=None):
    with monkeypatch.context() as m:
        m.setenv("MOECTL_GGML_GRAPH", "0")
        eng = _load(path, tmp_path / "m")
    assert eng.graph is None and "MOECTL_GGML_GRAPH=0" in eng.plan_note
    routes = _Routes()
    eng.add_observer(routes)
    return _run(eng, steps, routes, forced)


def test_f32_graph_equals_the_module_path(oss_files, tmp_path, monkeypatch, _llamacpp_yarn):
    """F32 weights (x stays f32 in every product): the graph's logits at every prompt position and decode step
    equal the module path's within the lossless tolerance (measured 2.4e-7 of a 0.89 scale; transformers' own
    untruncated YaRN range would be 4.9e-5 off: the tolerance sees it), the same greedy tokens and the same experts
    routed in every layer; the load's note says the graph serves the run."""
    ggml_or_skip()
    eng = _load(oss_files["F32"], tmp_path / "g")
    assert eng.graph is not None and "one ggml graph a forward" in eng.plan_note, eng.plan_note
    logits, got, routed = _run(eng, STEPS)
    want_logits, want, want_routed = _module_path(oss_files["F32"], tmp_path, monkeypatch)
    assert got == want
    assert logits[0].shape == want_logits[0].shape == (PROMPT.shape[1], eng.graph.V)
    err = max((a - b).abs().max().item() for a, b in zip(logits, want_logits))
    assert err <= LOSSLESS_ATOL, err
    for step, (a, b) in enumerate(zip(routed, want_routed)):
        assert torch.equal(a, b), step


def test_the_window_sinks_and_yarn_are_what_makes_it_equal(oss_files, tmp_path, monkeypatch, _llamacpp_yarn):
    """The comparison above sees the sliding window, the sinks and YaRN's ramp: without the window's mask the
    prompt's rows past the window differ from the module path's (its first WINDOW rows, which the window does not
    cut, do not); without the sinks, or with plain interpolation (ext_factor 0), every row does."""
    ggml_or_skip()
    g = _load(oss_files["F32"], tmp_path / "g").graph
    want, _, _ = _module_path(oss_files["F32"], tmp_path, monkeypatch, steps=0)
    full, _ = _forward(g, PROMPT)
    assert (full[0] - want[0]).abs().max() <= LOSSLESS_ATOL
    swa = g.desc.is_swa
    g.desc.is_swa = None                                    # every layer full attention
    no_window, _ = _forward(g, PROMPT)
    g.desc.is_swa = swa
    diff = (no_window[0] - want[0]).abs().amax(dim=-1)      # [T]
    assert diff[:WINDOW].max() <= LOSSLESS_ATOL and diff[WINDOW:].min() > 1e-3, diff
    sinks = [g.layers[l].sinks.data for l in range(g.n_layer)]
    for l in range(g.n_layer):
        g.layers[l].sinks.data = None
    no_sinks, _ = _forward(g, PROMPT)
    for l in range(g.n_layer):
        g.layers[l].sinks.data = sinks[l]
    assert (no_sinks[0] - want[0]).abs().amax(dim=-1).min() > 1e-3
    g.desc.ext_factor = 0.0                                 # YaRN's ramp off: every frequency interpolated
    no_ramp, _ = _forward(g, PROMPT)
    g.desc.ext_factor = 1.0
    assert (no_ramp[0] - want[0]).abs().amax(dim=-1)[1:].min() > 1e-3     # position 0 is not rotated


def test_prefill_equals_token_by_token_and_chunks(oss_files, tmp_path, monkeypatch):
    """The window over the cache: a prompt's prefill gives at every position the logits of feeding it one token at a
    time (each query's window reaching back into the cache), and of chunks of 3 tokens (a chunk's window starting
    inside the previous chunk)."""
    ggml_or_skip()
    g = _load(oss_files["F32"], tmp_path).graph
    full, kv = _forward(g, PROMPT)
    assert kv.pos == PROMPT.shape[1]
    one_kv = g.new_kv(2)
    for t in range(PROMPT.shape[1]):
        one, one_kv = _forward(g, PROMPT[:, t:t + 1], one_kv)
        assert torch.allclose(one[0, 0], full[0, t], atol=1e-4, rtol=1e-4), t
    monkeypatch.setattr(ggml_model, "CHUNK", 3)
    chunked, kv = _forward(g, PROMPT)
    assert kv.pos == PROMPT.shape[1] and torch.allclose(chunked, full, atol=1e-4, rtol=1e-4)
    last, _ = _forward(g, PROMPT, None, last_only=True)
    assert last.shape == (1, 1, g.V) and torch.allclose(last[0, 0], full[0, -1], atol=1e-4, rtol=1e-4)


def test_mxfp4_graph_equals_the_module_path(oss_files, tmp_path, monkeypatch, _llamacpp_yarn):
    """llama.cpp's MXFP4_MOE layout (MXFP4 experts, Q8_0 dense): the module path's tokens fed to the graph, logits
    within ggml's activation rounding (both quantize x to q8_0 for each product; the module path's attention and
    norms are torch's), the same experts routed where the logits agree."""
    ggml_or_skip()
    eng = _load(oss_files["MXFP4"], tmp_path / "g")
    assert eng.graph is not None, eng.plan_note
    want_logits, want, want_routed = _module_path(oss_files["MXFP4"], tmp_path, monkeypatch)
    logits, got, routed = _run(eng, STEPS, forced=want)
    scale = max(b.abs().max().item() for b in want_logits)
    err = max((a - b).abs().max().item() for a, b in zip(logits, want_logits))
    assert err <= GGML_LOGITS_RTOL * scale, (err, scale)
    assert got == want
    same = sum(torch.equal(a, b) for a, b in zip(routed, want_routed))
    assert same >= len(routed) - 1, same                        # a near tie of the router may flip once


def test_module_path_as_shipped_is_within_the_yarn_difference(oss_files, tmp_path, monkeypatch):
    """The module path as moectl ships it (transformers' untruncated YaRN range, as GPT-OSS's config says) against
    the graph (llama.cpp's truncated one): the same greedy tokens, logits within 1 % of their scale on this model
    (positions < 20, far inside the original context, where the ranges differ on a few of the 8 frequencies;
    measured 4.9e-5 of 0.89), and more than the lossless tolerance (the exact tests would see it)."""
    ggml_or_skip()
    eng = _load(oss_files["F32"], tmp_path / "g")
    logits, got, _ = _run(eng, STEPS)
    want_logits, want, _ = _module_path(oss_files["F32"], tmp_path, monkeypatch)
    assert got == want
    scale = max(b.abs().max().item() for b in want_logits)
    err = max((a - b).abs().max().item() for a, b in zip(logits, want_logits))
    assert LOSSLESS_ATOL < err <= 0.01 * scale, (err, scale)


def test_gpt_oss_from_modules_keeps_the_module_path(tmp_path):
    """GPT-OSS's graph reads a GGUF's tensors; from a checkpoint's modules the run says why it keeps the module
    path."""
    from types import SimpleNamespace

    got = ggml_model.GgmlModel.from_modules(None, SimpleNamespace(model_type="gpt_oss"), None)
    assert isinstance(got, str) and "GGUF" in got


def test_a_gpt_oss_file_without_its_sinks_or_biases_is_named():
    """GPT-OSS's graph needs every tensor its layers read (the norm before the MoE is post_attention_norm, the
    sinks and biases are not optional for it): the first missing one is named, for the load's note."""
    names = {f"blk.0.{t}" for t in ggml_model.layer_tensors("gpt_oss").values()}
    assert ggml_model.gguf_tensors_missing(names, 1, "gpt_oss") is None
    assert "blk.0.post_attention_norm.weight" in names and "blk.0.ffn_norm.weight" not in names
    for gone in ("blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_down_exps.bias"):
        assert gone in ggml_model.gguf_tensors_missing(names - {gone}, 1, "gpt_oss")
    mixtral = {f"blk.0.{t}" for f, t in ggml_model.LAYER_TENSORS.items() if f not in ggml_model.OPTIONAL}
    assert ggml_model.gguf_tensors_missing(mixtral, 1, "mixtral") is None        # biases stay optional there


def test_yarn_takes_the_graph_for_gpt_oss_only():
    """YaRN is in the graph as llama.cpp sets it up for GPT-OSS; another family's YaRN keeps the module path (said),
    as before."""
    from types import SimpleNamespace

    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 4096}
    why = ggml_model.why_not(SimpleNamespace(model_type="qwen3_moe", rope_parameters=yarn))
    assert why is not None and "GPT-OSS only" in why
    assert ggml_model.why_not(SimpleNamespace(model_type="gpt_oss", rope_parameters=yarn)) in (
        None, f"ggml is not available: {ggml_model.ggml.why_not()}")


def test_gpt_oss_graph_runs_without_torch(oss_files, tmp_path):
    """GPT-OSS's graph (MXFP4 experts, its sliding-window layers read from the config namespace's layer_types, YaRN,
    sinks) built and run in a fresh process without torch or transformers: the Engine's graph forward, bit for bit
    (tests/test_ggml_graph.py: check_torch_free_forward)."""
    from test_ggml_graph import check_torch_free_forward

    ggml_or_skip()
    check_torch_free_forward(oss_files["MXFP4"], tmp_path, swa=[1, 0, 1, 0])


def test_a_kept_decode_graph_masks_the_sliding_window(oss_files, tmp_path, monkeypatch):
    """The sliding-window layers (window 4) in a kept decode graph: its view starts at a 256-position bucket and its
    mask hides what the window does not see. 300 steps (past the first bucket, so the view moves): the logits and
    routed experts equal, bit for bit, those of a graph built every step (whose view starts at the window)."""
    ggml_or_skip()
    from test_ggml_graph import decode_kept_and_rebuilt

    g = _load(oss_files["MXFP4"], tmp_path).graph
    (kept, kept_ids, kept_built), (rebuilt, rebuilt_ids, rebuilt_built) = decode_kept_and_rebuilt(
        g, PROMPT[0].numpy(), 300, monkeypatch, kv_capacity=512)
    assert np.array_equal(kept, rebuilt) and np.array_equal(kept_ids, rebuilt_ids)
    # positions 10..309: views [0, 256), then [0, 512) at 256, then the window's from 256 on at 259
    assert rebuilt_built == 1 + 300 and kept_built == 1 + 3
