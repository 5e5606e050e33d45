"""The two llama.cpp comparisons (`bench/vs_llamacpp.py`, `bench/gguf_vs_llamacpp.py`) time moectl with one script
(`bench/moectl_timed.py`) that warms up with a whole prefill before the timed one, as llama-bench does; the GGUF bench's file set
(importance matrix only where llama-quantize needs one, checkpoint and BF16 dropped when asked) and its table
(80 columns, decode medians with [min-max], the AVX2 note). No llama.cpp run here: its tools are stood in for."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import gguf_vs_llamacpp
import llamacpp
import moectl_timed
import vs_llamacpp


class _FakeEngine:
    """Records the token count of every forward; a one-entry cache stands in for the KV cache."""
    calls: list[int] = []
    ids: list[list[int]] = []

    class config:
        vocab_size = 50

    plan_note = "plan: none"

    @classmethod
    def load(cls, model, **kw):
        cls.calls, cls.ids = [], []
        cls.loaded = (model, kw)
        return cls()

    def forward(self, ids, pkv, last_only=False):
        self.calls.append(ids.shape[-1])
        self.ids.append(ids.reshape(-1).tolist())
        return torch.zeros(1, 1, 50), "cache"


def _run_script_here(monkeypatch, capsys, **kw) -> dict:
    monkeypatch.setattr("moectl.runtime.engine.Engine", _FakeEngine)
    exec(moectl_timed.script(**kw), {})
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[7:])


def test_the_timed_prefill_comes_after_a_warm_up_and_the_load_is_timed_only_when_asked(monkeypatch, capsys):
    res = _run_script_here(monkeypatch, capsys, load={"model": "m.gguf"}, threads=2, prompt=4, gen=3, prefill=16,
                           time_load=True)
    # load's first token, the warm-up (llama-bench's: a whole prefill of other tokens), the timed prefill, the
    # context (the prefill's first tokens), then one token per decode step
    assert _FakeEngine.calls == [1, 16, 16, 4, 1, 1, 1]
    warm, timed, context = _FakeEngine.ids[1:4]
    assert warm != timed and context == timed[:4]
    assert _FakeEngine.loaded == ("m.gguf", {"device": "cpu", "threads": 2, "progress": False, "gating": "none"})
    assert set(res) - {"first_use_repack"} == {"load_s", "prefill_tps", "prefill_samples", "decode_ms", "rss_gb",
                                                "note", "kernels"}
    assert res["note"] == "plan: none" and res["kernels"]["torch_threads"] == torch.get_num_threads()
    assert {"ggml", "ggml_features", "ggml_why_not", "moectl_avx512", "moectl_avx512_why_not"} <= set(res["kernels"])

    res = _run_script_here(monkeypatch, capsys, load={"model": "ckpt", "lowbit": "q4g64"}, threads=1, prompt=2,
                           gen=1, prefill=8)
    assert _FakeEngine.calls == [8, 8, 2, 1] and "load_s" not in res
    assert _FakeEngine.loaded[1]["lowbit"] == "q4g64"


def test_prefill_reps_time_llama_benchs_own_prompts_and_report_their_mean(monkeypatch, capsys):
    # llama-bench -r 3 reports the mean of its reps' tokens/s: moectl's side times as many prefills (stop 56: one
    # forward alone moved by 0.8-1.3x between runs), each on the ids llama-bench feeds that rep, after its warm-up's
    # (stop 57: one fixed draw routed 13-22 % more of a Qwen3 layer's rows below ggml's tiled threshold)
    res = _run_script_here(monkeypatch, capsys, load={"model": "m"}, threads=1, prompt=2, gen=1, prefill=8,
                           prefill_reps=3)
    assert _FakeEngine.calls == [8, 8, 8, 8, 2, 1]
    assert _FakeEngine.ids[:4] == llamacpp.bench_prompt_ids(_FakeEngine.config.vocab_size, 8, 4)
    assert _FakeEngine.ids[4] == _FakeEngine.ids[1][:2]                 # the decode's context: the first rep's
    assert len(res["prefill_samples"]) == 3
    assert res["prefill_tps"] == pytest.approx(sum(res["prefill_samples"]) / 3)
    with pytest.raises(ValueError, match="prefill_reps"):
        moectl_timed.script({"model": "m"}, 1, 2, 1, prefill=8, prefill_reps=0)


def test_llama_benchs_prompt_ids_are_glibcs_rand_unseeded_with_bos_first_where_the_file_adds_one(tmp_path):
    libc = ctypes.util.find_library("c")
    if libc and "libc.so.6" in libc:                   # glibc's own, where this is glibc
        c = ctypes.CDLL(libc)
        c.srand(1)
        assert [c.rand() for _ in range(2000)] == llamacpp.glibc_rand(2000)
    first = llamacpp.glibc_rand(4)
    assert first[0] == 1804289383                      # glibc's first rand(): what llama-bench's first token is made of
    assert llamacpp.bench_prompt_ids(151936, 2, 2) == [[first[0] % 151936, first[1] % 151936],
                                                      [first[2] % 151936, first[3] % 151936]]
    # BOS takes the first place of each prompt and draws nothing (llama-bench's test_prompt)
    assert llamacpp.bench_prompt_ids(1000, 3, 2, bos=7) == [[7, first[0] % 1000, first[1] % 1000],
                                                           [7, first[2] % 1000, first[3] % 1000]]

    def write(name, model="llama", add=None):
        w = gguf.GGUFWriter(tmp_path / name, "llama")
        w.add_tokenizer_model(model)
        w.add_bos_token_id(5)
        if add is not None:
            w.add_add_bos_token(add)
        w.add_tensor("x", np.zeros(4, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return str(tmp_path / name)

    # a sentencepiece vocabulary adds BOS unless the file says not; a BPE one only where it says so
    assert [moectl_timed.gguf_bos(write("a.gguf")), moectl_timed.gguf_bos(write("b.gguf", add=False)),
            moectl_timed.gguf_bos(write("c.gguf", "gpt2")), moectl_timed.gguf_bos(write("d.gguf", "gpt2", True))] == \
        [5, None, None, 5]
    assert moectl_timed.gguf_bos(str(tmp_path / "checkpoint")) is None


def test_a_decode_context_longer_than_the_prefill_is_refused():
    with pytest.raises(ValueError, match="1 <= prompt <= prefill"):
        moectl_timed.script({"model": "m"}, 1, 8, 4, prefill=4)
    moectl_timed.script({"model": "m"}, 1, 4, 4, prefill=4)          # a short prefill is fine: the warm-up is as long


def test_both_benches_time_moectl_with_the_shared_script(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(moectl_timed, "moectl_run", lambda load, *a, **kw: seen.append((load, a, kw)) or {})
    vs_llamacpp.moectl_run("ckpt", "wd", "q8g64", 2, 32, 64, 512, dense_lowbit="q8")
    gguf_vs_llamacpp.moectl_run(tmp_path / "f.gguf", 1, 32, 16, 64)
    assert seen == [({"model": "ckpt", "workdir": "wd", "lowbit": "q8g64", "precision": "lowbit-only",
                      "dense_lowbit": "q8"}, (2, 32, 64, 512), {}),
                    ({"model": str(tmp_path / "f.gguf")}, (1, 16, 32, 64),
                     {"time_load": True, "torch_free": True, "prefill_reps": 3})]


def test_the_shared_script_runs_the_tiny_model_in_a_fresh_process(tiny_small):
    """The real thing, small: the child loads the tiny model, warms up and reports every field with a value."""
    res = moectl_timed.moectl_run({"model": str(tiny_small), "workdir": str(tiny_small.parent)}, threads=1,
                                  prompt=4, gen=2, prefill=8, time_load=True)
    assert set(res) - {"first_use_repack"} == {"load_s", "prefill_tps", "prefill_samples", "decode_ms", "rss_gb",
                                                "note", "kernels"}
    assert res["load_s"] > 0 and res["prefill_tps"] > 0 and res["decode_ms"] > 0 and 0.05 < res["rss_gb"] < 64
    assert res["kernels"]["torch_threads"] == 1


@pytest.fixture
def fake_tools(monkeypatch):
    """llama.cpp's converter, llama-imatrix and llama-quantize stood in for: each writes its output file."""
    made = []

    def converted_bf16(shape, layers, work, m):
        (work / "checkpoint").mkdir(exist_ok=True)
        (work / "checkpoint" / "config.json").write_text("{}")
        (work / "model-BF16.gguf").write_bytes(b"b" * 1000)
        made.append("convert")
        return work / "checkpoint", work / "model-BF16.gguf"

    def quantize(src, out, qt, threads=2, imatrix=None, log=None):
        assert Path(src).exists() and str(out).endswith(".gguf.part") and str(log) == str(out)[:-5] + ".log"
        Path(out).write_bytes(b"q" * 100)
        made.append((qt, imatrix is not None))

    def imatrix(gguf, text, out, *a):
        assert Path(text).read_text().strip()
        Path(out).write_bytes(b"i")
        made.append("imatrix")

    monkeypatch.setattr(vs_llamacpp, "converted_bf16", converted_bf16)
    monkeypatch.setattr(gguf_vs_llamacpp.llamacpp, "quantize", quantize)
    monkeypatch.setattr(gguf_vs_llamacpp.llamacpp, "imatrix", imatrix)
    return made


