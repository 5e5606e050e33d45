"""`moectl clean` (moectl/core/home_entries.py): lists MOECTL_HOME with sizes -- each workdir's recorded model and
whether it still exists, recipes' workdirs, tool folders -- and changes nothing; `--remove` deletes only the
workdirs whose recorded model path is gone, never a recipe's, a tool's, one without a record or one whose model
exists, and never what a link inside points at. Through the CLI, on a temporary MOECTL_HOME."""

from __future__ import annotations

import json

import pytest

from moectl.core.model_workdir import path_workdir, record_source
from test_bad_input import run_cli


def _tree(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home as a user's looks after a while: tool folders, a recipe's workdir (holding an old path model's record
    whose file is gone), a workdir of a model still here, two of models since deleted (one made by the real
    `path_workdir`), one without a record, a stray file."""
    h = tmp_path / "home"
    models = tmp_path / "models"
    models.mkdir()
    (h / "llamacpp" / "ggml").mkdir(parents=True)
    (h / "llamacpp" / "ggml" / "libggml.so").write_bytes(b"x" * 5000)
    (h / "machine.json").write_text("{}")
    (h / "mixtral").mkdir()
    (h / "mixtral" / "plan.yaml").write_text("plan")
    record_source(h / "mixtral", str(tmp_path / "gone" / "mixtral.gguf"))
    here = models / "here.gguf"
    here.write_bytes(b"GGUF")
    wd_here = path_workdir(h, "here", here)
    (wd_here / "config.json").write_text("{}")
    gone = models / "ck.gguf"
    gone.write_bytes(b"GGUF")
    wd_gone = path_workdir(h, "ck", gone)
    (wd_gone / "gguf-tokenizer").mkdir()
    (wd_gone / "gguf-tokenizer" / "tokenizer.json").write_bytes(b"t" * 3000)
    outside = tmp_path / "kept-outside.bin"
    outside.write_bytes(b"o" * 100)
    (wd_gone / "link").symlink_to(outside)                 # a link inside: it goes, its target stays
    gone.unlink()
    record_source(h / "Q-1f080422", str(tmp_path / "deleted" / "Q.gguf"))
    (h / "Q-1f080422" / "experts-q4g64.safetensors").write_bytes(b"q" * 2000)
    (h / "old").mkdir()
    (h / "old" / "traces").write_text("made before records were kept")
    (h / "notes.txt").write_text("not moectl's")
    monkeypatch.setenv("MOECTL_HOME", str(h))
    return h


def test_the_list_says_each_entrys_kind_and_size_and_changes_nothing(home, capsys, monkeypatch):
    before = _tree(home)
    code, out, err = run_cli(["clean", "--json"], capsys, monkeypatch)
    assert code == 0, err
    res = json.loads(out)
    kinds = {e["name"]: e["kind"] for e in res["entries"]}
    assert kinds == {"llamacpp": "tool", "machine.json": "tool", "mixtral": "recipe", "here": "model here",
                     "ck": "model gone", "Q-1f080422": "model gone", "old": "no record"}
    by = {e["name"]: e for e in res["entries"]}
    assert [n for n, e in by.items() if e["removable"]] == ["Q-1f080422", "ck"]
    assert by["llamacpp"]["bytes"] == 5000 and by["Q-1f080422"]["bytes"] > 2000 and by["ck"]["bytes"] > 3000
    assert by["here"]["source"].endswith("here.gguf") and by["mixtral"]["source"] is None
    assert res["gone_bytes"] == by["ck"]["bytes"] + by["Q-1f080422"]["bytes"] and "removed" not in res
    assert _tree(home) == before

    code, out, err = run_cli(["clean"], capsys, monkeypatch)
    assert code == 0 and err == "", err
    assert max(map(len, out.splitlines())) <= 80
    assert "model gone" in out and "recipe" in out and "notes.txt" not in out
    assert "2 workdirs whose model is gone" in out and "--remove" in out
    assert _tree(home) == before


def test_remove_deletes_only_the_workdirs_whose_model_is_gone(home, tmp_path, capsys, monkeypatch):
    before = _tree(home)
    code, out, err = run_cli(["clean", "--remove", "--json"], capsys, monkeypatch)
    assert code == 0, err
    res = json.loads(out)
    assert sorted(res["removed"]) == ["Q-1f080422", "ck"] and res["left"] == []
    assert res["freed_bytes"] == res["gone_bytes"] > 5000
    assert not (home / "ck").exists() and not (home / "Q-1f080422").exists()
    assert _tree(home) == {p for p in before if not p.startswith(("ck", "Q-1f080422"))}
    assert (tmp_path / "kept-outside.bin").read_bytes() == b"o" * 100
    assert (home / "mixtral" / "plan.yaml").exists() and (home / "old" / "traces").exists()

    code, out, err = run_cli(["clean", "--remove"], capsys, monkeypatch)      # again: nothing left to remove
    assert code == 0 and "removed 0 workdirs" in out and max(map(len, out.splitlines())) <= 80, err


def test_a_model_back_in_place_keeps_its_workdir(home, tmp_path, capsys, monkeypatch):
    (tmp_path / "deleted").mkdir()
    (tmp_path / "deleted" / "Q.gguf").write_bytes(b"GGUF")                    # the model is back
    code, out, err = run_cli(["clean", "--remove", "--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["removed"] == ["ck"], err
    assert (home / "Q-1f080422" / "experts-q4g64.safetensors").exists()


def test_an_empty_or_missing_home_is_said_plainly(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "none"))
    code, out, err = run_cli(["clean"], capsys, monkeypatch)
    assert code == 0 and out.strip() == f"nothing in {tmp_path / 'none'}" and err == ""
    code, out, err = run_cli(["clean", "--remove", "--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(out) == {"home": str(tmp_path / "none"), "entries": [], "bytes": 0,
                                             "gone_bytes": 0, "removed": [], "freed_bytes": 0, "left": []}
    assert not (tmp_path / "none").exists()
