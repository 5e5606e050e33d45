"""Trace directories: exact JSONL round-trip of the shared traces, shards, errors, EAMs.

Legend: N = tokens, L = MoE layers, K = top-k, E = experts, D = hidden size.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moectl.artifacts.trace_dir import TraceWriter, export_jsonl, import_jsonl, read_meta, read_trace_dir
from moectl.errors import MoectlError
from moectl.artifacts.trace_dir import load_trace
from moectl.core.trace import DECODE, PREFILL, Trace, expert_activation_matrices, expert_activation_matrix

from shared_data import SHARED, TRACE_FILES as TRACES, needs_shared  # noqa: E402


@needs_shared
@pytest.mark.parametrize("src", TRACES, ids=lambda p: p.name)
def test_import_export_round_trips_shared_traces_byte_for_byte(src, tmp_path):
    meta = import_jsonl(src, tmp_path / "t", model_name="some-model")
    export_jsonl(tmp_path / "t", tmp_path / "out.jsonl")
    assert (tmp_path / "out.jsonl").read_bytes() == src.read_bytes()
    a, b = load_trace(src), read_trace_dir(tmp_path / "t")
    assert meta["model"] == b.model == "some-model" and meta["num_tokens"] == a.num_tokens
    np.testing.assert_array_equal(a.experts, b.experts)
    assert a.request == b.request and (a.pos == b.pos).all() and (a.phase == b.phase).all()
    assert (a.weights is None) == (b.weights is None)


@needs_shared
def test_trace_cli_import_export(cli, tmp_path):
    src = SHARED / "traces" / "mixtral-8x7b.gsm8k.jsonl"
    r = cli(["trace", "import", str(src), "--model-name", "mixtral", "--out", str(tmp_path / "t"),
             "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["tokens"] == 244 and info["requests"] == 2 and info["weights"] is True
    r = cli(["trace", "export", str(tmp_path / "t"), "--out", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o.jsonl").read_bytes() == src.read_bytes()
    eams = expert_activation_matrices(load_trace(tmp_path / "t"))
    assert list(eams) == ["gsm8k_2-0", "gsm8k_2-1"]
    assert all(m.shape == (32, 8) for m in eams.values())
    assert sum(m.sum() for m in eams.values()) == 244 * 32 * 2        # every token ran 2 experts per layer


def _toy(n_req=3, n=5, L=2, K=2, E=4, D=3, seed=0):
    rng = np.random.default_rng(seed)
    reqs = []
    for r in range(n_req):
        ex = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])
        w = rng.random((n, L, K)).astype(np.float16)
        hid = np.array([0, n - 1])
        reqs.append(dict(request=f"r{r}", pos=np.arange(n), phase=[PREFILL] * 3 + [DECODE] * (n - 3), experts=ex,
                         weights=w, hidden_index=hid, moe_inputs=rng.standard_normal((2, L, D)),
                         prev_final=rng.standard_normal((2, D)), tokens=rng.integers(0, 100, n)))
    return reqs


def test_writer_shards_and_reader_reassemble_rows_and_hidden_samples(tmp_path):
    reqs = _toy()
    w = TraceWriter(tmp_path, {"model": "toy", "fingerprint": "mixtral:aaaaaaaaaaaa", "num_layers": 2,
                               "num_experts": 4, "top_k": 2, "hidden_size": 3}, shard_rows=6)
    for r in reqs:
        w.add_request(**r)
    meta = w.close()
    assert [s["rows"] for s in meta["shards"]] == [10, 5]        # whole requests per shard, flushed at >= 6 rows
    assert meta["num_tokens"] == 15 and meta["samples_done"] == 3 and meta["hidden_samples"]["count"] == 6
    t = read_trace_dir(tmp_path)
    assert t.request == ["r0"] * 5 + ["r1"] * 5 + ["r2"] * 5
    np.testing.assert_array_equal(t.experts, np.concatenate([r["experts"] for r in reqs]))
    np.testing.assert_array_equal(t.weights, np.concatenate([r["weights"] for r in reqs]))
    assert t.hidden.token_index.tolist() == [0, 4, 5, 9, 10, 14]           # global rows across shards
    np.testing.assert_allclose(t.hidden.moe_inputs[3], reqs[1]["moe_inputs"][1].astype(np.float16))
    assert t.tokens.tolist() == np.concatenate([r["tokens"] for r in reqs]).tolist()
    # EAM per request equals the plain EAM over that request's rows
    eams = expert_activation_matrices(t)
    for req, rows in t.request_slices():
        np.testing.assert_array_equal(eams[req], expert_activation_matrix(t, rows))
        assert eams[req].sum() == 5 * 2 * 2
    sub = t.select(slice(5, 10))                                           # hidden samples follow their rows
    assert sub.hidden.token_index.tolist() == [0, 4] and sub.tokens.tolist() == reqs[1]["tokens"].tolist()


def test_resume_keeps_shards_and_rejects_another_model(tmp_path):
    reqs = _toy()
    base = {"model": "toy", "fingerprint": "mixtral:aaaaaaaaaaaa", "num_layers": 2, "num_experts": 4, "top_k": 2}
    w = TraceWriter(tmp_path, base, shard_rows=1)
    w.add_request(**reqs[0])
    w2 = TraceWriter(tmp_path, base, shard_rows=1, resume=True)
    assert w2.samples_done == 1
    w2.add_request(**reqs[1])
    w2.close()
    assert read_trace_dir(tmp_path).request == ["r0"] * 5 + ["r1"] * 5
    with pytest.raises(MoectlError, match="fingerprint"):
        TraceWriter(tmp_path, {**base, "fingerprint": "olmoe:bbbbbbbbbbbb"}, resume=True)
    TraceWriter(tmp_path, base)                                            # a fresh run starts over
    assert read_meta(tmp_path)["num_tokens"] == 0 and not list(tmp_path.glob("shard-*"))


def test_corrupt_directories_are_clear_errors(cli, tmp_path):
    base = {"model": "toy", "fingerprint": "mixtral:aaaaaaaaaaaa", "num_layers": 2, "num_experts": 4, "top_k": 2}
    w = TraceWriter(tmp_path, base, shard_rows=1)
    for r in _toy():
        w.add_request(**r)
    w.close()
    with pytest.raises(MoectlError, match=r"made for model mixtral:aaaaaaaaaaaa.*olmoe:bbbbbbbbbbbb"):
        read_trace_dir(tmp_path, expect_fingerprint="olmoe:bbbbbbbbbbbb")
    (tmp_path / "shard-00002.safetensors.tmp").write_bytes(b"junk")         # an interrupted write: ignored
    assert read_trace_dir(tmp_path).num_tokens == 15
    shard = tmp_path / "shard-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(MoectlError, match="shard-00001.safetensors is truncated or corrupt"):
        read_trace_dir(tmp_path)
    shard.unlink()
    with pytest.raises(MoectlError, match="shard-00001.safetensors is missing"):
        read_trace_dir(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(MoectlError, match="corrupt"):
        read_trace_dir(tmp_path)
    r = cli(["trace", "export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.jsonl")])
    assert r.exit_code != 0 and isinstance(r.exception, MoectlError) and "meta.json is missing" in str(r.exception)


def test_write_jsonl_of_a_profiled_trace_uses_short_decimals(tmp_path):
    from moectl.artifacts.routing_jsonl import write_jsonl

    t = Trace("m", 1, 4, 2, ["a", "a"], np.array([0, 1], np.int32), np.array([0, 1], np.uint8),
              np.array([[[3, -1]], [[0, 2]]], np.int16), np.array([[[0.8003, 0]], [[0.6, 0.4]]], np.float16))
    write_jsonl(t, tmp_path / "t.jsonl")
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["format"] == "moe-routing-v1"
    assert lines[1] == '{"request": "a", "pos": 0, "phase": "prefill", "experts": [[3]], "weights": [[0.8003]]}'
    back = load_trace(tmp_path / "t.jsonl")
    np.testing.assert_array_equal(back.experts, t.experts)
    np.testing.assert_array_equal(back.weights, t.weights)


@needs_shared
def test_import_under_a_recipe_name_checks_the_shape(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    src = str(SHARED / "traces" / "olmoe.math.jsonl")
    r = cli(["trace", "import", src, "--model-name", "mixtral"])
    assert r.exit_code != 0 and "does not fit recipe 'mixtral'" in str(r.exception)
    assert not (tmp_path / "home" / "mixtral").exists()                    # nothing written
    r = cli(["trace", "import", src, "--model-name", "olmoe"])
    assert r.exit_code == 0, r.output
    assert read_meta(tmp_path / "home" / "olmoe" / "traces")["num_tokens"] == 512   # default: <workdir>/traces
