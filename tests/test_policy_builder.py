"""One policy builder for the runtime and the simulator; sizing before loading; resolve_model builds nothing.

Legend: L = MoE layers, E = experts, K = top-k.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from model_factory import build_family
from moectl.errors import MoectlError
from moectl.policies import (PREFETCH_NAMES, REPLACEMENT_NAMES, GateReuse, PolicyInputs, build_prefetch,
                             build_replacement, make_prefetch, make_replacement)

torch.set_num_threads(1)


def test_unknown_options_are_errors_model_facts_are_not():
    assert make_replacement("lru", num_layers=4, num_experts=8).name == "lru"      # facts it does not use: fine
    with pytest.raises(MoectlError, match="has no option lamda"):
        make_replacement("ours", num_layers=4, num_experts=8, lamda=0.5)
    assert make_replacement("ours", num_layers=4, num_experts=8, lam=0.5).lam == 0.5
    inp = PolicyInputs(4, 8, 2, routers={j: np.zeros((8, 16)) for j in range(4)})
    with pytest.raises(MoectlError, match="has no option depht"):
        build_prefetch("gate-reuse", inp, depht=3)
    with pytest.raises(MoectlError, match="has no option w_lru"):
        build_replacement("lfu", inp, w_lru=1.0)
    with pytest.raises(MoectlError, match="unknown prefetch policy"):
        build_prefetch("psychic", inp)
    with pytest.raises(MoectlError, match="knows the future"):          # the simulator's limit, not a runtime policy
        build_prefetch("oracle", inp)


def test_defaults_and_missing_inputs():
    inp = PolicyInputs(4, 8, 2, routers={j: np.zeros((8, 16)) for j in range(4)}, predictor_hint=" (--predictor)")
    pf = build_prefetch("gate-reuse", inp)
    assert isinstance(pf, GateReuse) and (pf.depth, pf.per_layer) == (1, 2)         # one layer ahead, top-k
    assert build_prefetch("none", inp) is None
    assert build_prefetch("eam", inp).depth == 2
    with pytest.raises(MoectlError, match=r"needs an mlp predictor \(--predictor\)"):
        build_prefetch("mlp", inp)
    with pytest.raises(MoectlError, match="hidden states"):
        build_prefetch("gate-reuse", PolicyInputs(4, 8, 2, routers=inp.routers, hidden_states=False))
    with pytest.raises(MoectlError, match="router weights"):
        build_prefetch("gate-reuse", PolicyInputs(4, 8, 2))

    class Mlp:
        lookaheads = [1, 3]

        def predict_scores(self, layer, hidden):
            return {}

    assert build_prefetch("mlp", PolicyInputs(4, 8, 2, mlp=Mlp())).depth == 3     # the predictor's lookaheads


def test_cli_help_lists_the_registry(cli):
    for cmd in ("simulate", "generate", "profile"):
        out = cli([cmd, "--help"], env={"COLUMNS": "400"}).output
        for name in REPLACEMENT_NAMES:
            if name != "belady" or cmd == "simulate":
                assert name in out, (cmd, name)
        for name in PREFETCH_NAMES:
            if cmd != "profile" and (name != "oracle" or cmd == "simulate"):       # oracle knows the future
                assert name in out, (cmd, name)


def test_runtime_and_simulator_build_the_same_prefetch(tmp_path):
    """The runtime's gate-reuse policy (routers from the model) equals the builder's from the same routers."""
    from moectl.runtime.engine import Engine

    build_family("mixtral", tmp_path / "m")
    eng = Engine.load(str(tmp_path / "m"), prefetch="gate-reuse", progress=False)
    pf = eng.prefetch
    routers = {l: eng.adapter.router(b).weight.detach().float().numpy()
               for l, (_, b) in enumerate(eng.adapter.moe_blocks(eng.model))}
    sim = build_prefetch("gate-reuse", PolicyInputs(4, 8, 2, routers=routers))
    assert (pf.depth, pf.per_layer, pf.min_score) == (sim.depth, sim.per_layer, sim.min_score)
    assert all(np.array_equal(pf.routers[j], sim.routers[j]) for j in routers)


# ----------------------------------------------------------------------------- sizing before loading

@pytest.mark.parametrize("family,tied", [("mixtral", False), ("mixtral", True), ("qwen2_moe", False)])
def test_a_bad_budget_fails_before_any_weight_is_read(family, tied, tmp_path, monkeypatch):
    from moectl.runtime import engine
    from moectl.store.checkpoint import Checkpoint
    from moectl.store.facts import dense_nbytes, inspect_model

    d = tmp_path / family
    build_family(family, d)
    if tied:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    eng = engine.Engine.load(str(d), progress=False)
    info = inspect_model(str(d))
    # the size the runtime plans with (from the skeleton) is what the loaded model really holds
    assert info["dense_bytes"] == dense_nbytes(eng.model)
    assert info["bytes_per_expert"] == eng.store.expert_nbytes

    def no_reads(*a, **k):
        raise AssertionError("a weight was read before the cache was sized")

    monkeypatch.setattr(Checkpoint, "get", no_reads)
    monkeypatch.setattr(Checkpoint, "read_into", no_reads)
    with pytest.raises(MoectlError, match="minimum"):
        engine.Engine.load(str(d), budget="100KB", progress=False)
    with pytest.raises(MoectlError, match="minimum of one slot per MoE layer"):
        engine.Engine.load(str(d), cache_experts=1, progress=False)
    with pytest.raises(MoectlError, match="plan has 2 layers"):
        engine.Engine.load(str(d), slots_per_layer=[1, 1], progress=False)


# ----------------------------------------------------------------------------- resolve_model builds nothing

def test_resolve_model_never_builds_and_the_runtime_does_not_import_calibration(tmp_path):
    from moectl.core.recipes import resolve_model
    from moectl.runtime.engine import Engine

    ref = resolve_model("tiny", tmp_path / "wd")
    assert ref.path == tmp_path / "wd" / "checkpoint" and not (tmp_path / "wd").exists()
    with pytest.raises(MoectlError, match="moectl build-tiny"):
        Engine.load("tiny", workdir=str(tmp_path / "wd"), progress=False)
    code = ("import sys, moectl.runtime.engine, moectl.runtime.cache; "
            "print([m for m in sys.modules if m.startswith(('moectl.synth.tiny', 'moectl.calib', 'moectl.predict.train'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_routing_trainer_honours_epochs():
    """--epochs reaches the routing trainer (it was capped at 20 passes)."""
    from moectl.predictors.routing import train_routing_predictor
    from moectl.core.trace import Trace

    rng = np.random.default_rng(0)
    N, L, E, K = 120, 3, 8, 2
    ex = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(N)]).astype(np.int16)
    tr = Trace("toy", L, E, K, ["a"] * N, np.arange(N, dtype=np.int32), np.ones(N, np.uint8), ex)
    _, m = train_routing_predictor([tr], lookahead=[1], epochs=25, max_minutes=5.0)
    assert m["lookahead"]["1"]["epochs_run"] == 25
