"""moectl's ggml build removes its own earlier builds (moectl/kernels/ggml.py `remove_stale`): after a build of the
current patch key, the entries of other keys (`BUILT-p<key>`, `build-p<key>/`, `lib-p<key>/`, `src-p<key>/`), the
legacy unpatched layout (`BUILT`, `build/`, `lib/`) and the shims of earlier shim sources go, in that ISA's folder
only; llama.cpp's tool builds beside it (`bin*/`, `build*/`, `BUILT*` in the root), the other ISA's folder, the
current build and names the build never makes stay. One line says what went and the bytes freed. Nothing is
compiled: a fake cache under tmp_path and a fake cmake / cc (`_run`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moectl.kernels import ggml, ggml_patch

OLD = "0123456789"                                   # an earlier patch key


def _put(path: Path, size: int = 1000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A llama.cpp root as a user's looks after earlier moectl versions: llama.cpp's tools (native and avx2), the
    unpacked source, and in ggml/ the legacy layout, an older key's build and an older shim; ggml-avx2/ an older key's
    build too. cmake and cc are faked: a build writes the files the real one would."""
    root = tmp_path / "llamacpp"
    src = root / "src" / "llama_cpp_python-x" / "vendor" / "llama.cpp"
    _put(src / "ggml" / "CMakeLists.txt")
    _put(src / "ggml" / "include" / "ggml.h")
    for tools in ("bin", "bin-avx2", "build", "build-avx2"):                   # llama.cpp's, never moectl's
        _put(root / tools / "llama-bench")
    for stamp in ("BUILT", "BUILT-avx2", "build.log"):
        _put(root / stamp, 10)
    home = root / "ggml"
    _put(home / "BUILT", 10)                                                   # the unpatched layout
    _put(home / "build" / "bin" / "libggml-cpu.so", 5000)
    _put(home / "lib" / "libmoectl_ggml-aaaaaaaaaaaa.so", 2000)
    _put(home / f"BUILT-p{OLD}", 10)                                           # an earlier patch key
    _put(home / f"build-p{OLD}" / "bin" / "libggml-cpu.so", 7000)
    _put(home / f"lib-p{OLD}" / "libggml-cpu.so", 3000)
    (home / f"src-p{OLD}").mkdir()
    (home / f"src-p{OLD}" / "CMakeLists.txt").symlink_to(src / "ggml" / "CMakeLists.txt")   # as overlay() links
    _put(home / "build.log", 10)
    _put(home / "notes.txt", 10)                                               # not a name the build makes
    _put(root / "ggml-avx2" / f"lib-p{OLD}" / "libggml-cpu.so", 3000)          # the other ISA's: its own build's

    monkeypatch.setenv("MOECTL_GGML_PRUNE", "1")               # the suite's default keeps builds (conftest.py)
    monkeypatch.setattr(ggml, "_tools", lambda: ("cmake", "cc"))
    monkeypatch.setattr(ggml, "fetch_source", lambda root, log, echo: src)

    def fake_run(cmd, log, env=None):
        cmd = list(map(str, cmd))
        if cmd[0] == "cmake" and "--build" in cmd:
            _put(Path(cmd[cmd.index("--build") + 1]) / "bin" / "libggml-cpu.so", 4000)
        elif cmd[0] == "cc":
            _put(Path(cmd[cmd.index("-o") + 1]), 500)

    monkeypatch.setattr(ggml, "_run", fake_run)
    monkeypatch.setattr(ggml_patch, "apply", lambda d: None)
    return root


def test_a_build_removes_its_earlier_builds_and_nothing_else(cache):
    said = []
    before = _tree(cache)
    shim = ggml.build(cache, isa="native", echo=said.append)
    home, key = cache / "ggml", f"p{ggml_patch.KEY}"
    assert shim.exists() and shim.parent == home / f"lib-{key}"
    gone = {"BUILT", "build", "lib", f"BUILT-p{OLD}", f"build-p{OLD}", f"lib-p{OLD}", f"src-p{OLD}"}
    assert not [n for n in gone if (home / n).exists() or (home / n).is_symlink()]
    for kept in (f"BUILT-{key}", f"build-{key}", f"lib-{key}", f"src-{key}", "include", "lock", "build.log",
                 "notes.txt"):
        assert (home / kept).exists(), kept
    kept_before = {p for p in before if not p.startswith("ggml/") or p == "ggml/notes.txt"}
    assert kept_before <= _tree(cache)                         # the tools, the source, ggml-avx2/: all still there
    assert (cache / "src" / "llama_cpp_python-x" / "vendor" / "llama.cpp" / "ggml" / "CMakeLists.txt").exists()
    removed = [s for s in said if s.startswith("removed")]
    assert len(removed) == 1 and str(home) in removed[0]
    # 10 + 5000 + 2000 (legacy) + 10 + 7000 + 3000 (the old key) + the symlink itself
    link = len(str(cache / "src" / "llama_cpp_python-x" / "vendor" / "llama.cpp" / "ggml" / "CMakeLists.txt"))
    assert removed[0].endswith(f"{ggml.format_bytes(17020 + link)} freed"), removed[0]


