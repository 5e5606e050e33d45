"""Two path models with the same name keep their own workdirs (moectl/core/model_workdir.py): the first to use
`$MOECTL_HOME/<name>/` claims it (records its resolved path), another model of that name takes `<name>-<8 hex>/`,
stable across calls; a workdir made before records were kept is adopted; `--workdir` is used as given; a symlink
and its target are one model. resolve_model needs only the paths to exist: the files here are empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moectl.core.model_workdir import FILE, recorded_source, source_suffix
from moectl.core.recipes import resolve_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("MOECTL_HOME", str(h))
    return h


def _file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_two_ggufs_with_one_stem_get_two_workdirs_and_keep_them(home, tmp_path):
    a = _file(tmp_path / "a" / "mixtral-2" / "model-Q4_K_M.gguf")
    b = _file(tmp_path / "b" / "qwen3-moe-2" / "model-Q4_K_M.gguf")
    wa, wb = resolve_model(str(a)).workdir, resolve_model(str(b)).workdir
    assert wa == home / "model-Q4_K_M"
    assert wb == home / f"model-Q4_K_M-{source_suffix(str(b.resolve()))}"
    assert recorded_source(wa) == str(a.resolve()) and recorded_source(wb) == str(b.resolve())
    for _ in range(2):                                  # alternating: each keeps its own, in either order
        assert resolve_model(str(b)).workdir == wb and resolve_model(str(a)).workdir == wa
    assert resolve_model(str(a)).name == resolve_model(str(b)).name == "model-Q4_K_M"     # the name is unchanged
    assert sorted(p.name for p in home.iterdir()) == sorted([wa.name, wb.name])


def test_the_same_file_always_gets_the_same_workdir_a_symlink_too(home, tmp_path):
    f = _file(tmp_path / "m" / "moe.gguf")
    link = tmp_path / "elsewhere" / "moe.gguf"
    link.parent.mkdir()
    link.symlink_to(f)
    other = _file(tmp_path / "n" / "moe.gguf")
    assert resolve_model(str(other)).workdir == home / "moe"            # `moe/` is the other file's
    wd = resolve_model(str(f)).workdir
    assert wd.name.startswith("moe-")
    assert resolve_model(str(link)).workdir == wd                          # the resolved path: one source
    assert resolve_model(str(tmp_path / "m" / ".." / "m" / "moe.gguf")).workdir == wd


def test_a_workdir_without_a_record_is_adopted_by_the_first_model(home, tmp_path):
    legacy = home / "model"
    (legacy / "traces").mkdir(parents=True)                   # made by a moectl that kept no record
    a = _file(tmp_path / "a" / "model.gguf")
    b = _file(tmp_path / "b" / "model.gguf")
    assert resolve_model(str(a)).workdir == legacy
    assert json.loads((legacy / FILE).read_text())["source"] == str(a.resolve())
    assert (legacy / "traces").is_dir()                       # nothing else touched
    assert resolve_model(str(b)).workdir != legacy
    assert resolve_model(str(a)).workdir == legacy
    (legacy / FILE).write_text("{not json")                   # an unreadable record: adopted as none
    assert resolve_model(str(b)).workdir == legacy and recorded_source(legacy) == str(b.resolve())


def test_a_workdir_whose_model_is_gone_is_adopted(home, tmp_path):
    """A deleted or moved model's workdir goes to the next model of its name (no `-<hex>` workdirs piling up, as the
    test suite's temporary files would make them)."""
    a = _file(tmp_path / "a" / "moe.gguf")
    b = _file(tmp_path / "b" / "moe.gguf")
    assert resolve_model(str(a)).workdir == home / "moe"
    a.unlink()
    assert resolve_model(str(b)).workdir == home / "moe" and recorded_source(home / "moe") == str(b.resolve())
    assert sorted(p.name for p in home.iterdir()) == ["moe"]


