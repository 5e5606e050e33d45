"""Both tools restricted to AVX2 on an AVX-512 host (issue 42's AVX2 table): `MOECTL_GGML_ISA` (moectl/kernels/isa.py)
picks the cmake flags and the build directory of moectl's ggml and of llama.cpp's tools, turns moectl's AVX-512
kernels off, and is one `error:` line when it is not an ISA moectl builds for; bench/gguf_vs_llamacpp.py's `--isa`
sets it for both sides, records it and refuses a comparison where either side reports AVX-512. No ggml library is
built here: the last tests run only where both builds' libraries are already made (as the other ggml tests skip;
a child compiles the shim over them, seconds, where its source changed). `builds_or_skip` and `in_child` serve the
other test files that need a child on another build (tests/test_ggml_q6k.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gguf_vs_llamacpp
import llamacpp
from moectl import kernels
from moectl.errors import MoectlError
from moectl.kernels import ggml, ggml_patch
from moectl.kernels import isa as isas
from test_bad_input import assert_one_error, run_cli

ROOT = Path(__file__).resolve().parents[1]
WIDER = ("GGML_AVX512", "GGML_AMX", "GGML_AVX_VNNI")          # the option names wider than AVX2 start so


def test_the_avx2_flags_turn_on_avx2_and_below_and_every_wider_option_off():
    flags = isas.cmake_flags("avx2")
    for on in ("NATIVE=OFF", "AVX=ON", "AVX2=ON", "FMA=ON", "F16C=ON", "BMI2=ON"):
        assert f"-DGGML_{on}" in flags
    wider = [f for f in flags if f[2:].startswith(WIDER)]
    assert wider and all(f.endswith("=OFF") for f in wider)
    assert isas.cmake_flags("native") == ["-DGGML_NATIVE=ON"]
    assert isas.shim_flags("native") == [] and isas.shim_flags("avx2") == ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]
    assert not any("march" in f for name in isas.ISAS for f in isas.shim_flags(name))


def test_the_avx2_flags_name_every_wider_option_of_the_vendored_source():
    """Option names change between llama.cpp versions: every one the list sets is an option of the pinned source,
    and every AVX-512 / AMX / AVX-VNNI option there is in the list, OFF."""
    src = ggml.source_dir()
    if not (src / "ggml" / "CMakeLists.txt").exists():
        pytest.skip(f"the pinned llama.cpp source is not unpacked here ({src})")
    options = set(re.findall(r"option\((GGML_\w+)", (src / "ggml" / "CMakeLists.txt").read_text()))
    named = {f[2:].split("=")[0] for f in isas.AVX2_CMAKE}
    assert named <= options
    assert {o for o in options if o.startswith(WIDER)} <= named


def test_each_isa_builds_into_its_own_directories(tmp_path):
    assert ggml.ggml_home(tmp_path, "native") == tmp_path / "ggml"              # where the native build always was
    assert ggml.ggml_home(tmp_path, "avx2") == tmp_path / "ggml-avx2"
    assert ggml.shim_path(tmp_path, "avx2").parent == tmp_path / "ggml-avx2" / f"lib-p{ggml_patch.KEY}"
    assert llamacpp.tool("llama-bench", tmp_path, "native") == tmp_path / "bin" / "llama-bench"
    assert llamacpp.tool("llama-bench", tmp_path, "avx2") == tmp_path / "bin-avx2" / "llama-bench"
    (tmp_path / "BUILT").write_text("x")                    # a native build here says nothing of the avx2 one
    (tmp_path / "bin").mkdir()
    for t in llamacpp.TOOLS:
        (tmp_path / "bin" / t).write_text("x")
    assert llamacpp.built(tmp_path, isa="native") and not llamacpp.built(tmp_path, isa="avx2")


def test_the_isa_comes_from_the_environment_and_reaches_both_builds_flags(monkeypatch, tmp_path):
    monkeypatch.delenv(isas.ENV, raising=False)
    assert isas.current() == "native"
    native = llamacpp.cmake_flags()
    assert "-DGGML_NATIVE=ON" in native and not any(f.startswith("-DGGML_AVX2") for f in native)
    avx2 = llamacpp.cmake_flags(isa="avx2")
    assert set(isas.AVX2_CMAKE) <= set(avx2) and "-DGGML_NATIVE=ON" not in avx2
    assert "-DGGML_NATIVE=OFF" in llamacpp.cmake_flags(cuda=True)               # the CUDA build: its own variants
    monkeypatch.setenv(isas.ENV, "avx2")
    assert isas.current() == "avx2" and llamacpp.bin_dir(tmp_path) == tmp_path / "bin-avx2"
    assert ggml.ggml_home(tmp_path) == tmp_path / "ggml-avx2"


def test_avx2_mode_turns_moectls_avx512_kernels_off(monkeypatch):
    monkeypatch.setenv(isas.ENV, "avx2")
    monkeypatch.delenv("MOECTL_CPU_KERNELS", raising=False)
    kernels.library.cache_clear()
    try:
        assert kernels.library() is None
        assert kernels.why_not() == "MOECTL_GGML_ISA=avx2: no AVX-512 in this process"
    finally:
        kernels.library.cache_clear()


def test_a_bad_isa_is_one_error_line_where_ggml_is_used_and_nothing_elsewhere(monkeypatch, capsys, tmp_path):
    """A bad MOECTL_GGML_ISA is one `error:` line where ggml is built or loaded (a GGUF's run, the bench), never at
    start-up: `moectl --help` and `inspect` of a safetensors checkpoint run, `inspect` of a GGUF reports the file
    without ggml and says why in one line, and moectl's own AVX-512 kernels are off (never wider than asked) rather
    than an error."""
    from gguf import GGMLQuantizationType as T
    from gguf_build import write_gguf
    from test_ggml_graph import _checkpoint

    ckpt = _checkpoint("mixtral", tmp_path)
    gguf = write_gguf(ckpt, tmp_path / "Q.gguf", dense_encoding=T.Q8_0, expert_encoding=T.Q4_0)
    monkeypatch.setenv(isas.ENV, "avx512")
    with pytest.raises(MoectlError, match="'avx512'.*native, avx2"):
        isas.current()
    with pytest.raises(MoectlError, match="native, avx2"):
        ggml.library()
    code, out, err = run_cli(["--help"], capsys, monkeypatch)
    assert code == 0 and "inspect" in out and "error" not in err, err
    code, out, err = run_cli(["inspect", "--model", str(ckpt), "--json", "--device", "cpu", "--workdir",
                              str(tmp_path / "wd")], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["family"] == "mixtral" and "ggml" not in json.loads(out), err
    code, out, err = run_cli(["generate", "--model", str(gguf), "--device", "cpu", "--workdir", str(tmp_path / "wd2"),
                              "-p", "hi", "-n", "1"], capsys, monkeypatch)
    assert_one_error(code, err, "MOECTL_GGML_ISA='avx512'", "native, avx2")
    # inspect reports what the file is, and in place of ggml's facts one line saying the setting turned it off
    code, out, err = run_cli(["inspect", "--model", str(gguf), "--device", "cpu", "--json", "--workdir",
                              str(tmp_path / "wd2")], capsys, monkeypatch)
    info = json.loads(out)
    assert code == 0 and info["family"] == "mixtral" and info["expert_format"] == "gguf-Q4_0", err
    assert info["gguf"]["encodings"] and info["gguf"]["file_bytes"] > 0
    why = "ggml is unavailable: MOECTL_GGML_ISA='avx512' is not an ISA moectl builds ggml for"
    assert info["ggml"]["why_not"].startswith(why) and info["ggml"]["isa"] == "avx512"
    assert info["ggml"]["features"] is None and not info["ggml"]["built"]
    assert not info["gguf"]["cpu_in_place"]["mapped"] and info["gguf"]["cpu_in_place"]["ggml_repack"]["total"] == 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(why) and "Traceback" not in err, err
    code, out, err = run_cli(["inspect", "--model", str(gguf), "--device", "cpu", "--workdir", str(tmp_path / "wd2")],
                             capsys, monkeypatch)
    assert code == 0 and "unavailable: MOECTL_GGML_ISA='avx512'" in out and len(err.strip().splitlines()) == 1, err
    assert max(map(len, out.splitlines())) <= 80
    with pytest.raises(MoectlError, match="native, avx2"):        # the report's switch-off ended with it
        ggml.library()
    monkeypatch.delenv("MOECTL_CPU_KERNELS", raising=False)
    kernels.library.cache_clear()
    try:
        assert kernels.library() is None
        assert "MOECTL_GGML_ISA='avx512'" in kernels.why_not() and "AVX-512 kernels off" in kernels.why_not()
    finally:
        kernels.library.cache_clear()
    r = subprocess.run([sys.executable, "bench/gguf_vs_llamacpp.py", "--probe-only"], capture_output=True,
                       text=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: MOECTL_GGML_ISA='avx512' is not an ISA moectl builds ggml for: use one of native, avx2"]


def test_the_bench_help_says_isa_and_use_isa_sets_both_sides(monkeypatch):
    out = subprocess.run([sys.executable, "bench/gguf_vs_llamacpp.py", "--help"], capture_output=True, text=True,
                         cwd=ROOT).stdout
    assert "--isa {native,avx2}" in out and "bin-avx2" in out
    for k in (isas.ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):   # set, then deleted: monkeypatch restores
        monkeypatch.setenv(k, "")                                      # what use_isa writes (a plain delenv of an
        monkeypatch.delenv(k)                                          # unset name records nothing to undo)
    assert gguf_vs_llamacpp.use_isa("avx2") == "avx2"
    assert os.environ[isas.ENV] == "avx2" and os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert llamacpp.tool("llama-bench").parent.name == "bin-avx2"


AVX2_INFO = "n_threads = 1 (n_threads_batch = 1) / 2 | CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | REPACK = 1 |"
NATIVE_INFO = AVX2_INFO.replace("AVX2 = 1 |", "AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 |")


def test_a_restricted_comparison_is_refused_where_either_side_reports_avx512():
    wider = gguf_vs_llamacpp.wider_than_isa
    clean = [{"ggml_features": ["avx2", "fma", "f16c"], "moectl_avx512": False}]
    assert wider("avx2", AVX2_INFO, ["avx2", "fma"], clean) == []
    assert wider("native", NATIVE_INFO, ["avx2", "avx512"], [{"moectl_avx512": True}]) == []    # not asked
    assert wider("avx2", NATIVE_INFO, None, []) == [
        "llama.cpp's system_info has AVX512 = 1, AVX512_VNNI = 1, AMX_INT8 = 1"]
    assert wider("avx2", AVX2_INFO.replace("AVX2", "AVX512 = 0 | AVX2"), None, []) == []      # listed, not in use
    assert wider("avx2", "", None, []) == ["llama.cpp printed no system_info line to check"]
    assert wider("avx2", AVX2_INFO, ["avx2", "avx512", "avx512_vnni"], []) == [
        "moectl's ggml reports avx512, avx512_vnni"]
    assert wider("avx2", AVX2_INFO, None, [{"ggml_features": ["avx_vnni"], "moectl_avx512": True}]) == [
        "moectl's ggml reports avx_vnni", "a moectl run used its AVX-512 kernels"]


def _fake(monkeypatch, tmp_path, info: str, feats: list[str] | None):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    fig = {"decode_ms": 10.0, "prefill_tps": 100.0, "rss_gb": 1.0, "load_s": 1.0}
    kern = {"ggml": True, "ggml_features": feats or [], "ggml_why_not": None, "moectl_avx512": False,
            "moectl_avx512_why_not": "MOECTL_GGML_ISA=avx2: no AVX-512 in this process"}
    monkeypatch.setattr(gguf_vs_llamacpp, "moectl_run", lambda *a: {**fig, "note": None, "kernels": kern})
    monkeypatch.setattr(gguf_vs_llamacpp, "llama_run", lambda *a: {**fig, "cpu": {
        "cpu_info": "Xeon", "backends": "CPU", "repack": True}})
    monkeypatch.setattr(gguf_vs_llamacpp.llamacpp, "system_info", lambda gguf: info)
    monkeypatch.setattr(gguf_vs_llamacpp, "ggml_features_here", lambda: feats)
    monkeypatch.setattr(gguf_vs_llamacpp, "token_read_bytes", lambda p: {"total": 1_000_000})
    monkeypatch.setattr(gguf_vs_llamacpp, "read_probe", lambda t: None)
    return lambda: gguf_vs_llamacpp.compare("qwen3-moe", 2, tmp_path, [], [1], 1, 4, 2, 8, files={"Q4_K_M": path},
                                            isa="avx2")


def test_the_restricted_json_and_table_say_avx2_and_a_wider_side_is_refused_before_any_run(monkeypatch, tmp_path):
    res = _fake(monkeypatch, tmp_path, AVX2_INFO, ["avx2", "fma", "f16c"])()
    assert res["isa"] == "avx2" and json.loads(json.dumps(res))["isa"] == "avx2"
    lines = gguf_vs_llamacpp.table(res)
    assert max(map(len, lines)) <= 80
    assert lines[0] == "qwen3-moe x 2 layers, both tools restricted to AVX2 (no AVX-512)"
    text = " ".join(lines)
    assert "GGML_NATIVE=OFF GGML_AVX2=ON" in text and "MOECTL_GGML_ISA=avx2" in text
    assert "restricted" not in " ".join(gguf_vs_llamacpp.table({**res, "isa": "native"}))
    with pytest.raises(SystemExit, match="error: not restricted to AVX2.*AVX512 = 1"):
        _fake(monkeypatch, tmp_path, NATIVE_INFO, ["avx2"])()
    with pytest.raises(SystemExit, match="moectl's ggml reports avx512"):
        _fake(monkeypatch, tmp_path, AVX2_INFO, ["avx2", "avx512"])()


def test_the_avx2_target_runs_the_restricted_table():
    made = subprocess.run(["make", "-n", "bench-gguf-avx2"], capture_output=True, text=True, cwd=ROOT).stdout
    runs = [ln for ln in made.splitlines() if "bench/gguf_vs_llamacpp.py" in ln]
    assert runs and all("--isa avx2" in r and "--types Q4_K_M Q8_0" in r for r in runs)


# --- with both ggml builds made here (their libraries never built by a test: minutes each) -------------------------

def builds_or_skip(*names: str) -> None:
    """Skip unless ggml's libraries for each ISA in `names` (default: every one) are made here; a child's first load
    compiles the shim over them where it is missing (one C file, seconds)."""
    missing = [name for name in names or isas.ISAS if not ggml.libraries_built(isa=name)]
    if missing:
        pytest.skip(f"ggml's {' and '.join(missing)} build is not made here (the bench or a run makes it)")


def in_child(code: str, isa: str, env: dict[str, str] | None = None) -> str:
    """The stdout of `code` run by a fresh Python on ggml's `isa` build (one process holds one build), `env` added
    to its environment."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=os.environ | {"PYTHONPATH": str(ROOT), isas.ENV: isa, "MOECTL_GGML": "1"} | (env or {}))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_avx2_build_reports_no_avx512_and_the_native_one_what_the_cpu_has():
    builds_or_skip()
    code = "from moectl.kernels import ggml\nimport json\nprint(json.dumps(ggml.describe()))"
    avx2 = json.loads(in_child(code, "avx2"))
    assert avx2["isa"] == "avx2" and avx2["built_for"] == "AVX2"
    assert "avx2" in avx2["features"] and not set(avx2["features"]) & set(gguf_vs_llamacpp.WIDER_FEATURES)
    native = json.loads(in_child(code, "native"))
    assert native["built_for"] == ("AVX-512" if gguf_vs_llamacpp.host_isa() == "AVX-512" else "AVX2")


def test_a_gguf_decodes_to_the_same_tokens_through_either_build(tmp_path, monkeypatch):
    """The suite's tiny GGUF (Q8_0 dense, Q4_0 experts), in a fresh process per build: the AVX2 kernels compute the
    same quantized dot products in another order, so the graph's logits are close to the native build's and
    `moectl generate --greedy` gives the same tokens."""
    builds_or_skip()
    from gguf import GGMLQuantizationType as T
    from gguf_build import write_gguf
    from test_ggml_graph import _checkpoint, torch_free_forward

    path = write_gguf(_checkpoint("mixtral", tmp_path), tmp_path / "Q.gguf", dense_encoding=T.Q8_0,
                      expert_encoding=T.Q4_0)
    logits = {}
    for name in isas.ISAS:
        monkeypatch.setenv(isas.ENV, name)
        logits[name] = torch_free_forward(path, [5, 17, 42, 9, 100, 7], tmp_path)[1]
    for k in ("logits", "step"):
        a, b = logits["avx2"][k], logits["native"][k]
        assert abs(a - b).max() <= 1e-2 * abs(b).max(), k
    args = [sys.executable, "-m", "moectl", "generate", "--model", str(path), "--prompt", "The capital of France is",
            "-n", "8", "--threads", "1", "--device", "cpu", "--workdir", str(tmp_path / "wd"), "--json", "--greedy"]
    tokens = {}
    for name in ("native", *isas.ISAS):             # the first run saves the config and tokenizer the others read
        r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600,
                           env=os.environ | {"PYTHONPATH": str(ROOT), isas.ENV: name})
        assert r.returncode == 0, r.stderr[-2000:]
        tokens[name] = json.loads(r.stdout)["token_ids"]
    assert tokens["avx2"] == tokens["native"]


def test_inspect_says_which_build_computes_a_gguf(tmp_path):
    """`moectl inspect` on a GGUF names the ISA setting and, where that build is made, what its library reports
    (a fresh process: one process holds one ggml build)."""
    from gguf import GGMLQuantizationType as T
    from gguf_build import write_gguf
    from test_ggml_graph import _checkpoint

    path = write_gguf(_checkpoint("mixtral", tmp_path), tmp_path / "Q.gguf", dense_encoding=T.Q8_0,
                      expert_encoding=T.Q4_0)
    r = subprocess.run([sys.executable, "-m", "moectl", "inspect", "--model", str(path), "--json", "--device", "cpu",
                        "--workdir", str(tmp_path / "wd")], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=os.environ | {"PYTHONPATH": str(ROOT), isas.ENV: "avx2", "MOECTL_GGML": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    g = json.loads(r.stdout)["ggml"]
    assert g["isa"] == "avx2"
    if ggml.shim_path(isa="avx2").exists():
        assert g["built_for"] == "AVX2" and "avx512" not in g["features"] and g["why_not"] is None
    else:
        assert g["features"] is None and "avx2 build is not made yet" in g["why_not"]
