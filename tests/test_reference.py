"""The reference model's recipe (build-tiny --size reference), on its scaled-down configuration `reference-small`:
the corpus holds text out, training resumes from its saved state to the very weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file


@pytest.fixture
def home(tiny_small, monkeypatch):
    """The session's private MOECTL_HOME (its corpus caches are reused)."""
    path = tiny_small.parent.parent / "home"
    monkeypatch.setenv("MOECTL_HOME", str(path))
    return path


def _fake_stdlib(root):
    files = {
        "json/__init__.py": "'''json package: documented by the built-in corpus'''\n",   # DOCUMENTED: nowhere
        "os.py": "'''os module'''\n",                                                     # DOCUMENTED: nowhere
        "test/test_foo.py": "def test(): pass\n",                                         # tests: skipped
        "site-packages/pkg.py": "x = 1\n",                                                # installed: skipped
        "empty.py": "\n",                                                                 # empty: skipped
    }
    for i in range(40):
        files[f"mod{i}.py"] = f"def f{i}():\n    return {i}\n"
        files[f"pkg{i}/sub.py"] = f"class C{i}:\n    pass\n"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return files


def test_stdlib_corpus_never_trains_on_held_out_or_documented_modules(tmp_path):
    from moectl.calib.stdlib_corpus import build_stdlib_corpus, module_of, source_split
    from pathlib import Path

    _fake_stdlib(tmp_path / "lib")
    docs = {"train": [f"train doc {i}\n" for i in range(5)], "heldout": [f"held doc {i}\n" for i in range(3)]}
    meta = build_stdlib_corpus(tmp_path / "out", root=tmp_path / "lib", docs=docs)
    rows = {s: [json.loads(x) for x in (tmp_path / "out" / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "heldout")}
    names = {s: {r["name"] for r in rows[s] if r["kind"] == "source"} for s in rows}
    # every module file is in exactly one split, the one its top-level module hashes to
    expected = {s: {f"mod{i}.py" for i in range(40) if source_split(f"mod{i}") == s}
                | {f"pkg{i}/sub.py" for i in range(40) if source_split(f"pkg{i}") == s} for s in rows}
    assert names == expected
    assert names["heldout"] and not names["train"] & names["heldout"]
    assert {module_of(Path(n)) for n in names["heldout"]}.isdisjoint(module_of(Path(n)) for n in names["train"])
    # documented modules (their docstrings are the built-in validation text), tests and packages appear nowhere
    every = names["train"] | names["heldout"]
    assert not every & {"json/__init__.py", "os.py", "test/test_foo.py", "site-packages/pkg.py", "empty.py"}
    assert meta["excluded_files"] == 2
    # documentation keeps its own split; the held-out file interleaves doc, source, doc, source, ...
    assert [r["text"] for r in rows["train"] if r["kind"] == "doc"] == docs["train"]
    assert [r["text"] for r in rows["heldout"] if r["kind"] == "doc"] == docs["heldout"]
    assert [r["kind"] for r in rows["heldout"][:4]] == ["doc", "source", "doc", "source"]


def test_real_stdlib_corpus_held_out_text_is_not_in_training(home):
    from moectl.calib.builtin_corpus import builtin_corpus
    from moectl.calib.dataset import load_calibration
    from moectl.calib.stdlib_corpus import DOCUMENTED, stdlib_corpus, stdlib_corpus_dir

    train, held = stdlib_corpus("train"), stdlib_corpus("heldout")
    assert sum(map(len, train)) > 5_000_000 and sum(map(len, held)) > 200_000   # several times the built-in corpus
    assert not set(train) & set(held)
    assert set(builtin_corpus("validation")) <= set(held)              # the tiny model's held-out text stays out
    rows = [json.loads(x) for x in (stdlib_corpus_dir() / "train.jsonl").read_text().splitlines()]
    assert not {r["name"].split("/")[0].removesuffix(".py") for r in rows if r["kind"] == "source"} & DOCUMENTED
    texts = load_calibration("reference")                             # calibration/reference.yaml reads it
    assert len(texts) == 64 and texts[0] == held[0][:len(texts[0])]
    with pytest.raises(Exception, match="splits 'train' and 'heldout'"):
        stdlib_corpus("validation")


def test_reference_small_resumes_to_the_weights_of_an_uninterrupted_run(home, tmp_path):
    from moectl.synth.tiny_recipe import REFERENCE_SMALL
    from moectl.synth.tiny import STATE_DIR, build_tiny

    assert REFERENCE_SMALL.checkpoint_every == 8 and REFERENCE_SMALL.steps == 32
    whole = build_tiny(tmp_path / "whole", size="reference-small", progress=False)
    assert not (tmp_path / "whole" / STATE_DIR).exists()               # spent once the checkpoint is complete
    # interrupted after 12 steps: the state saved at step 8 stays, no checkpoint, no report
    assert build_tiny(tmp_path / "cut", size="reference-small", progress=False, stop_after=12) is None
    state = torch.load(tmp_path / "cut" / STATE_DIR / "state.pt", weights_only=False)
    assert state["step"] == 8 and len(state["losses"]) == 8
    assert not (tmp_path / "cut" / "tiny.json").exists()
    resumed = build_tiny(tmp_path / "cut", size="reference-small", progress=False)
    a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((tmp_path / d / "tiny.json").read_text()) for d in ("whole", "cut"))
    assert rb["resumed_at_step"] == 8 and ra["resumed_at_step"] is None
    assert rb["steps"] == ra["steps"] == 32 and rb["val_ppl"] == ra["val_ppl"]
    assert rb["final_train_loss"] == ra["final_train_loss"]
    # it learned something from the stdlib text, scored on held-out text
    assert ra["variant"] == "reference-small" and ra["val_ppl"] < ra["unigram_ppl"]