def test_the_file_set_uses_an_importance_matrix_only_where_llama_quantize_needs_one(fake_tools, tmp_path):
    files = gguf_vs_llamacpp.prepare("qwen3-moe", 2, tmp_path, ["Q4_K_M", "IQ2_XXS", "IQ3_XXS", "BF16"])
    assert fake_tools == ["convert", ("Q4_K_M", False), "imatrix", ("IQ2_XXS", True), ("IQ3_XXS", True)]
    assert sorted(files) == ["BF16", "IQ2_XXS", "IQ3_XXS", "Q4_K_M"] and all(f.exists() for f in files.values())
    assert not (tmp_path / "checkpoint").exists()                       # only the conversion reads it
    took = json.loads((tmp_path / "prepare.json").read_text())
    assert set(took) == {"checkpoint+convert", "llama-imatrix", "llama-quantize Q4_K_M", "llama-quantize IQ2_XXS",
                         "llama-quantize IQ3_XXS"}
    listing = gguf_vs_llamacpp.file_list(files, tmp_path)
    assert "model-IQ2_XXS.gguf" in listing and "0.00 GB" in listing and "total 0.00 GB" in listing

    fake_tools.clear()                                                  # made once: nothing is redone
    assert gguf_vs_llamacpp.prepare("qwen3-moe", 2, tmp_path, ["Q4_K_M", "IQ2_XXS", "BF16"]) == \
        {k: files[k] for k in ("Q4_K_M", "IQ2_XXS", "BF16")}
    assert fake_tools == []


