"""moectl/policies/draft_length.py: acceptance math, its measurement, its file, and the rules that pick k."""

from __future__ import annotations

import json

import pytest

from moectl.errors import MoectlError
from moectl.policies.draft_length import (ACCEPTANCE_FORMAT, ACCEPTANCE_VERSION, Acceptance, AcceptanceCounter,
                                          DraftRule, OnlineDraftRule, load_acceptance)


def test_expected_tokens_is_one_plus_the_chance_of_reaching_each_draft():
    a = Acceptance([0.8, 0.5])
    assert a.expected_tokens(0) == 1.0
    assert a.expected_tokens(1) == pytest.approx(1 + 0.8)
    assert a.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    # beyond the list the last value holds: p(2) = 0.5
    assert a.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    c = Acceptance.constant(0.85)
    assert c.expected_tokens(4) == pytest.approx(sum(0.85 ** j for j in range(5)))
    assert Acceptance.constant(1.0).expected_tokens(4) == 5.0
    assert Acceptance([]).p(3) == 0.0 and Acceptance([]).expected_tokens(4) == 1.0


def test_acceptance_rejects_values_outside_zero_one():
    with pytest.raises(MoectlError, match="position 2"):
        Acceptance([0.5, 1.5])


def test_counter_counts_each_position_conditionally_on_its_predecessors():
    c = AcceptanceCounter(prior_weight=0.0)
    c.record(3, 3)            # positions 0, 1, 2 tried and accepted
    c.record(3, 1)            # 0 accepted, 1 tried and rejected, 2 never tried
    c.record(2, 0)            # 0 tried and rejected
    c.record(0, 0)            # a plain step: no drafts, counts nothing
    assert c.tried == [3, 2, 1] and c.hits == [2, 1, 1]
    assert c.acceptance().per_position == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert c.passes == 3 and c.mean_accepted() == pytest.approx(4 / 3)
    with pytest.raises(ValueError):
        c.record(2, 3)


def test_counter_smooths_towards_its_prior():
    c = AcceptanceCounter(prior=0.5, prior_weight=1.0)
    c.record(1, 1)
    assert c.acceptance().per_position == pytest.approx([(1 + 0.5) / 2])
    assert AcceptanceCounter().acceptance().per_position == []


def test_acceptance_file_round_trip(tmp_path):
    a = Acceptance([0.9, 0.75, 0.6], passes=40, source="measured: tiny, --draft cached", fingerprint="abc123")
    f = tmp_path / "acc.json"
    f.write_text(json.dumps(a.to_json()))
    b = load_acceptance(str(f))
    assert b == a
    assert a.to_json()["format"] == ACCEPTANCE_FORMAT and a.to_json()["version"] == ACCEPTANCE_VERSION
    # a bench --json report holding it under "acceptance" reads the same
    r = tmp_path / "bench.json"
    r.write_text(json.dumps({"ms_per_token": 12.0, "acceptance": a.to_json()}))
    assert load_acceptance(str(r)) == a


def test_a_constant_is_a_float_like_string():
    a = load_acceptance("0.85")
    assert a.per_position == [0.85] and a.passes == 0 and "constant" in a.source
    assert load_acceptance(0.7).p(5) == 0.7
    with pytest.raises(MoectlError, match="probability"):
        load_acceptance("1.5")


@pytest.mark.parametrize("content,match", [
    ({"format": "moectl-trace", "version": 1}, "not an acceptance file"),
    ({"format": ACCEPTANCE_FORMAT, "version": ACCEPTANCE_VERSION + 1, "per_position": [0.5]}, "newer"),
    ({"format": ACCEPTANCE_FORMAT, "version": 1, "per_position": "0.5"}, "per_position"),
    ({"format": ACCEPTANCE_FORMAT, "version": 1, "per_position": [0.5, 2.0]}, "position 2"),
    ([0.5, 0.6], "not an acceptance file"),
])
def test_acceptance_file_of_another_format_is_a_clear_error(tmp_path, content, match):
    f = tmp_path / "acc.json"
    f.write_text(json.dumps(content))
    with pytest.raises(MoectlError, match=match) as e:
        load_acceptance(str(f))
    assert str(f) in str(e.value)


def test_missing_or_corrupt_acceptance_file_is_a_clear_error(tmp_path):
    with pytest.raises(MoectlError, match="neither a probability"):
        load_acceptance(str(tmp_path / "nope.json"))
    f = tmp_path / "bad.json"
    f.write_text("{not json")
    with pytest.raises(MoectlError, match="not valid JSON"):
        load_acceptance(str(f))


def pass_ms(step: float, per_extra_token: float):
    """A pass over k+1 tokens costs a step plus `per_extra_token` for each drafted token."""
    return lambda k: step + per_extra_token * k


