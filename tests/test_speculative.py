"""Speculative decoding (issue 33), runtime side: the acceptance math exactly, greedy identity with each draft source
on the tiny model, KV rollback, the cached draft touching nothing, the sampled distribution, clear errors."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from moectl.errors import MoectlError
from moectl.runtime.sampling import (Sampling, accept_greedy, accept_probability, accept_sampled, draw, make_rng,
                                     residual, token_distribution)
from moectl.runtime.speculative import as_numpy

PROMPT = [5, 97, 211, 42, 300, 17, 88, 150]          # token ids of the tiny model's vocabulary (512)


# --- the acceptance math, exactly -------------------------------------------------------------------
CASES = [([0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]),
         ([0.1, 0.1, 0.8, 0.0], [0.7, 0.2, 0.05, 0.05]),
         ([0.0, 1.0, 0.0, 0.0], [0.4, 0.1, 0.5, 0.0]),
         ([0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25])]


@pytest.mark.parametrize("p,q", CASES)
def test_one_position_emits_the_target_distribution_exactly(p, q):
    p, q = np.array(p), np.array(q)                                 # float64 [V]
    # by hand: P(x) = q(x) min(1, p(x)/q(x)) + P(reject) * norm(max(0, p - q))(x)
    keep = [float(q[x]) * accept_probability(p, q, x) for x in range(4)]
    r = residual(p, q)
    by_hand = np.array([keep[x] + (1 - sum(keep)) * float(r[x]) for x in range(4)])
    np.testing.assert_allclose(by_hand, p, atol=1e-12, rtol=0)
    np.testing.assert_allclose(token_distribution(p, q), p, atol=1e-12, rtol=0)


def test_sampled_acceptance_matches_p_by_monte_carlo():
    """accept_sampled itself (random draws, K=1): the emitted first token ~ p, and the acceptance rate is
    sum_x min(p(x), q(x)) exactly as the rule says."""
    p = np.array([[0.1, 0.1, 0.8, 0.0], [0.3, 0.3, 0.2, 0.2]], dtype=np.float32)      # [K+1, V]
    q = np.array([[0.7, 0.2, 0.05, 0.05]], dtype=np.float32)                          # [K, V]
    rng = make_rng(0)
    n, counts, accepted = 20000, np.zeros(4), 0
    for _ in range(n):
        x = draw(q[0], rng)
        a, tok = accept_sampled([x], p, q, rng)
        counts[x if a else tok] += 1
        accepted += a
    sigma = np.sqrt(p[0] * (1 - p[0]) / n)
    assert np.all(np.abs(counts / n - p[0]) <= 4 * sigma + 1e-9)
    assert abs(accepted / n - float(np.minimum(p[0], q[0]).sum())) < 4 * np.sqrt(0.25 / n)


def test_greedy_acceptance_is_the_argmax_prefix():
    logits = np.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]], dtype=np.float32)  # argmax 1, 0, 2
    assert accept_greedy([1, 0], logits) == (2, 2)                  # both accepted, bonus = argmax of the last row
    assert accept_greedy([1, 2], logits) == (1, 0)                  # second rejected: the target's own token
    assert accept_greedy([0, 0], logits) == (0, 1)


# --- on the tiny model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_model(tiny_small, tmp_path_factory):
    """A smaller tiny draft: the tiny model cut to its first layer, sharing its tokenizer."""
    from moectl.synth.truncate import truncate_checkpoint

    return truncate_checkpoint(tiny_small, tmp_path_factory.mktemp("draft") / "tiny-1layer", 1)


def _load(tiny_small, **kw):
    from moectl.runtime.engine import Engine

    return Engine.load(str(tiny_small), progress=False, threads=1, **kw)


def _tokens(eng, drafting: bool, n: int = 24, **kw) -> list[int]:
    if eng.speculator is not None:
        eng.speculator.enabled = drafting
    return eng.generate(input_ids=PROMPT, max_new_tokens=n, stop_at_eos=False, **kw).token_ids


CONFIGS = {   # (emulated device, cache size, prefetch, cpu experts): a small cache, prefetch and CPU experts on/off
    "emulated-2slots": dict(emulate_device=True, cache_experts=4, prefetch="none", cpu_experts="never"),
    "emulated-prefetch": dict(emulate_device=True, cache_experts=6, prefetch="gate-reuse", cpu_experts="never"),
    "emulated-cpu-experts": dict(emulate_device=True, cache_experts=4, prefetch="gate-reuse", cpu_experts="always"),
    "in-place": dict(),
}


@pytest.mark.parametrize("source", ["cached", "model"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_output_is_identical_with_drafting(tiny_small, draft_model, source, config):
    draft = "cached" if source == "cached" else str(draft_model)
    eng = _load(tiny_small, draft=draft, draft_tokens=3, draft_rule="always", **CONFIGS[config])
    plain = _tokens(eng, False)
    eng.speculator.enabled = True
    res = eng.generate(input_ids=PROMPT, max_new_tokens=24, stop_at_eos=False)
    assert res.token_ids == plain
    d = res.stats["draft"]
    assert d["passes"] < 23 and d["drafted"] > 0                 # it really drafted, several tokens per pass
    assert d["tokens_per_pass"] == pytest.approx(23 / d["passes"])
    assert d["acceptance"]["format"] == "moectl-acceptance" and len(d["acceptance"]["per_position"]) >= 1
    if config == "in-place" and source == "cached":
        assert d["accepted"] == d["drafted"] and "self-drafting" in d["note"]     # the full model drafting itself


def test_cached_draft_touches_nothing(tiny_small):
    """A draft reads resident slots only: no counter, no policy, no slot, no copy, no CPU compute, KV as before."""
    eng = _load(tiny_small, emulate_device=True, cache_experts=4, prefetch="gate-reuse", draft="cached",
                cpu_experts="always")
    logits, pkv = eng.forward(torch.tensor([PROMPT]))
    cache, rt = eng.cache, eng.runtime
    state = copy.deepcopy((cache.state.counts, [{p: dict(pool.slot_of) for p, pool in layer.items()}
                                                for layer in cache.state.pools], cache.state.clock,
                           cache.state.predicted, cache.policy.__dict__))
    stats, calls, cpu, jobs = cache.stats.as_dict(), rt.expert_calls, rt.cpu_experts, dict(cache.jobs)
    n = pkv.get_seq_length()
    drafts, q = eng.speculator.drafter.draft(PROMPT + [int(logits[0, -1].argmax())], pkv, 3, Sampling(True))
    assert len(drafts) == 3 and q is None
    after = (cache.state.counts, [{p: dict(pool.slot_of) for p, pool in layer.items()}
                                  for layer in cache.state.pools], cache.state.clock, cache.state.predicted,
             cache.policy.__dict__)
    assert all(np.array_equal(state[0][p][ph], after[0][p][ph]) for p in state[0] for ph in state[0][p])
    assert state[1:4] == after[1:4] and repr(state[4]) == repr(after[4])
    assert cache.stats.as_dict() == stats and (rt.expert_calls, rt.cpu_experts) == (calls, cpu)
    assert dict(cache.jobs) == jobs and pkv.get_seq_length() == n


def test_rollback_leaves_the_kv_cache_as_if_the_rejected_tokens_never_ran(tiny_small):
    from moectl.runtime.speculative import rollback

    eng = _load(tiny_small, emulate_device=True, cache_experts=4)
    _, pkv = eng.forward(torch.tensor([PROMPT]))
    n = pkv.get_seq_length()
    _, pkv = eng.forward(torch.tensor([[7, 8, 9, 10]]), pkv, verify=True)          # last token + 3 drafts
    rollback(pkv, n + 2)                                                              # keep 7 and 8
    _, ref = eng.forward(torch.tensor([PROMPT]))
    _, ref = eng.forward(torch.tensor([[7, 8]]), ref, verify=True)                  # a run that never saw 9, 10
    assert pkv.get_seq_length() == ref.get_seq_length() == n + 2
    for a, b in zip(pkv.layers, ref.layers):
        assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
        assert torch.equal(a.keys[..., :n, :], b.keys[..., :n, :])                # the prompt's: untouched
        assert torch.allclose(a.keys, b.keys, atol=1e-6, rtol=0) and torch.allclose(a.values, b.values, atol=1e-6,
                                                                                       rtol=0)
    # and decoding on goes on as if: the next logits equal the never-saw run's
    la, _ = eng.forward(torch.tensor([[11]]), pkv)
    lb, _ = eng.forward(torch.tensor([[11]]), ref)
    assert torch.allclose(la, lb, atol=1e-5)


def test_sampled_output_follows_the_target_distribution(tiny_small, draft_model):
    """Seeded: the token a verification pass emits (the 2nd generated, K=1 with the 1-layer draft) is distributed
    as the target's p(. | prompt) marginalised over the first token: a chi-square test over the likely tokens."""
    eng = _load(tiny_small, draft=str(draft_model), draft_tokens=1, draft_rule="always")
    kw = dict(greedy=False, temperature=1.0, top_p=0.9)
    s = Sampling(False, 1.0, 0.9)
    logits, pkv = eng.forward(torch.tensor([PROMPT]))
    p1 = s.probs(as_numpy(logits[0, -1])).astype(np.float64)                     # [V]
    exact = np.zeros_like(p1)
    for t1 in np.flatnonzero(p1).tolist():
        l2, _ = eng.forward(torch.tensor([PROMPT + [t1]]))
        exact += p1[t1] * s.probs(as_numpy(l2[0, -1]))
    n, counts, passes = 600, np.zeros_like(exact), 0
    for seed in range(n):
        r = eng.generate(input_ids=PROMPT, max_new_tokens=3, stop_at_eos=False, seed=seed, **kw)
        counts[r.token_ids[1]] += 1
        passes += r.stats["draft"]["drafted"]
    assert passes == n                                               # every request verified one draft
    big = np.flatnonzero(exact * n >= 8)
    obs = np.append(counts[big], n - counts[big].sum())
    exp = np.append(exact[big] * n, n - exact[big].sum() * n)
    assert len(big) >= 3
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2), torch.tensor(chi2 / 2)))
    assert pvalue > 1e-3, (chi2, len(obs))