def test_drop_bf16_deletes_it_after_quantizing_and_does_not_remake_it(fake_tools, tmp_path):
    files = gguf_vs_llamacpp.prepare("mixtral", 2, tmp_path, ["Q8_0", "BF16"], drop_bf16=True)
    assert list(files) == ["Q8_0"] and not (tmp_path / "model-BF16.gguf").exists()
    fake_tools.clear()
    assert list(gguf_vs_llamacpp.prepare("mixtral", 2, tmp_path, ["Q8_0"], drop_bf16=True)) == ["Q8_0"]
    assert fake_tools == []
    assert gguf_vs_llamacpp.default_types("gpt-oss-20b") == ["MXFP4_MOE"]
    assert {"Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "BF16", "IQ2_XXS", "IQ3_XXS", "Q2_K",
            "Q3_K_M"} == set(gguf_vs_llamacpp.default_types("mixtral"))


def test_an_interrupted_quantize_leaves_no_file_that_looks_made(fake_tools, tmp_path, monkeypatch):
    def killed(src, out, qt, threads=2, imatrix=None, log=None):
        Path(out).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_vs_llamacpp.llamacpp, "quantize", killed)
    with pytest.raises(KeyboardInterrupt):
        gguf_vs_llamacpp.prepare("qwen3-moe", 2, tmp_path, ["Q8_0"])
    assert not (tmp_path / "model-Q8_0.gguf").exists()


def test_a_half_written_checkpoint_is_written_again(tmp_path, monkeypatch):
    """write_synthetic refuses a non-empty directory; one without config.json (written last) was interrupted."""
    import moectl.synth.checkpoint as checkpoint

    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "model-00001-of-00003.safetensors").write_bytes(b"half")
    written = []
    monkeypatch.setattr(checkpoint, "write_synthetic", lambda shape, out, *a, **kw: written.append(
        sorted(p.name for p in out.iterdir()) if out.exists() else []))
    monkeypatch.setattr(vs_llamacpp.llamacpp, "convert", lambda ckpt, out, *a, **kw: Path(out).write_bytes(b"g"))
    made = {}
    vs_llamacpp.converted_bf16("mixtral", 2, tmp_path, made)
    assert written == [[]] and (tmp_path / "model-BF16.gguf").read_bytes() == b"g" and "convert_s" in made