def test_an_explicit_workdir_is_used_as_given_and_not_recorded(home, tmp_path):
    a = _file(tmp_path / "a" / "model.gguf")
    b = _file(tmp_path / "b" / "model.gguf")
    assert resolve_model(str(a)).workdir == home / "model"
    ref = resolve_model(str(b), home / "model")                # another model's workdir, asked for: given
    assert ref.workdir == home / "model" and recorded_source(home / "model") == str(a.resolve())
    mine = tmp_path / "mine"
    assert resolve_model(str(b), str(mine)).workdir == mine and not mine.exists()
    assert resolve_model(str(a)).workdir == home / "model"


def test_two_checkpoint_directories_named_alike(home, tmp_path):
    a, b = tmp_path / "x" / "checkpoint", tmp_path / "y" / "checkpoint"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    wa, wb = resolve_model(str(a)).workdir, resolve_model(str(b)).workdir
    assert wa == home / "checkpoint" and wb == home / f"checkpoint-{source_suffix(str(b.resolve()))}"
    assert resolve_model(str(a) + "/").workdir == wa and resolve_model(str(b)).workdir == wb


def test_a_file_in_the_way_and_a_home_that_cannot_be_written(home, tmp_path, monkeypatch):
    home.mkdir()
    (home / "model").write_text("not a directory")
    a = _file(tmp_path / "a" / "model.gguf")
    assert resolve_model(str(a)).workdir == home / f"model-{source_suffix(str(a.resolve()))}"
    monkeypatch.setenv("MOECTL_HOME", str(a / "home"))                    # under a file: nothing can be made
    assert resolve_model(str(a)).workdir == a / "home" / "model"          # no error here: the writer says it


def test_recipes_keep_their_names(home):
    assert resolve_model("tiny").workdir == home / "tiny" and not (home / "tiny").exists()


def test_a_path_model_named_like_a_recipe_or_a_tools_folder_takes_its_own(home, tmp_path):
    """`tiny.gguf` is not the tiny recipe, `llamacpp.gguf` not ggml's build folder: each takes `<name>-<8 hex>/`,
    even where `<name>/` is missing or holds no record (recipes and tools keep none), and without case."""
    (home / "tiny" / "traces").mkdir(parents=True)                     # the recipe's workdir, no record
    for stem in ("tiny", "llamacpp", "kernels", "corpus", "Mixtral", "tiny-small"):
        f = _file(tmp_path / stem / f"{stem}.gguf")
        wd = resolve_model(str(f)).workdir
        assert wd == home / f"{stem}-{source_suffix(str(f.resolve()))}", stem
        assert resolve_model(str(f)).workdir == wd                       # stable
    d = _dir(tmp_path / "x" / "olmoe")                                     # a checkpoint directory too
    assert resolve_model(str(d)).workdir.name == f"olmoe-{source_suffix(str(d.resolve()))}"
    assert not (home / "tiny" / FILE).exists() and not (home / "llamacpp").exists()     # nothing written there
    assert resolve_model("tiny").workdir == home / "tiny"


def test_a_recipes_workdir_a_path_model_used_before_is_left_as_it_is(home, tmp_path):
    """Before the rule a `tiny.gguf` claimed `tiny/` (the recipe's): now it takes its own, and nothing in `tiny/`
    is moved or deleted (the recipe's artifacts may lie beside it)."""
    f = _file(tmp_path / "m" / "tiny.gguf")
    legacy = home / "tiny"
    legacy.mkdir(parents=True)
    (legacy / FILE).write_text(json.dumps({"format": "moectl-model-source-v1", "source": str(f.resolve())}))
    (legacy / "gguf-config.json").write_text("{}")
    assert resolve_model(str(f)).workdir == home / f"tiny-{source_suffix(str(f.resolve()))}"
    assert sorted(p.name for p in legacy.iterdir()) == sorted([FILE, "gguf-config.json"])