def test_a_draft_with_another_tokenizer_is_one_clear_error(tiny_small, tmp_path):
    from tests.model_factory import build_family, save_tokenizer

    other = tmp_path / "other"
    build_family("mixtral", other)
    save_tokenizer(other, vocab_size=400)
    with pytest.raises(MoectlError, match="tokenizer is not .*vocabulary"):
        _load(tiny_small, draft=str(other))


def test_cli_draft_errors_and_json(tiny_small, tmp_path, capsys, monkeypatch):
    from tests.model_factory import build_family, save_tokenizer
    from tests.test_bad_input import run_cli

    other = tmp_path / "other"
    build_family("mixtral", other)
    save_tokenizer(other, vocab_size=400)
    base = ["generate", "--model", str(tiny_small), "--prompt", "def read(path):", "-n", "6", "--greedy",
            "--threads", "1", "--json"]
    for flags, needle in (([str(other)], "tokenizer is not"), (["mtp"], "multi-token-prediction"),
                          (["cached", "--draft-rule", "never"], "--draft-rule must be")):
        code, _, err = run_cli(base + ["--draft", *flags], capsys, monkeypatch)
        assert code == 2 and "Traceback" not in err and needle in err, err
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1
    code, out, err = run_cli(base + ["--draft", "cached", "--draft-tokens", "2", "--draft-rule", "always",
                                     "--emulate-device", "--cache-experts", "4"], capsys, monkeypatch)
    assert code == 0, err
    out = json.loads(out.strip().splitlines()[-1])
    assert out["acceptance"]["format"] == "moectl-acceptance" and out["draft"]["rule"] == "always"
    assert out["config"]["draft"] == ["cached", "flag"]


