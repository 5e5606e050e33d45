"""The precision (HOBBIT hi/lo/skip) and placement (fetch vs CPU) rules on hand-made inputs."""

import pytest

from moectl.errors import MoectlError
from moectl.policies.miss import decide_miss
from moectl.policies.placement import CPU, FETCH, ComputePlacement, LayerQueue
from moectl.policies.precision import FULL, LOW, SKIP, HobbitPrecision, LowbitOnly, make_precision, rank_scores
from moectl.sim.cost import FixedCost


def test_rank_scores_are_mass_ranked_above():
    assert rank_scores([0.2, 0.5, 0.3]) == pytest.approx([0.8, 0.0, 0.5])
    assert rank_scores([3.0, 1.0]) == pytest.approx([0.0, 0.75])      # unnormalised weights are normalised


def test_hobbit_thresholds():
    p = HobbitPrecision(0.6, 0.9)
    # scores 0 (top-1), 0.5, 0.8, 0.95
    assert p.decide_token([0.5, 0.3, 0.15, 0.05]) == [FULL, FULL, LOW, SKIP]
    assert p.decide(0.6) == FULL and p.decide(0.61) == LOW and p.decide(0.9) == LOW and p.decide(0.91) == SKIP
    never = HobbitPrecision(1.0, 1.0)                                    # T1 = 1: never low, never skip
    assert never.decide_token([0.97, 0.01, 0.01, 0.01]) == [FULL] * 4 and not never.uses_lowbit
    assert LowbitOnly().decide_token([0.9, 0.1]) == [LOW, LOW]
    with pytest.raises(MoectlError, match="T1 <= T2"):
        HobbitPrecision(0.9, 0.5)
    with pytest.raises(MoectlError, match="unknown --precision"):
        make_precision("fp4")


def test_placement_follows_the_cost_model():
    slow_copy = FixedCost(load=1.0, expert=0.03, cpu_expert=0.3)
    fast_copy = FixedCost(load=0.01, expert=0.03, cpu_expert=0.3)
    assert ComputePlacement("auto", slow_copy).decide() == CPU
    assert ComputePlacement("auto", fast_copy).decide() == FETCH
    assert ComputePlacement("auto", slow_copy).decide(nbytes=0.25) == CPU          # q4 copy: 0.25 s vs 0.075 s
    assert ComputePlacement("never").decide() == FETCH and ComputePlacement("always").decide() == CPU
    with pytest.raises(MoectlError, match="needs a cost model"):
        ComputePlacement("auto")


def test_a_layers_misses_go_to_whichever_side_finishes_them_first():
    """List scheduling over the layer's queue: priced alone, each of two misses is cheaper on the CPU (0.3 s against
    a 0.4 s copy + 0.03 s compute), but two on the CPU end at 0.6 s, one on each side at 0.43 s. A third goes back to
    the CPU (0.6 < 0.83). A new queue (the next layer) starts empty."""
    cost = FixedCost(load=0.4, expert=0.03, cpu_expert=0.3)
    place = ComputePlacement("auto", cost)
    assert [place.decide() for _ in range(3)] == [CPU, CPU, CPU]                 # no queue: each priced alone
    q = LayerQueue()
    assert [decide_miss(None, FULL, place, queue=q)[0] for _ in range(3)] == [CPU, FETCH, CPU]
    assert q.cpu_s == pytest.approx(0.6) and q.copy_s == pytest.approx(0.4)
    assert decide_miss(FULL, FULL, place, queue=q)[0] == "device" and q.cpu_s == pytest.approx(0.6)   # a hit
    assert decide_miss(None, FULL, place, queue=LayerQueue())[0] == CPU