def test_every_folder_the_tools_keep_in_moectl_home_is_reserved():
    """The names moectl's and the benches' sources join to MOECTL_HOME (or its default ~/.cache/moectl) are recipes'
    or in TOOL_ENTRIES; every recipe's workdir name is its file's stem (what the claim compares); build-tiny's sizes'
    workdirs too (moectl/commands/build_tiny.py: small builds into tiny-small)."""
    import re

    import yaml

    from moectl.core.model_workdir import TOOL_ENTRIES, reserved
    from moectl.core.recipes import list_recipes, recipes_dir
    from moectl.synth.tiny_recipe import SIZES

    joined = re.compile(r'(?:moectl_home\(\)|"moectl"\)*(?:\.expanduser\(\))?|\.cache/moectl"\)*'
                        r'(?:\.expanduser\(\))?)\s*/\s*"([^"]+)"|\.cache/moectl/([A-Za-z0-9_.-]+)')
    found = {m.group(1) or m.group(2) for d in ("moectl", "bench") for f in (ROOT / d).rglob("*.py")
             for m in joined.finditer(f.read_text())}
    recipes = list_recipes()
    assert {"llamacpp", "kernels", "corpus", "machine.json", "tiny"} <= found           # the scan finds them
    assert not [n for n in found if not reserved(n, recipes)]
    assert set(TOOL_ENTRIES) - set(recipes) == set(TOOL_ENTRIES)
    for name in recipes:
        assert (yaml.safe_load((recipes_dir() / f"{name}.yaml").read_text()) or {}).get("name", name) == name
    for size in SIZES:
        assert reserved({"small": "tiny-small"}.get(size, size), recipes), size


def test_each_process_lands_in_the_same_workdir(home, tmp_path):
    """Across processes (each command is one): the claim is on disk, and resolving imports no torch."""
    a = _file(tmp_path / "a" / "model.gguf")
    b = _file(tmp_path / "b" / "model.gguf")
    code = ("import sys; from moectl.core.recipes import resolve_model; print(resolve_model(sys.argv[1]).workdir); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def workdir(p):
        out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, check=True,
                             env=env).stdout.split("\n")
        assert out[1] == "[]"
        return Path(out[0])

    wb = workdir(b)
    assert wb == home / "model"
    assert workdir(a) == resolve_model(str(a)).workdir != wb
    assert workdir(b) == wb


def test_alternating_two_ggufs_of_one_stem_keeps_both_torch_free(home, tmp_path, capsys, monkeypatch):
    """The case that made this: two models, one file name, run in turn. Each keeps its saved config and tokenizer,
    so every run after its first is torch-free (before, each run replaced the other's and took the slow load)."""
    from gguf import GGMLQuantizationType as T

    from gguf_build import k256_mixtral, write_gguf
    from test_bad_input import run_cli
    from test_graph_engine import TORCH_FREE_NOTE
    from test_gguf_run import ggml_or_skip

    ggml_or_skip()
    ckpt = k256_mixtral(tmp_path / "src")
    a = write_gguf(ckpt, _dir(tmp_path / "a") / "model-Q4_K_M.gguf", dense_encoding=T.Q8_0, expert_encoding=T.Q4_0)
    b = write_gguf(ckpt, _dir(tmp_path / "b") / "model-Q4_K_M.gguf", dense_encoding=T.F32, expert_encoding=T.Q8_0)

    def generate(path) -> str:
        code, out, err = run_cli(["generate", "--model", str(path), "--prompt", "Hi", "-n", "2", "--threads", "1",
                                  "--device", "cpu", "--greedy"], capsys, monkeypatch)
        assert code == 0, err
        return err

    assert TORCH_FREE_NOTE not in generate(a) and TORCH_FREE_NOTE not in generate(b)      # each one's first run
    assert TORCH_FREE_NOTE in generate(a) and TORCH_FREE_NOTE in generate(b)
    wa, wb = resolve_model(str(a)).workdir, resolve_model(str(b)).workdir
    assert wa != wb and all((w / "gguf-config.json").exists() for w in (wa, wb))