def test_a_new_shim_source_removes_the_earlier_shims_only(cache, monkeypatch):
    home = cache / "ggml"
    first = ggml.build(cache, isa="native", echo=lambda s: None)
    lib = first.parent
    old_shim = _put(lib / "libmoectl_ggml-bbbbbbbbbbbb.so", 500)     # an earlier shim source's
    half = _put(lib / "libmoectl_ggml-cccccccccccc.tmp", 500)        # a killed build's
    said = []
    assert ggml.build(cache, isa="native", echo=said.append) == first and said == []    # reused: nothing removed
    assert old_shim.exists()
    monkeypatch.setattr(ggml, "_shim_key", lambda: "dddddddddddd")   # the shim's source changed
    shim = ggml.build(cache, isa="native", echo=said.append)
    assert shim.name == "libmoectl_ggml-dddddddddddd.so" and shim.exists()
    assert not old_shim.exists() and not half.exists() and not first.exists()
    assert (lib / "libggml-cpu.so").exists() and not [s for s in said if s.startswith("building")]   # ggml reused
    names = ", ".join(sorted([first.name, old_shim.name, half.name]))
    assert said == [f"removed ggml's earlier builds in {home} ({names}): {ggml.format_bytes(1500)} freed"]


def test_the_avx2_build_prunes_its_own_folder_only(cache):
    ggml.build(cache, isa="avx2", echo=lambda s: None)
    assert not (cache / "ggml-avx2" / f"lib-p{OLD}").exists()
    assert (cache / "ggml" / f"lib-p{OLD}").exists() and (cache / "ggml" / "lib").exists()    # native's: untouched
    assert (cache / "build-avx2" / "llama-bench").exists() and (cache / "bin-avx2" / "llama-bench").exists()


def test_prune_0_keeps_every_build(cache, monkeypatch):
    monkeypatch.setenv("MOECTL_GGML_PRUNE", "0")
    before = _tree(cache)
    said = []
    ggml.build(cache, isa="native", echo=said.append)
    assert before <= _tree(cache) and not [s for s in said if s.startswith("removed")]


def test_the_build_and_the_pruning_name_a_keys_entries_from_one_list(cache):
    """`KEYED` is the one list of a patch key's entries: every name `build` makes is `keyed`, and the pruning's
    pattern matches exactly those names for another key."""
    ggml.build(cache, isa="native", echo=lambda s: None)
    home, key = cache / "ggml", ggml_patch.build_key()
    made = {e.name for e in home.iterdir() if e.name.endswith(key)}
    assert made == {ggml.keyed(home, prefix).name for prefix in ggml.KEYED}
    for prefix in ggml.KEYED:
        assert ggml.STALE_KEYED.fullmatch(ggml.keyed(home, prefix, f"p{OLD}").name)
    assert not ggml.STALE_KEYED.fullmatch(f"bin-p{OLD}")
    with pytest.raises(ValueError, match="bin"):
        ggml.keyed(home, "bin")


def test_describe_says_the_shim_alone_is_missing_and_costs_seconds(cache, monkeypatch):
    """Libraries built, shim missing (a changed shim source): `describe` (what `inspect` prints) says the shim is
    what first use compiles, in seconds, not the minutes of a whole build."""
    import functools

    monkeypatch.setenv("MOECTL_GGML_ROOT", str(cache))
    monkeypatch.setenv("MOECTL_GGML", "1")
    monkeypatch.delenv("MOECTL_GGML_ISA", raising=False)
    monkeypatch.setattr(ggml, "_load", functools.lru_cache(maxsize=1)(lambda: None))   # nothing loaded here
    why = ggml.describe()["why_not"]
    assert "build is not made yet" in why and ggml.BUILD_NOTE in why
    shim = ggml.build(echo=lambda s: None)
    shim.unlink()                                                     # the shim's source changed: not built yet
    g = ggml.describe()
    assert not g["built"] and g["features"] is None
    assert "shim is not compiled yet" in g["why_not"] and ggml.SHIM_NOTE in g["why_not"]
    assert "minutes" not in g["why_not"]
