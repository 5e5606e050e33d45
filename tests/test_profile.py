"""`moectl profile` on the offloading runtime: recorded routing equals the transformers reference.

Legend: T = tokens, L = MoE layers, K = top-k, D = hidden size.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from model_factory import build_family
from moectl.errors import MoectlError

torch.set_num_threads(1)     # 2 shared cores: intra-op threads spin against the other processes (100x slower ops)

TEXT = """The cache keeps the experts that were used most recently on the device.

When a token routes to an expert that is not resident, the loader copies its weights over the bus.

Prefetching guesses the experts of the next layers from the current hidden state, so copies overlap compute.

A short one.

Routing traces record which experts every token chose in every layer, for prefill and decode tokens alike."""


def _tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Mixtral checkpoint (4 layers, 8 experts, top-2, D=64) with a BPE tokenizer."""
    root = tmp_path_factory.mktemp("profile")
    ckpt = root / "tinymix"
    build_family("mixtral", ckpt)
    _tokenizer(ckpt)
    data = root / "calib.txt"
    data.write_text(TEXT)
    return ckpt, data


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))


def _texts(data):
    from moectl.calib.dataset import load_calibration

    return load_calibration(str(data))


def _profile(ckpt, data, out, **kw):
    from moectl.calib.profile import run_profile
    from moectl.runtime.engine import Engine

    eng = Engine.load(model=str(ckpt), device="cpu", cache_experts=12, progress=False)   # 12 of 32 experts
    res = run_profile(eng, _texts(data), out, model_name="tinymix", dataset=str(data), **kw)
    return eng, res