def test_mtp_says_why_not():
    from transformers import DeepseekV3Config

    from moectl.runtime.speculative import mtp_unavailable

    msg = mtp_unavailable(DeepseekV3Config(num_nextn_predict_layers=1, num_hidden_layers=4))
    assert "cannot load them" in msg and "model.layers.4" in msg
    assert "ships no" in mtp_unavailable(DeepseekV3Config(num_nextn_predict_layers=0))


def test_bench_and_eval_report_drafting(tiny_small, tmp_path, capsys, monkeypatch):
    """bench --draft: the row moectl+draft beside moectl, the same tokens, --acceptance-out readable by the
    simulator's loader; eval --draft: greedy agreement with drafting against without is 1."""
    from moectl.policies.draft_length import load_acceptance
    from tests.test_bad_input import run_cli

    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    acc = tmp_path / "acc.json"
    code, out, err = run_cli(["bench", "--model", str(tiny_small), "--baselines", "all-resident", "--repeat", "1",
                              "--prompt-len", "8", "--gen-len", "12", "--threads", "1", "--cache-experts", "4",
                              "--prefetch", "none", "--draft", "cached", "--draft-tokens", "2", "--draft-rule",
                              "always", "--acceptance-out", str(acc), "--json"], capsys, monkeypatch)
    assert code == 0, err
    b = json.loads(out)
    row = b["runs"]["moectl+draft"]
    assert row["draft"]["same_tokens_as_without"] is True and row["draft"]["tokens_per_pass"] > 1
    assert {"decode_ms_per_token", "bytes_per_token", "hit_rate"} <= set(row)
    a = load_acceptance(str(acc))
    assert a.per_position == b["acceptance"]["per_position"] and a.passes == row["draft"]["acceptance"]["passes"]
    code, out, err = run_cli(["eval", "--model", str(tiny_small), "--dataset", "builtin", "--max-tokens", "64",
                              "--window", "32", "--prompts", "2", "--generate", "10", "--threads", "1",
                              "--emulate-device", "--cache-experts", "4", "--draft", "cached", "--draft-rule",
                              "always", "--json"], capsys, monkeypatch)
    assert code == 0, err
    e = json.loads(out)
    assert e["draft"]["greedy_agreement"] == 1.0 and e["draft"]["identical"] and e["draft"]["tokens"] == 20


