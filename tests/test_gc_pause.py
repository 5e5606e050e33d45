"""The collector paused during a load (moectl/core/gc_pause.py, runtime/load.py): off inside, one full collection
after, back as the caller had it; a load's steps run with it off."""

from __future__ import annotations

import gc

import pytest

from moectl.core.gc_pause import collector_paused


def _cycles(n: int) -> None:
    for _ in range(n):                          # garbage only the cyclic collector frees
        a = []
        a.append(a)


def test_paused_block_collects_once_at_its_end():
    assert gc.isenabled()
    full = gc.get_stats()[2]["collections"]
    young = gc.get_stats()[0]["collections"]
    with collector_paused():
        assert not gc.isenabled()
        _cycles(200_000)                        # far past the thresholds: collections, were it on
        assert gc.get_stats()[0]["collections"] == young
        with collector_paused():                # nested: the outer block collects
            _cycles(10)
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_stats()[2]["collections"] == full + 1
    assert gc.collect() == 0                    # the 200k cycles are gone already


def test_paused_block_keeps_a_callers_off_and_restores_after_an_error():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError):
        with collector_paused():
            raise RuntimeError("a failed load")
    assert gc.isenabled()


def test_load_runs_with_the_collector_off(tiny_small, tmp_path, monkeypatch):
    import moectl.runtime.load as L
    from moectl.runtime.engine import Engine

    seen = []
    skeleton = L.skeleton
    monkeypatch.setattr(L, "skeleton", lambda *a, **k: (seen.append(gc.isenabled()), skeleton(*a, **k))[1])
    eng = Engine.load(str(tiny_small), progress=False, threads=1, workdir=str(tmp_path))
    assert seen == [False] and gc.isenabled()
    assert len(eng.generate("the", max_new_tokens=2, stop_at_eos=False).token_ids) >= 2
