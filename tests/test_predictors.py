"""Predictors (issue 5): metrics, mlp vs gate reuse, aux gate vs frequency, artifact, CLI, routing cross-file.

The hidden-state predictors are checked on a briefly trained 6-layer Mixtral (byte vocabulary, stdlib
docstrings): a random model routes almost at random, a trained one has structure to learn. It is profiled with
forward hooks the way `moectl profile` records: MoE-block input (after the post-attention norm), the router's
top-k, and the final norm's output of the previous token.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moectl.errors import MoectlError
from moectl.predictors.file import load_predictors, save_predictors
from moectl.predictors.metrics import set_metrics
from moectl.predictors.mlp import measure_predict_cost
from moectl.predict.train import (TEST, TRAIN, VAL, gather_hidden, split_rows, train_aux_gate, train_mlp)
from moectl.core.trace import HiddenSamples, Trace

from shared_data import SHARED_TRACES, needs_shared  # noqa: E402
DOC_MODULES = ["json", "os", "re", "collections", "textwrap", "argparse", "logging", "typing", "functools",
               "itertools", "pathlib", "subprocess", "string", "random", "statistics", "datetime", "csv", "shutil"]


def _corpus() -> bytes:
    parts = []
    for name in DOC_MODULES:
        m = importlib.import_module(name)
        parts.append(inspect.getdoc(m) or "")
        parts += [inspect.getdoc(v) or "" for k, v in sorted(vars(m).items())
                  if not k.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))]
    return "\n\n".join(p for p in parts if p).encode("utf-8", "replace")


def _train_mini_mixtral(layers: int = 6, steps: int = 80, seed: int = 0, lr: float = 3e-3, aux: float = 0.3):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=128, router_aux_loss_coef=aux, output_router_logits=True,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = MixtralForCausalLM(cfg)
    data = torch.from_numpy(np.frombuffer(_corpus(), dtype=np.uint8).astype(np.int64))
    cut = int(0.9 * len(data))
    train, held_out = data[:cut], data[cut:]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(train) - 65, (8,), generator=gen).tolist()
        x = torch.stack([train[s:s + 64] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), held_out


@torch.no_grad()
def profile_with_hooks(model, ids: torch.Tensor, requests: int, seq: int, fingerprint: str) -> Trace:
    """Teacher-forced requests of `seq` tokens -> a Trace with hidden samples for every row and the routers."""
    L = model.config.num_hidden_layers
    cap: dict = {}
    hooks = [model.model.norm.register_forward_hook(lambda m, a, o: cap.__setitem__("final", o))]
    for l, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a, l=l: cap.__setitem__(("in", l), a[0])))
        hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, o, l=l: cap.__setitem__(("gate", l), o)))
    ex, w, mi, pf, req, pos = [], [], [], [], [], []
    for r in range(requests):
        model(input_ids=ids[r * seq:(r + 1) * seq][None])
        ex.append(np.stack([cap[("gate", l)][2].numpy() for l in range(L)], 1))      # [T, L, K]
        w.append(np.stack([cap[("gate", l)][1].numpy() for l in range(L)], 1))
        mi.append(np.stack([cap[("in", l)][0].numpy() for l in range(L)], 1))       # [T, L, D]
        fin = cap["final"][0].numpy()                                                # [T, D]
        pf.append(np.concatenate([np.zeros_like(fin[:1]), fin[:-1]]))                # previous token's
        req += [f"req{r}"] * seq
        pos.append(np.arange(seq))
    for h in hooks:
        h.remove()
    N = len(req)
    return Trace(model="mini-mixtral", num_layers=L, num_experts=model.config.num_local_experts,
                 top_k=model.config.num_experts_per_tok, request=req, pos=np.concatenate(pos).astype(np.int32),
                 phase=np.zeros(N, np.uint8), experts=np.concatenate(ex).astype(np.int16),
                 weights=np.concatenate(w).astype(np.float16), fingerprint=fingerprint,
                 hidden=HiddenSamples(np.arange(N), np.concatenate(mi).astype(np.float16),
                                      np.concatenate(pf).astype(np.float16)),
                 routers={l: model.model.layers[l].mlp.gate.weight.detach().numpy().copy() for l in range(L)})


@pytest.fixture(scope="module")
def mini_trace() -> Trace:
    model, held_out = _train_mini_mixtral()
    return profile_with_hooks(model, held_out, requests=60, seq=64, fingerprint="mixtral:000000mini0")


@pytest.fixture(scope="module")
def trained(mini_trace):
    data = gather_hidden([mini_trace])
    mlp, mlp_metrics = train_mlp([mini_trace], [1, 2, 3], epochs=25, max_minutes=1.0, width=64, data=data)
    gate, aux_metrics = train_aux_gate([mini_trace], epochs=40, max_minutes=0.5, data=data)
    return data, mlp, mlp_metrics, gate, aux_metrics


# ---------------------------------------------------------------------------------------------- metrics
def test_set_metrics_by_hand():
    scores = np.array([[0.9, 0.8, 0.1, 0.0],        # top-2 {0,1}, truth {0,2}: 1 hit
                       [0.1, 0.2, 0.3, 0.4]])       # top-2 {3,2}, truth {3,2}: covered
    truth = np.array([[0, 2], [2, 3]], dtype=np.int16)
    m = set_metrics(scores, truth, [2, 3])
    assert m["recall@2"] == pytest.approx(0.75) and m["precision@2"] == pytest.approx(0.75)
    assert m["covered@2"] == pytest.approx(0.5)
    assert m["recall@3"] == pytest.approx(1.0)      # 3rd best of row 0 is expert 2
    assert m["precision@3"] == pytest.approx(2 / 3) and m["covered@3"] == pytest.approx(1.0)
    pad = set_metrics(scores, np.array([[0, -1], [-1, -1]], dtype=np.int16), [2])   # -1 = none; empty rows skipped
    assert pad["tokens"] == 1 and pad["recall@2"] == 1.0 and pad["precision@2"] == 0.5


def test_split_is_by_request_and_deterministic(mini_trace):
    s = split_rows(mini_trace)
    assert np.array_equal(s, split_rows(mini_trace))
    assert {int(v) for v in np.unique(s)} == {TRAIN, VAL, TEST}
    for _, sl in mini_trace.request_slices():                 # a request never straddles two splits
        assert len(np.unique(s[sl])) == 1
    assert 0.6 < (s == TRAIN).mean() < 0.9


# ------------------------------------------------------------------------------------ hidden predictors
def test_mlp_beats_gate_reuse(trained):
    _, _, m, _, _ = trained
    k = m["ks"][0]
    r = {d: m["lookahead"][str(d)]["mean"] for d in (1, 2, 3)}
    print({d: (round(v["mlp"][f"recall@{k}"], 3), round(v["gate_reuse"][f"recall@{k}"], 3),
               round(v["frequency"][f"recall@{k}"], 3)) for d, v in r.items()})
    assert r[1]["mlp"][f"recall@{k}"] >= r[1]["gate_reuse"][f"recall@{k}"]
    for d in (2, 3):
        assert r[d]["mlp"][f"recall@{k}"] >= r[d]["gate_reuse"][f"recall@{k}"] + 0.05
        assert r[d]["mlp"][f"recall@{k}"] > r[d]["frequency"][f"recall@{k}"] + 0.05
    # per layer too, and the table has the wider k's and precision / coverage
    for d in (1, 2, 3):
        for row in m["lookahead"][str(d)]["per_layer"]:
            assert row["target"] - row["source"] == d
            assert row["mlp"][f"recall@{k}"] >= row["gate_reuse"][f"recall@{k}"] - 0.02
            assert {f"recall@{k + 2}", f"precision@{k}", f"covered@{k}"} <= row["mlp"].keys()


def test_aux_gate_beats_frequency(trained):
    *_, aux = trained
    k = aux["ks"][0]
    print(aux["aux_gate"], aux["frequency"])
    assert aux["aux_gate"][f"recall@{k}"] > aux["frequency"][f"recall@{k}"]


def test_predict_scores_matches_batch(trained):
    data, mlp, _, gate, _ = trained
    h = data.moe_inputs[5, 2].astype(np.float32)
    one = mlp.predict_scores(2, h)
    batch = mlp.predict_batch(2, h[None])
    assert sorted(one) == [3, 4, 5]
    for t in one:
        np.testing.assert_allclose(one[t], batch[t][0], rtol=1e-4, atol=1e-5)
    assert mlp.predict_scores(5, h) == {}                    # last layer: nothing after it
    np.testing.assert_allclose(mlp.predict_scores(2, torch.from_numpy(h))[3], one[3], rtol=1e-6)
    pf = data.prev_final[5].astype(np.float32)
    np.testing.assert_allclose(gate.predict_scores(pf), gate.predict_batch(pf[None])[0], rtol=1e-4, atol=1e-5)


# -------------------------------------------------------------------------------------------- artifact
def test_artifact_round_trip_and_wrong_model(trained, tmp_path):
    data, mlp, m, gate, aux = trained
    fp = "mixtral:000000mini0"
    save_predictors(tmp_path, fingerprint=fp, model="mini", num_layers=6, num_experts=8, top_k=2,
                    lookahead=[1, 2, 3], mlp=mlp, aux_gate=gate, metrics={"mlp": m, "aux_gate": aux})
    meta = json.loads((tmp_path / "predictors.json").read_text())
    assert meta["kinds"] == ["mlp", "aux_gate"] and meta["fingerprint"] == fp and meta["format_version"] == 1
    assert meta["architecture"]["mlp"]["width"] == 64 and meta["metrics"]["mlp"]["lookahead"]["2"]
    ps = load_predictors(tmp_path / "predictors.json", expect_fingerprint=fp)
    assert ps.routing is None and ps.kinds == ["mlp", "aux_gate"]
    h = data.moe_inputs[7, 1].astype(np.float32)
    for t, s in mlp.predict_scores(1, h).items():
        np.testing.assert_allclose(ps.mlp.predict_scores(1, h)[t], s, rtol=1e-6)
    np.testing.assert_allclose(ps.aux_gate.predict_scores(h), gate.predict_scores(h), rtol=1e-6)
    with pytest.raises(MoectlError, match="made for model mixtral:000000mini0.*qwen2_moe:abcdefabcdef"):
        load_predictors(tmp_path, expect_fingerprint="qwen2_moe:abcdefabcdef")
    with pytest.raises(MoectlError, match="no predictors"):
        load_predictors(tmp_path / "elsewhere")
    # re-saving one kind keeps the other kind of the same model; another model replaces everything
    save_predictors(tmp_path, fingerprint=fp, model="mini", num_layers=6, num_experts=8, top_k=2, lookahead=[1],
                    aux_gate=gate)
    assert load_predictors(tmp_path).kinds == ["mlp", "aux_gate"]
    save_predictors(tmp_path, fingerprint="mixtral:ffffffffffff", model="other", num_layers=6, num_experts=8,
                    top_k=2, lookahead=[1], aux_gate=gate)
    assert load_predictors(tmp_path).kinds == ["aux_gate"]


def test_prediction_cost_mixtral_sizes():
    # Shapes only: the cost itself (goal <= 0.3 ms/layer) is a benchmark figure, `moectl bench --what predictor`.
    r = measure_predict_cost(repeats=5)                      # D=4096, E=8, lookaheads 1,2,3
    assert r["hidden_size"] == 4096 and r["params_per_layer"] > 500_000
    assert r["ms_per_layer_median"] > 0


# ------------------------------------------------------------------------------------------------- CLI
def _write_trace_dir(trace: Trace, out: Path) -> Path:
    from moectl.artifacts.trace_dir import TraceWriter

    w = TraceWriter(out, {"model": trace.model, "family": "mixtral", "fingerprint": trace.fingerprint,
                          "num_layers": trace.num_layers, "moe_layer_ids": list(range(trace.num_layers)),
                          "num_experts": trace.num_experts, "top_k": trace.top_k,
                          "hidden_size": int(trace.hidden.moe_inputs.shape[2]),
                          "hidden_samples": {"mode": "all"}})
    for rid, sl in trace.request_slices():
        n = sl.stop - sl.start
        w.add_request(rid, trace.pos[sl], trace.phase[sl], trace.experts[sl], trace.weights[sl],
                      hidden_index=np.arange(n), moe_inputs=trace.hidden.moe_inputs[sl],
                      prev_final=trace.hidden.prev_final[sl])
    w.write_routers(trace.routers)
    w.close()
    return out


def test_cli_train_predictor(cli, mini_trace, tmp_path, monkeypatch):
    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    tdir = _write_trace_dir(mini_trace, tmp_path / "traces")
    out = tmp_path / "pred"
    res = cli(["train-predictor", "--traces", str(tdir), "--kind", "mlp", "--lookahead", "1,2",
               "--epochs", "3", "--width", "32", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout[res.stdout.index("{"):])
    assert result["kinds"] == ["mlp"] and result["lookahead"] == [1, 2]
    assert result["fingerprint"] == mini_trace.fingerprint
    row = result["metrics"]["mlp"]["lookahead"]["1"]["per_layer"][0]
    assert {"mlp", "gate_reuse", "frequency"} <= row.keys()
    ps = load_predictors(out, expect_fingerprint=mini_trace.fingerprint)
    assert ps.mlp.lookaheads == [1, 2] and ps.mlp.targets(0) == [1, 2]
    # human output: one table per lookahead
    res = cli(["train-predictor", "--traces", str(tdir), "--kind", "aux-gate",
               "--epochs", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "aux gate" in res.output and load_predictors(out).kinds == ["mlp", "aux_gate"]


def test_cli_errors(tmp_path):
    from moectl.predict.pipeline import run_train_predictor

    with pytest.raises(MoectlError, match="--traces"):
        run_train_predictor()
    with pytest.raises(MoectlError, match="--kind"):
        run_train_predictor(traces=[tmp_path], kind="nope")
    with pytest.raises(MoectlError, match="--lookahead"):
        run_train_predictor(traces=[tmp_path], lookahead="1,x")
    if SHARED_TRACES.exists():
        with pytest.raises(MoectlError, match="hidden-state samples"):
            run_train_predictor(traces=[SHARED_TRACES / "olmoe.math.jsonl"], kind="mlp")


# --------------------------------------------------------------------------------------- routing predictor
@needs_shared
@pytest.mark.parametrize("model", ["olmoe", "qwen", "gptoss", "granite"])
def test_routing_other_file_beats_frequency(model):
    """Trained on <model>.math, tested on <model>.code (never on itself): beats the popularity baseline.

    Kept short for the suite (first 160 decode tokens of each file, lookahead 1); the full matrix
    (both directions, lookahead 1-3, all 512 tokens) is in the train-predictor report."""
    from moectl.predict.train import evaluate_routing, train_routing
    from moectl.artifacts.trace_dir import load_trace

    train = load_trace(SHARED_TRACES / f"{model}.math.jsonl").select(slice(0, 160))
    test = load_trace(SHARED_TRACES / f"{model}.code.jsonl").select(slice(0, 160))
    pred, _ = train_routing([train], [1], epochs=60, max_minutes=1.0)
    ev = evaluate_routing(pred, test, [train])
    k = ev["ks"][0]
    mean = ev["lookahead"]["1"]["mean"]
    print(model, {c: round(v[f"recall@{k}"], 3) for c, v in mean.items()})
    assert mean["routing"]["tokens"] == 160 * (test.num_layers - 1)
    assert mean["routing"][f"recall@{k}"] > mean["frequency"][f"recall@{k}"] + 0.05


@needs_shared
def test_cli_routing_needs_no_model(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    src = tmp_path / "gptoss.math.jsonl"                 # a short copy: header + 96 tokens
    src.write_text("".join((SHARED_TRACES / "gptoss.math.jsonl").read_text().splitlines(True)[:97]))
    res = cli(["train-predictor", "--traces", str(src), "--kind", "routing", "--lookahead", "1",
               "--epochs", "20", "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout[res.stdout.index("{"):])
    assert result["kinds"] == ["routing"] and result["fingerprint"] is None
    out = Path(result["out"])
    assert out.parent.parent == tmp_path / "home"       # default: $MOECTL_HOME/<model name from the trace>
    ps = load_predictors(out, expect_fingerprint="gpt_oss:0123456789ab")   # no fingerprint: nothing to check
    assert ps.kinds == ["routing"] and ps.routing.lookahead == [1]
    assert ps.meta["num_layers"] == 24 and ps.meta["num_experts"] == 32


def test_traces_of_another_model_are_refused(mini_trace, tmp_path):
    """--model M with --traces profiled from another model: a clear error, not silent training."""
    from model_factory import build_family

    from moectl.predict.pipeline import run_train_predictor

    build_family("mixtral", tmp_path / "ck")
    tdir = _write_trace_dir(mini_trace, tmp_path / "traces")
    with pytest.raises(MoectlError, match=r"trace .* was made for model mixtral:000000mini0, but the model loaded is"):
        run_train_predictor(model=str(tmp_path / "ck"), traces=[tdir], kind="mlp", epochs=1,
                            out=tmp_path / "pred")
