"""The lean load (moectl/runtime/load.py): a GGUF in place on the CPU whose every forward the one ggml graph serves
builds no transformers model (no skeleton, no dense weights read, no CPU Linears). On each family it takes: the
run's tokens and logits are the full load's with the same graph exactly, and so are its cache counters, its
host-memory check, its dense bytes and its load note; its prompt logits are the module path's (MOECTL_GGML_GRAPH=0)
within ggml's rounding; what it computes from the header
equals what the full load asks the model; the model is built on first need (an observer) and its module-path
forward is the full load's exactly; a run whose resolved gating needs the modules takes the full load; generate,
chat and inspect run on it; a fresh process's lean load and generation import none of transformers' model code
and no accelerate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_build import k256_mixtral, write_gguf
from moectl.runtime import load as load_module
from moectl.runtime.engine import Engine
from moectl.runtime.ggml_model import GraphKV
from moectl.runtime.graph_engine import mapped_count
from moectl.store.facts import dense_nbytes, lean_dense_nbytes, mapped_names
from moectl.store.gguf.cpu import dense_mapped
from moectl.store.gguf.experts import dense_in_place_names
from test_bad_input import run_cli
from test_ggml_graph import RouteRecorder, _checkpoint
from test_gguf_run import GGML_LOGITS_RTOL, PROMPT, STEPS, ggml_or_skip
from test_runtime import _engine_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=[*load_module.LEAN_FAMILIES, "mixtral-tied"])
def q_file(request, tmp_path_factory):
    """A tiny model of each one-graph family as a Q8_0 dense + Q4_0 experts GGUF (and a Mixtral whose lm_head is
    the embedding: the file has no output.weight)."""
    root = tmp_path_factory.mktemp(f"lean_{request.param}")
    ckpt = k256_mixtral(root, tied=True) if request.param == "mixtral-tied" else _checkpoint(request.param, root)
    return write_gguf(ckpt, root / "Q.gguf", dense_encoding=T.Q8_0, expert_encoding=T.Q4_0)


def _load(path, workdir, **kw):
    return Engine.load(str(path), progress=False, threads=1, workdir=str(workdir), **kw)


LEAN_NOTE = " (lean load: transformers' model built only if a module-path forward needs it)"


def _note_but_the_forward(note: str) -> str:
    return note.rsplit("; gguf: ", 1)[0]             # the last part says which forward: one graph or module path


def test_lean_load_runs_as_the_full_load(q_file, tmp_path, monkeypatch):
    """The full load with the same graph (the lean load switched off): the same tokens and logits exactly, the
    same counters, host-memory check, dense bytes, note. The module path's (MOECTL_GGML_GRAPH=0) prompt logits
    within ggml's activation rounding (later tokens may flip on a random model: test_ggml_graph.py's concern)."""
    ggml_or_skip()
    needs = []                                       # the host-memory check's figures, lean then full
    real = load_module.check_host_memory
    monkeypatch.setattr(load_module, "check_host_memory", lambda need, what, fits: (needs.append((need, what)),
                                                                                    real(need, what, fits))[1])
    lean = _load(q_file, tmp_path / "lean")
    assert lean.graph is not None and not lean.model_built, lean.plan_note
    assert "lean load" in lean.plan_note
    logits, got = _engine_run(lean, PROMPT, STEPS)
    assert not lean.model_built                      # the graph served every forward
    with monkeypatch.context() as m:
        m.setattr(load_module, "lean_why_not", lambda *a: "switched off by the test")
        full = _load(q_file, tmp_path / "full")
    assert full.graph is not None and full.model_built and "lean load" not in full.plan_note
    want_logits, want = _engine_run(full, PROMPT, STEPS)
    assert got == want and all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert lean.cache.stats.as_dict() == full.cache.stats.as_dict()
    assert needs[0] == needs[1]
    assert lean.device_memory() == full.device_memory()          # the dense bytes, from the header
    assert lean.plan_note == full.plan_note + LEAN_NOTE
    assert lean.moe_layer_ids == full.moe_layer_ids and lean.threads == full.threads
    monkeypatch.setenv("MOECTL_GGML_GRAPH", "0")
    mod = _load(q_file, tmp_path / "module")
    assert mod.graph is None and mod.model_built
    want, _ = mod.forward(PROMPT)
    assert (logits[0] - want[0]).abs().max() <= GGML_LOGITS_RTOL * want.abs().max()
    assert _note_but_the_forward(lean.plan_note) == _note_but_the_forward(mod.plan_note)


def test_header_figures_equal_the_models(q_file, tmp_path):
    """What the lean load computes from the header: the skeleton's dense bytes (the sizes the resolver splits a
    budget with), the dense matrices mapped where they lie, and the loaded model's dense bytes."""
    ggml_or_skip()
    eng = _load(q_file, tmp_path / "e")
    config, adapter, dt = eng.config, eng.adapter, eng.dtype
    hf, _ = load_module.model_skeleton(config, adapter, dt, q_file, eng.runtime)
    assert lean_dense_nbytes(config, adapter, dt) == dense_nbytes(hf, config)
    names = dense_in_place_names(adapter.gguf.files)
    mapped = dense_mapped(adapter, hf)
    assert names == mapped_names(mapped) and len(names) > 0
    assert mapped_count(names, config, adapter.gguf.files) == len(mapped)
    assert eng._dense_bytes == lean_dense_nbytes(config, adapter, dt, names)
    assert eng._dense_bytes == dense_nbytes(eng.model, config)    # built now, as the full load builds it