def test_rule_drafts_when_passes_are_cheap_and_drafts_usually_right():
    # the union effect: 4 drafts cost 10 + 4*2 = 18 ms and produce 1 + .9 + .81 + .73 + .66 = 4.1 tokens
    assert DraftRule(4).choose(Acceptance.constant(0.9), pass_ms(10.0, 2.0)) == 4
    # expected tokens / ms at each k, checked by hand for k = 1
    rates = DraftRule(4).rates(Acceptance.constant(0.9), pass_ms(10.0, 2.0))
    assert rates[0] == pytest.approx(1 / 10) and rates[1] == pytest.approx(1.9 / 12)


def test_rule_picks_zero_when_acceptance_is_low_or_passes_expensive():
    assert DraftRule(4).choose(Acceptance.constant(0.05), pass_ms(10.0, 2.0)) == 0
    # each drafted token costs as much as a step: even p = 0.9 never pays
    assert DraftRule(4).choose(Acceptance.constant(0.9), pass_ms(10.0, 10.0)) == 0
    # a gain under the margin is not taken: k=1 gives 1.1 tokens in 10.7 ms = 1.028x a step, under 1.05
    assert DraftRule(1, margin=1.05).choose(Acceptance.constant(0.1), pass_ms(10.0, 0.7)) == 0
    assert DraftRule(1, margin=1.02).choose(Acceptance.constant(0.1), pass_ms(10.0, 0.7)) == 1
    assert DraftRule(0).choose(Acceptance.constant(1.0), pass_ms(10.0, 0.0)) == 0
    # an unmeasured or nonsense cost never wins
    assert DraftRule(2).choose(Acceptance.constant(1.0), lambda k: 10.0 if k == 0 else float("nan")) == 0


def drive(rule: OnlineDraftRule, passes: int, accepted_of, ms_of) -> list[int]:
    ks = []
    for _ in range(passes):
        k = rule.next_k()
        ks.append(k)
        rule.record(k, accepted_of(k), ms_of(k))
    return ks


def test_online_rule_explores_in_increasing_k_while_each_beats_the_last_then_settles_on_the_best():
    rule = OnlineDraftRule(k_max=3, explore=2, reprobe=1000)
    ks = drive(rule, 20, accepted_of=lambda k: k, ms_of=lambda k: 10.0 + 1.0 * k)
    assert ks[:8] == [0, 1, 0, 1, 2, 2, 3, 3]             # round-robin over 0..1, then each next k while it pays
    assert set(ks[8:]) == {3}                    # all drafts accepted, cheap passes: the most drafts
    assert rule.ms_pass(3) == pytest.approx(13.0)


def test_online_rule_explores_no_further_than_k_1_where_drafting_does_not_pay():
    rule = OnlineDraftRule(k_max=4, explore=3, reprobe=1000)
    ks = drive(rule, 30, accepted_of=lambda k: 0, ms_of=lambda k: 10.0 + 3.0 * k)
    assert ks[:6] == [0, 1, 0, 1, 0, 1] and set(ks[6:]) == {0}     # k = 2..4 never tried: k = 1 already lost


def test_online_rule_turns_itself_off_then_reprobes_and_comes_back():
    rule = OnlineDraftRule(k_max=2, explore=2, reprobe=8)
    accept_all = [False]
    ks = drive(rule, 40, accepted_of=lambda k: k if accept_all[0] else 0, ms_of=lambda k: 10.0 + 2.0 * k)
    after = ks[6:]
    assert after.count(0) >= len(after) - 5      # off, bar the re-probes
    probes = [k for k in after if k > 0]
    assert probes and all(k in (1, 2) for k in probes)
    # each probe that leaves drafting off waits twice as long for the next (a probe costs a whole pass)
    ks += drive(rule, 160, accepted_of=lambda k: 0, ms_of=lambda k: 10.0 + 2.0 * k)
    at = [i for i, k in enumerate(ks) if k > 0 and i >= 6]
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert gaps[:5] == [8, 16, 32, 64, 64], gaps            # capped at 8 x reprobe
    # the drafts start being right: the re-probes see it and drafting comes back on
    accept_all[0] = True
    ks = drive(rule, 600, accepted_of=lambda k: k if accept_all[0] else 0, ms_of=lambda k: 10.0 + 2.0 * k)
    assert ks[-10:].count(2) >= 8
    # while on, k = 0 is re-probed now and then to keep its cost current
    assert 0 in ks[-40:]


def test_online_rule_with_no_drafts_allowed_never_drafts():
    rule = OnlineDraftRule(k_max=0)
    assert drive(rule, 5, accepted_of=lambda k: 0, ms_of=lambda k: 1.0) == [0] * 5