def test_sliding_window_layers_roll_back(tmp_path):
    """GPT-OSS's sliding-window attention (window 32 in the factory model): drafts rolled back past the window keep
    greedy output identical (the KV cache records its past for crop)."""
    from moectl.runtime.engine import Engine
    from tests.model_factory import build_family

    build_family("gpt_oss", tmp_path / "gpt_oss")
    eng = Engine.load(str(tmp_path / "gpt_oss"), progress=False, threads=1, draft="cached", draft_tokens=3,
                      draft_rule="always", emulate_device=True, cache_experts=8)
    ids = list(range(5, 35))                                        # 30 prompt tokens + 30 generated > 32
    eng.speculator.enabled = False
    plain = eng.generate(input_ids=ids, max_new_tokens=30, stop_at_eos=False).token_ids
    eng.speculator.enabled = True
    res = eng.generate(input_ids=ids, max_new_tokens=30, stop_at_eos=False)
    assert res.token_ids == plain and res.stats["draft"]["accepted"] > 0


# Prompts whose decode may route more varied than PROMPT's: how varied one prompt's decode routing is belongs to the
# training run (one model continues PROMPT with a run of newlines, every token routed to the same experts).
VARIED_TEXTS = ("class Counter(dict):", "def bisect_left(a, x, lo=0, hi=None):",
                "Return a new sorted list from the items in iterable.")


def _varied_prompt(eng, window: int = 4, n: int = 12) -> list[int]:
    """Of PROMPT and VARIED_TEXTS' ids, the prompt whose plain greedy decode has the most `window`-token runs routed
    to more than top-k distinct experts in a layer (a verification pass of K = 3 drafts routes `window` tokens)."""
    class Rows:
        def __init__(self):
            self.rows = {}

        def on_route(self, layer, top_k_index, top_k_weights, hidden):
            if top_k_index.shape[0] == 1:
                self.rows.setdefault(layer, []).append(set(top_k_index[0].tolist()))

    scored = []
    for ids in [PROMPT] + [eng.tokenizer(t)["input_ids"] for t in VARIED_TEXTS]:
        obs = Rows()
        eng.add_observer(obs)
        eng.generate(input_ids=ids, max_new_tokens=n, stop_at_eos=False)
        eng.remove_observer(obs)
        k = max(len(r) for rows in obs.rows.values() for r in rows)
        runs = sum(len(set().union(*rows[t:t + window])) > k
                   for rows in obs.rows.values() for t in range(len(rows) - window + 1))
        scored.append((runs, -len(scored), ids))
    runs, _, ids = max(scored, key=lambda r: r[:2])
    assert runs > 0, f"no prompt's decode routes {window} tokens to more than the top-k experts of a layer: {scored}"
    return ids


def test_a_verification_pass_runs_its_latest_tokens_experts_last(tiny_small, monkeypatch):
    """The runtime orders a pass's experts as the simulator does (`policies/draft_length.py: pass_order`): the cache's
    chunks get that order in every multi-token decode call, and a prefill keeps ascending ids. (On a prompt whose
    decode routing varies, so that passes route more experts than one token does.)"""
    import moectl.runtime.offloaded as offloaded

    prompt = _varied_prompt(_load(tiny_small, **CONFIGS["emulated-2slots"]))
    eng = _load(tiny_small, draft="cached", draft_tokens=3, draft_rule="always", **CONFIGS["emulated-2slots"])
    ordered, chunked = [], []
    real_order, real_chunks = offloaded.pass_order, eng.cache.chunks

    def spy_order(rows):
        ordered.append((rows, real_order(rows)))
        return ordered[-1][1]

    def spy_chunks(layer, experts, p):
        chunked.append((eng.cache.state.phase, list(experts)))
        return real_chunks(layer, experts, p)

    monkeypatch.setattr(offloaded, "pass_order", spy_order)
    monkeypatch.setattr(eng.cache, "chunks", spy_chunks)
    res = eng.generate(input_ids=prompt, max_new_tokens=12, stop_at_eos=False)
    assert res.stats["draft"]["passes"] < 11 and ordered                      # passes ran, each through pass_order
    assert all(len(rows) > 1 for rows, _ in ordered)                          # multi-token decode calls only
    passes = [experts for phase, experts in chunked if phase == "decode" and len(experts) > 2]
    assert passes and all(any(experts == out for _, out in ordered) for experts in passes)
    # the order is not ascending in general (else the spy would show nothing): some pass differs from sorted ids
    assert any(out != sorted(out) for _, out in ordered)
    prefill = [experts for phase, experts in chunked if phase == "prefill"]
    assert prefill and all(experts == sorted(experts) for experts in prefill)