def _row(qt, threads, decode, spread):
    s = lambda m, lo, hi: {"median": m, "min": lo, "max": hi, "n": 3}      # noqa: E731
    figures = lambda d: {"decode_ms": s(d, d - spread, d + spread), "prefill_tps": s(1234.5, 1, 2),  # noqa: E731
                         "rss_gb": s(12.34, 12, 13), "load_s": s(123.4, 100, 200)}
    return {"type": qt, "threads": threads, "note": "plan: none", "moectl": figures(decode),
            "llama.cpp": figures(decode / 4), "ratio": {"decode_ms": 4.0, "prefill_tps": 1.0, "rss_gb": 1.0,
                                                        "load_s": 1.0},
            "paired_ratio": {"decode_ms": 3.21, "prefill_tps": 1.0, "rss_gb": 1.0, "load_s": 1.0},
            "kernels": [{"ggml": True, "ggml_features": ["avx2", "fma"], "ggml_why_not": None,
                         "moectl_avx512": False, "moectl_avx512_why_not": "this CPU lacks avx512f"}],
            "llamacpp_cpu": [{"cpu_info": "AMD EPYC", "backends": "CPU", "repack": True}]}


def test_the_table_fits_80_columns_with_decode_spreads_and_says_it_is_the_avx2_figure():
    res = {"shape": "gpt-oss-20b", "layers": 2, "load": (11.5, 1, 1), "host_isa": "AVX2",
           "llamacpp_system_info": "n_threads = 1 (n_threads_batch = 1) / 2 | CPU : SSE3 = 1 | AVX = 1 | "
                                   "AVX2 = 1 | AVX512 = 0 | REPACK = 1 |",
           "rows": [_row("MXFP4_MOE", 1, 9876.5, 123.4), _row("IQ2_XXS", 2, 12.0, 0.5)]}
    lines = gguf_vs_llamacpp.table(res)
    assert max(map(len, lines)) <= 80
    text = "\n".join(lines)
    assert "9876.5 [9753.1-9999.9]" in text and "2469.1 [2345.7-2592.5]" in text and "12.0 [11.5-12.5]" in text
    assert "  4.00   3.21" in text                              # the ratio of the medians, then the paired one
    assert "these are the AVX2 figures" in text and "built with SSE3 AVX AVX2 REPACK" in text
    assert "AVX512" not in text.split("built with")[1].split("\n")[0]
    assert "experts by ggml (avx2 fma)" in text
    res["host_isa"] = "AVX-512"
    assert "AVX2 figures" not in "\n".join(gguf_vs_llamacpp.table(res))