def _reference(ckpt, prompts: list[list[int]], generate: int, eos: set[int]):
    """Plain transformers model, router forward hooks: per request the expert ids [n, L, K], weights,
    router logits [n, L, E], MoE inputs [n, L, D], final hidden [n, D] and the token ids."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from moectl.models.kv_cache import cache_kwargs, output_cache

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    rec: dict[int, tuple] = {}
    finals = []
    moe = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]

    def hook(l):
        def fn(module, args, out):
            logits, w, idx = out
            rec[l] = (idx.clone(), w.float().clone(), logits.float().clone(), args[0].reshape(-1, args[0].shape[-1]).clone())
        return fn

    handles = [blk.gate.register_forward_hook(hook(l)) for l, (_, blk) in enumerate(moe)]
    handles.append(model.model.norm.register_forward_hook(lambda m, a, o: finals.append(o.reshape(-1, o.shape[-1]).clone())))
    out = []
    with torch.no_grad():
        for ids in prompts:
            rows, toks = [], list(ids)
            pkv = DynamicCache(config=model.config)
            finals.clear()
            o = model(torch.tensor([ids]), **cache_kwargs(model, pkv), use_cache=True)
            rows.append({l: rec[l] for l in rec})
            for _ in range(generate):
                nxt = int(o.logits[0, -1].argmax())
                if nxt in eos:
                    break
                o = model(torch.tensor([[nxt]]), **cache_kwargs(model, output_cache(o)), use_cache=True)
                rows.append({l: rec[l] for l in rec})
                toks.append(nxt)
            L = len(moe)
            cat = lambda j: torch.cat([torch.stack([r[l][j] for l in range(L)], 1) for r in rows]).numpy()
            out.append({"experts": cat(0), "weights": cat(1), "logits": cat(2), "moe_in": cat(3),
                        "final": torch.cat(finals).numpy(), "tokens": toks})
    for h in handles:
        h.remove()
    return out


def test_recorded_routing_equals_transformers_reference(tiny, tmp_path):
    from moectl.artifacts.trace_dir import read_trace_dir
    from moectl.core.trace import DECODE, PREFILL

    ckpt, data = tiny
    eng, res = _profile(ckpt, data, tmp_path / "traces", max_tokens=24, generate=6, hidden_samples="all",
                        router_logits=True)
    tr = read_trace_dir(tmp_path / "traces", expect_fingerprint=eng.fingerprint)
    prompts = [eng.tokenizer(t)["input_ids"][:24] for t in _texts(data)]
    ref = _reference(ckpt, prompts, 6, {0})
    assert res.samples == len(prompts) == 5 and res.decode_tokens > 0
    assert tr.num_layers == 4 and tr.num_experts == 8 and tr.top_k == 2 and tr.moe_layer_ids == [0, 1, 2, 3]
    assert (tr.phase == PREFILL).sum() == sum(len(p) for p in prompts)
    assert (tr.phase == DECODE).sum() == res.decode_tokens
    for (req, rows), r in zip(tr.request_slices(), ref):
        n = len(r["tokens"])
        assert rows.stop - rows.start == n
        assert tr.tokens[rows].tolist() == r["tokens"]                     # same greedy continuation
        np.testing.assert_array_equal(tr.experts[rows], r["experts"])      # ids in the router's order
        np.testing.assert_allclose(tr.weights[rows].astype(np.float32), r["weights"], atol=1e-3)
        np.testing.assert_allclose(tr.router_logits[rows].astype(np.float32), r["logits"], atol=2e-3)
        assert tr.pos[rows].tolist() == list(range(n))
        # hidden samples "all": every row has the MoE-block inputs and the previous token's final hidden
        h = tr.hidden
        sel = (h.token_index >= rows.start) & (h.token_index < rows.stop)
        local = h.token_index[sel] - rows.start
        assert local.tolist() == list(range(n))
        np.testing.assert_allclose(h.moe_inputs[sel].astype(np.float32), r["moe_in"], atol=2e-3, rtol=2e-3)
        prev = np.concatenate([np.zeros((1, r["final"].shape[1]), np.float32), r["final"][:-1]])
        np.testing.assert_allclose(h.prev_final[sel].astype(np.float32), prev, atol=5e-3, rtol=2e-3)
    assert set(tr.routers) == {0, 1, 2, 3} and tr.routers[0].shape == (8, 64)


def test_interrupt_leaves_valid_shards_and_resume_completes(tiny, tmp_path):
    from moectl.artifacts.trace_dir import read_meta, read_trace_dir

    ckpt, data = tiny
    _, full = _profile(ckpt, data, tmp_path / "full", max_tokens=16, generate=3, hidden_samples=7, shard_rows=1)
    calls = {"n": 0}

    def stop_after_two_samples(done, total):   # progress is called per forward; Ctrl-C mid third sample
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt

    _, part = _profile(ckpt, data, tmp_path / "t", max_tokens=16, generate=3, hidden_samples=7, shard_rows=1,
                       progress=stop_after_two_samples)
    assert part.interrupted and 0 < part.samples < 5
    meta = read_meta(tmp_path / "t")
    assert meta["samples_done"] == part.samples and len(meta["shards"]) == part.samples   # one shard per sample
    partial = read_trace_dir(tmp_path / "t")
    _, rest = _profile(ckpt, data, tmp_path / "t", max_tokens=16, generate=3, hidden_samples=7, shard_rows=1,
                       resume=True)
    assert rest.skipped == part.samples and part.samples + rest.samples == 5
    a, b = read_trace_dir(tmp_path / "full"), read_trace_dir(tmp_path / "t")
    np.testing.assert_array_equal(a.experts, b.experts)
    assert a.request == b.request and partial.request == a.request[:partial.num_tokens]
    assert len(a.hidden.token_index) == 7 and a.hidden.token_index.tolist() == b.hidden.token_index.tolist()


def test_fingerprint_mismatch_and_truncated_shard_are_clear_errors(tiny, tmp_path):
    from moectl.artifacts.trace_dir import read_trace_dir
    from moectl.artifacts.trace_dir import load_trace

    ckpt, data = tiny
    eng, _ = _profile(ckpt, data, tmp_path / "t", max_tokens=8, shard_rows=8)
    read_trace_dir(tmp_path / "t", expect_fingerprint=eng.fingerprint)          # the right model reads fine
    with pytest.raises(MoectlError, match="was made for model mixtral:"):
        read_trace_dir(tmp_path / "t", expect_fingerprint="qwen3_moe:0123456789ab")
    shard = sorted((tmp_path / "t").glob("shard-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-40])                                 # lose the end of the data
    with pytest.raises(MoectlError, match="truncated or corrupt"):
        load_trace(tmp_path / "t")
    (tmp_path / "t" / "meta.json").unlink()
    with pytest.raises(MoectlError, match="meta.json is missing"):
        load_trace(tmp_path / "t")


def test_profile_cli_json_and_export(cli, tiny, tmp_path):
    from moectl.artifacts.trace_dir import load_trace

    ckpt, data = tiny
    r = cli(["profile", "--model", str(ckpt), "--dataset", str(data), "--max-tokens", "12",
             "--generate", "2", "--hidden-samples", "5", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    out = tmp_path / "home" / "tinymix" / "traces"                              # default: <workdir>/traces
    assert summary["out"] == str(out) and summary["samples"] == 5 and summary["hidden_samples"] == 5
    r = cli(["trace", "export", str(out), "--out", str(tmp_path / "t.jsonl")])
    assert r.exit_code == 0, r.output
    a, b = load_trace(out), load_trace(tmp_path / "t.jsonl")
    np.testing.assert_array_equal(a.experts, b.experts)
    np.testing.assert_array_equal(a.weights, b.weights)                         # fp16 -> shortest decimal -> fp16
    assert a.request == b.request and a.phase.tolist() == b.phase.tolist()


def test_hidden_row_draw_is_exact_and_reproducible():
    from moectl.calib.profile import choose_hidden_rows

    a = choose_hidden_rows([5, 0, 7, 3], 6, seed=1)
    assert sum(len(s) for s in a) == 6 and a == choose_hidden_rows([5, 0, 7, 3], 6, seed=1)
    assert all(r < n for s, n in zip(a, [5, 0, 7, 3]) for r in s)
    assert sum(len(s) for s in choose_hidden_rows([5, 7], 100)) == 12
    assert choose_hidden_rows([2, 3], "all") == [{0, 1}, {0, 1, 2}]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_other_families_dense_first_layer_and_router_bias(family, tiny, tmp_path):
    """DeepSeek-V3 (dense layer 0: MoE layers are model layers 1..3) and GPT-OSS (router bias, `router`
    attribute): recorded ids equal the ids the experts module of the reference model receives."""
    from transformers import AutoModelForCausalLM

    from moectl.artifacts.trace_dir import read_trace_dir

    ckpt = tmp_path / family
    build_family(family, ckpt)
    _tokenizer(ckpt)
    eng, res = _profile(ckpt, tiny[1], tmp_path / "t", max_tokens=10, generate=2, router_logits=True)
    tr = read_trace_dir(tmp_path / "t", expect_fingerprint=eng.fingerprint)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    blocks = [(i, layer.mlp) for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "experts")]
    assert tr.moe_layer_ids == [i for i, _ in blocks] == ([1, 2, 3] if family == "deepseek_v3" else [0, 1, 2, 3])
    assert set(tr.routers) == set(range(len(blocks)))
    assert (tr.router_bias is not None) == (family == "gpt_oss")
    seen: dict[int, torch.Tensor] = {}
    hooks = [blk.experts.register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(l, a[1].clone()))
             for l, (_, blk) in enumerate(blocks)]
    with torch.no_grad():
        for _, rows in tr.request_slices():              # the recorded tokens, teacher-forced in one forward
            ref(torch.tensor([tr.tokens[rows].tolist()]))
            got = np.stack([seen[l].numpy() for l in range(len(blocks))], 1)     # [n, L, K]
            np.testing.assert_array_equal(np.sort(got, -1), np.sort(tr.experts[rows], -1))
    for h in hooks:
        h.remove()
    assert tr.router_logits.shape == (tr.num_tokens, len(blocks), 8) and res.decode_tokens > 0