def test_an_observer_gets_the_model_built_on_first_need(q_file, tmp_path, monkeypatch):
    """profile and the predictors watch the layers: the lean load's model is built then, and its module-path
    forward is the full load's, exactly; the graph's sequence started before it still continues there."""
    ggml_or_skip()
    lean = _load(q_file, tmp_path / "lean")
    _, kv = lean.forward(PROMPT)
    assert isinstance(kv, GraphKV) and not lean.model_built
    obs = RouteRecorder()
    lean.add_observer(obs)
    out, pkv = lean.forward(PROMPT)
    assert lean.model_built and not isinstance(pkv, GraphKV)
    assert sorted(set(obs.seen)) == list(range(len(lean.moe_layer_ids)))
    monkeypatch.setenv("MOECTL_GGML_GRAPH", "0")
    full = _load(q_file, tmp_path / "full")
    want, _ = full.forward(PROMPT)
    assert torch.equal(out, want)


def test_a_resolved_gating_takes_the_full_load(q_file, tmp_path):
    ggml_or_skip()
    eng = _load(q_file, tmp_path / "g", gating="score:0.5")
    assert eng.graph is None and eng.model_built and "lean load" not in eng.plan_note


@pytest.mark.parametrize("q_file", ["mixtral"], indirect=True)        # one family is enough for the commands
def test_generate_chat_inspect_on_the_lean_load(q_file, tmp_path, capsys, monkeypatch):
    ggml_or_skip()
    wd = str(tmp_path / "wd")
    code, out, err = run_cli(["generate", "--model", str(q_file), "--workdir", wd, "-p", "the experts", "-n", "3",
                              "--greedy", "--json", "--device", "cpu", "--threads", "1"], capsys, monkeypatch)
    assert code == 0, err
    res = json.loads(out)
    assert len(res["token_ids"]) == 3 and res["stats"]["hits"] > 0 and "lean load" in err
    code, out, err = run_cli(["generate", "--model", str(q_file), "--workdir", wd, "-p", "hi", "-n", "2",
                              "--greedy", "--chat", "--device", "cpu", "--threads", "1"], capsys, monkeypatch)
    assert code == 0, err
    code, out, err = run_cli(["chat", "--model", str(q_file), "--workdir", wd, "--device", "cpu", "--threads", "1",
                              "-n", "2"], capsys, monkeypatch, stdin="hello\n/exit\n")
    assert code == 0, err
    code, out, err = run_cli(["inspect", "--model", str(q_file), "--json", "--device", "cpu"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["experts"] == 8


CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
from moectl.runtime.engine import Engine
eng = Engine.load(sys.argv[1], device="cpu", threads=1, progress=False, workdir=sys.argv[2])
out = eng.generate("the experts", max_new_tokens=2, stop_at_eos=False)
code = sorted(m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m
              and not m.startswith("transformers.models.auto."))   # the config classes' docstrings import auto's
print("RESULT " + json.dumps({"built": eng.model_built, "tokens": len(out.token_ids), "model_code": code,
                              "accelerate": "accelerate" in sys.modules, "note": eng.plan_note}))
"""


def test_lean_load_imports_no_model_code(tmp_path):
    """A fresh process (the test process holds whatever earlier tests imported): a lean load and generation
    import none of transformers' model code (modeling_mixtral) and no accelerate (the skeleton's)."""
    ggml_or_skip()
    q = write_gguf(k256_mixtral(tmp_path), tmp_path / "m.gguf", dense_encoding=T.Q8_0, expert_encoding=T.Q4_K)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHILD, str(q), str(tmp_path / "wd")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert res["tokens"] == 2 and not res["built"], res["note"]
    assert res["model_code"] == [] and not res["accelerate"]