def test_prepare_only_is_in_the_help_and_the_make_target_runs_the_issues_table():
    out = subprocess.run([sys.executable, "bench/gguf_vs_llamacpp.py", "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert "--prepare-only" in out and "--drop-bf16" in out
    made = subprocess.run(["make", "-n", "bench-gguf"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout
    runs = [ln for ln in made.splitlines() if "bench/gguf_vs_llamacpp.py" in ln]
    assert len(runs) == 3
    for shape, run in zip(("qwen3-moe", "mixtral", "gpt-oss-20b"), runs):
        assert f"--shape {shape}" in run and "--threads 1 2" in run and f"--json bench-gguf/{shape}.json" in run


def test_the_paired_ratio_is_the_median_of_each_rounds_own_ratio(monkeypatch, tmp_path):
    """Rounds minutes apart drift together: the paired figure follows each round's own ratio, where the ratio of
    the medians can mix a fast round of one tool with a slow round of the other."""
    res = _fake_compare(monkeypatch, tmp_path, moectl=[10.0, 20.0, 30.0], llama=[11.0, 19.0, 33.0])
    row = res["rows"][0]
    assert row["ratio"]["decode_ms"] == pytest.approx(20.0 / 19.0)
    assert row["paired_ratio"]["decode_ms"] == pytest.approx(statistics.median([10 / 11, 20 / 19, 30 / 33]))
    assert row["paired_ratio"]["prefill_tps"] == 1.0
    assert row["first_use_repack"] == [{"matrices": 3, "s": 0.5}] * 3     # each run's, kept in the JSON


READ = {"total": 2_000_000, "experts": 1_500_000, "lm_head": 400_000, "embedding_row": 1000, "dense": 99_000,
        "top_k": 8, "experts_per_layer": 128}


def _fake_compare(monkeypatch, tmp_path, moectl, llama, threads=(1,), probe=True, seen=None):
    """`compare` on one stand-in file: each tool's decode ms/token round by round (`moectl`, `llama`), a token that
    reads READ's bytes, and a read probe that answers 10 and 12 GB/s per pass times the threads (None: `probe`
    False, as where ggml does not load); `seen` gets (threads, runs done so far) at every probe."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    repeat = len(moectl) // len(threads)
    moectl, llama, runs = iter(moectl), iter(llama), []
    fig = lambda d: {"decode_ms": d, "prefill_tps": 100.0, "rss_gb": 1.0, "load_s": 1.0}  # noqa: E731
    monkeypatch.setattr(gguf_vs_llamacpp, "moectl_run", lambda *a: runs.append(1) or {
        **fig(next(moectl)), "note": None, "kernels": {}, "first_use_repack": {"matrices": 3, "s": 0.5}})
    monkeypatch.setattr(gguf_vs_llamacpp, "llama_run", lambda *a: runs.append(1) or {**fig(next(llama)), "cpu": {}})
    monkeypatch.setattr(gguf_vs_llamacpp.llamacpp, "system_info", lambda gguf: "")
    monkeypatch.setattr(gguf_vs_llamacpp, "token_read_bytes", lambda p: READ if p == path else None)

    def read_probe(t):
        if seen is not None:
            seen.append((t, len(runs)))
        return {"passes": [10.0 * t, 12.0 * t, 11.0 * t], "threads": t} if probe else None

    monkeypatch.setattr(gguf_vs_llamacpp, "read_probe", read_probe)
    return gguf_vs_llamacpp.compare("qwen3-moe", 2, tmp_path, [], list(threads), repeat, 4, 2, 8, files={"f": path})


def test_each_row_carries_the_bytes_a_token_reads_the_probe_and_each_tools_share_of_it(monkeypatch, tmp_path):
    """The roofline fields (new beside the old ones): each tool's GB/s is the bytes a token reads over its median
    ms/token, its % is of the median of the row's probe passes, taken at the row's threads just before and just
    after its rounds; the floor is the bytes at that median."""
    seen = []
    res = _fake_compare(monkeypatch, tmp_path, moectl=[10.0, 20.0, 30.0, 5.0, 4.0, 6.0],
                        llama=[8.0, 16.0, 24.0, 4.0, 5.0, 6.0], threads=(1, 2), seen=seen)
    assert seen == [(1, 0), (1, 6), (2, 6), (2, 12)]              # before and after each row's 2 x 3 runs
    one, two = res["rows"]
    assert one["decode_read_bytes"] == READ and one["ratio"]["decode_ms"] == pytest.approx(20 / 16)   # kept
    assert one["read_gbps"] == {"median": 11.0, "min": 10.0, "max": 12.0, "n": 6}    # both probes' passes
    assert [p["threads"] for p in one["read_probe"]] == [1, 1]
    # 2 MB a token: moectl's median 20 ms/token is 0.1 GB/s, llama.cpp's 16 ms 0.125; of 11 GB/s
    assert one["achieved_gbps"] == pytest.approx({"moectl": 0.1, "llama.cpp": 0.125})
    assert one["roofline_pct"] == pytest.approx({"moectl": 100 * 0.1 / 11, "llama.cpp": 100 * 0.125 / 11})
    assert one["roofline_ms"] == pytest.approx(2e6 / 11e9 * 1e3)
    assert two["read_gbps"]["median"] == 22.0 and two["achieved_gbps"]["moectl"] == pytest.approx(0.4)
    assert res["read_probe_setup"] == {"bytes": 1 << 30, "passes": 7, "why_not": None}
    json.dumps(res)                                                 # the JSON holds every field

    for r in res["rows"]:                                           # what ran them, as a real run's rows say
        r.update(kernels=_row("x", 1, 1, 0)["kernels"], llamacpp_cpu=_row("x", 1, 1, 0)["llamacpp_cpu"])
    lines = gguf_vs_llamacpp.table({**res, "load": (1.0, 1, 1), "host_isa": "AVX2", "llamacpp_system_info": ""})
    text = "\n".join(lines)
    assert max(map(len, lines)) <= 80
    roof = lines[lines.index(next(ln for ln in lines if ln.startswith("Decode against the memory roofline"))):]
    head = next(i for i, ln in enumerate(roof) if ln.startswith("type"))
    assert roof[head].split() == ["type", "thr", "MB/tok", "read", "GB/s", "[min-max]", "moectl", "%", "llama", "%",
                                  "floor", "ms"]
    assert roof[head + 1].split() == ["f", "1", "2.0", "11.0", "[10.0-12.0]", "0.1", "1", "0.1", "1", "0.18"]
    assert roof[head + 2].split() == ["f", "2", "2.0", "22.0", "[20.0-24.0]", "0.4", "2", "0.4", "2", "0.09"]
    assert "before and after" in text


def test_without_a_probe_the_rows_keep_the_achieved_figure_and_the_table_says_dash(monkeypatch, tmp_path):
    res = _fake_compare(monkeypatch, tmp_path, moectl=[10.0], llama=[8.0], probe=False)
    row = res["rows"][0]
    assert row["achieved_gbps"] == pytest.approx({"moectl": 0.2, "llama.cpp": 0.25})
    assert "read_gbps" not in row and "roofline_pct" not in row and row["read_probe"] == [None, None]
    assert "ggml's shim did not load" in res["read_probe_setup"]["why_not"]
    lines = gguf_vs_llamacpp.roofline_table(res["rows"])
    assert lines[-1].split() == ["f", "1", "2.0", "-", "0.2", "-", "0.2", "-", "-"]


def test_a_json_from_before_the_roofline_prints_no_roofline_table():
    assert gguf_vs_llamacpp.roofline_table([_row("Q8_0", 1, 10.0, 1.0)]) == []


def test_the_help_explains_the_roofline():
    out = subprocess.run([sys.executable, "bench/gguf_vs_llamacpp.py", "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert "--probe-gb" in out and "memory roofline" in out and "roofline_pct" in out


def test_probe_only_prints_each_thread_counts_figure_and_refuses_a_bad_buffer(monkeypatch):
    monkeypatch.setattr(gguf_vs_llamacpp, "read_probe", lambda t: {"gbps": 10.0 * t, "min": 9.0 * t, "max": 11.0 * t})
    lines = gguf_vs_llamacpp.probe_lines([1, 2])
    assert [ln.split() for ln in lines[1:]] == [["1", "thr", "10.0", "[9.0-11.0]"], ["2", "thr", "20.0", "[18.0-22.0]"]]
    r = subprocess.run([sys.executable, "bench/gguf_vs_llamacpp.py", "--probe-only", "--probe-gb", "0"],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode != 0 and r.stderr.strip() == "error: --probe-gb must be > 0 and --probe-passes >= 1"


def test_llama_bench_decodes_after_the_same_context_as_moectl(monkeypatch):
    """Both benches' llama.cpp side decodes after `prompt` tokens of context (`-d`, filled untimed), as moectl's
    side decodes after its prompt: each tool's attention reads the same positions."""
    calls = []
    row = {"avg_ts": 50.0, "stddev_ts": 0.0}

    def bench_rows(gguf, args, root=None):
        calls.append([str(a) for a in args])
        return [row], 1.0

    monkeypatch.setattr(gguf_vs_llamacpp.llamacpp, "bench_rows", bench_rows)
    monkeypatch.setattr(vs_llamacpp.llamacpp, "bench_rows", bench_rows)
    for llama_run in (gguf_vs_llamacpp.llama_run, vs_llamacpp.llama_run):
        calls.clear()
        res = llama_run(Path("m.gguf"), 2, 32, 64, 16)
        dec = [c for c in calls if c[c.index("-n") + 1] == "32"]
        assert len(dec) == 1 and dec[0][dec[0].index("-d") + 1] == "16" and dec[0][dec[0].index("-p") + 1] == "0"
        assert res["decode_ms"] == 1000 / 50.0


def test_a_shape_can_be_a_yaml_file_as_make_synthetic_takes():
    """`--shape bench/shapes/qwen3-moe-thin48.yaml`: its family and shape are read from the file (the checkpoint is
    written from them), and the work directory is named by the file's stem; a recipe's name works as before."""
    from moectl.core.shapes import load_shape

    thin = str(Path(__file__).resolve().parents[1] / "bench" / "shapes" / "qwen3-moe-thin48.yaml")
    assert vs_llamacpp.shape_recipe(thin)["family"] == "qwen3_moe"
    assert load_shape(thin)["num_layers"] == 48 and load_shape(thin)["num_experts"] == 128
    assert vs_llamacpp.shape_label(thin) == "qwen3-moe-thin48" and vs_llamacpp.shape_label("mixtral") == "mixtral"
    assert vs_llamacpp.shape_recipe("mixtral")["family"] == "mixtral"
    assert gguf_vs_llamacpp.default_types(thin) == gguf_vs_llamacpp.FILE_SET