def test_a_state_of_another_run_is_not_resumed(home, tmp_path):
    from moectl.synth.tiny import STATE_DIR, build_tiny

    assert build_tiny(tmp_path / "w", size="reference-small", progress=False, stop_after=9) is None
    assert (tmp_path / "w" / STATE_DIR / "state.pt").exists()
    build_tiny(tmp_path / "w", size="reference-small", steps=10, progress=False)     # other planned steps
    report = json.loads((tmp_path / "w" / "tiny.json").read_text())
    assert report["resumed_at_step"] is None and report["steps"] == 10


def _cli(*args, env):
    return subprocess.run([sys.executable, "-m", "moectl.cli", *args], capture_output=True, text=True, env=env)


def test_build_tiny_size_errors(home, tmp_path):
    env = os.environ | {"MOECTL_HOME": str(home)}
    bad = _cli("build-tiny", "--size", "huge", "--workdir", str(tmp_path / "x"), env=env)
    assert bad.returncode == 2 and "error:" in bad.stderr and "reference" in bad.stderr
    both = _cli("build-tiny", "--small", "--size", "reference", "--workdir", str(tmp_path / "y"), env=env)
    assert both.returncode == 2 and "--small" in both.stderr
    assert "Traceback" not in bad.stderr + both.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_reference_recipe_resolves_to_its_workdir_and_is_not_built_on_first_use(home):
    from moectl.core.recipes import resolve_model

    ref = resolve_model("reference")
    assert ref.workdir == home / "reference" and ref.path == home / "reference" / "checkpoint"
    env = os.environ | {"MOECTL_HOME": str(home)}
    out = _cli("eval", "--model", "reference", "--max-tokens", "64", env=env)
    assert out.returncode == 2 and "build-tiny --size reference" in out.stderr
    assert not (home / "reference").exists()


def test_paired_noise_of_a_perplexity_delta():
    from moectl.calib.fidelity import paired_2se

    # per-window differences 2 and 4 over 4 scored tokens: stdev sqrt(2) x sqrt(2 windows) / 4 tokens, doubled
    assert paired_2se([3.0, 5.0], [1.0, 1.0], 4) == pytest.approx(1.0)
    assert paired_2se([3.0, 5.0], [2.0, 4.0], 4) == 0.0                # a constant shift has no spread
    assert paired_2se([3.0], [1.0], 4) is None and paired_2se([3.0, 5.0], None, 4) is None


def test_bench_models_pick_each_models_held_out_text(home):
    from bench.models import fit_texts, held_out_dataset
    from moectl.calib.builtin_corpus import builtin_corpus
    from moectl.calib.dataset import load_calibration
    from moectl.calib.stdlib_corpus import stdlib_corpus
    from moectl.core.recipes import resolve_model

    tiny, reference = resolve_model("tiny"), resolve_model("reference")
    assert held_out_dataset(tiny) == "default"
    assert held_out_dataset(reference).endswith("calibration/reference.yaml")
    held = load_calibration(held_out_dataset(reference))
    assert held and set(held).isdisjoint(fit_texts(reference))
    train = stdlib_corpus("train")
    assert all(any(t.startswith(f) for t in train) for f in fit_texts(reference))    # cut to ~512 tokens
    assert fit_texts(tiny) == builtin_corpus("train")[:64]


def test_a_rebuild_drops_what_the_old_weights_made(home, tmp_path):
    from moectl.synth.tiny import build_tiny

    wd = tmp_path / "w"
    build_tiny(wd, size="reference-small", steps=2, progress=False)
    stale = [wd / "experts-q4g64.json", wd / "experts-q4g64.safetensors", wd / "sensitivity.json"]
    for path in stale:
        path.write_text("{}")
    (wd / "experts-q4g64.parts").mkdir()
    (wd / "keep.txt").write_text("not derived from the weights")
    build_tiny(wd, size="reference-small", steps=3, force=True, progress=False)
    assert not any(p.exists() for p in stale) and not (wd / "experts-q4g64.parts").exists()
    assert (wd / "keep.txt").exists() and (wd / "checkpoint" / "config.json").exists()
