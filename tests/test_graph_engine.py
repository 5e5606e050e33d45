"""The torch-free engine (moectl/runtime/graph_engine.py): a GGUF that the one ggml graph serves, run without torch
or transformers once an earlier run saved its config and tokenizer in the workdir. On each lean-load family:
`moectl generate` gives the `Engine`'s tokens, text, counters, options and lossy settings (greedy, and sampled with
a seed: numpy's draws on both); a fresh process's run imports neither torch nor transformers; what it computes from
the header (sizes, dense bytes, host need, fingerprint) equals the `Engine`'s; a run it cannot serve says why and
takes the `Engine` (no saved config, a rewritten file, low-bit copies, gating, the switch)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from gguf_build import k256_mixtral, write_gguf
from moectl.runtime import graph_engine as ge
from moectl.runtime.engine import Engine
from moectl.setting.options import RuntimeOptions
from moectl.store.facts import checkpoint_sizes, lean_dense_nbytes
from moectl.store.gguf.saved_config import saved_config, view_fingerprint
from moectl.models import config_fingerprint
from test_bad_input import run_cli
from test_ggml_graph import _checkpoint
from test_gguf_run import ggml_or_skip

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=[*ge.LEAN_FAMILIES, "mixtral-tied"])
def q_file(request, tmp_path_factory):
    """A tiny model of each lean-load family as a Q8_0 dense + Q4_0 experts GGUF (and a Mixtral whose lm_head is
    the embedding)."""
    root = tmp_path_factory.mktemp(f"torchfree_{request.param}")
    ckpt = k256_mixtral(root, tied=True) if request.param == "mixtral-tied" else _checkpoint(request.param, root)
    return write_gguf(ckpt, root / "Q.gguf", dense_encoding=T.Q8_0, expert_encoding=T.Q4_0)


def _generate(path, workdir, capsys, monkeypatch, *extra) -> tuple[dict, str]:
    code, out, err = run_cli(["generate", "--model", str(path), "--prompt", PROMPT, "-n", "6", "--threads", "1",
                              "--device", "cpu", "--workdir", str(workdir), "--json", *extra], capsys, monkeypatch)
    assert code == 0, err
    return json.loads(out), err


TORCH_FREE_NOTE = "torch-free run"
LEAN_NOTE = "(lean load: transformers' model built only if a module-path forward needs it)"
TORCH_FREE_NOTE_TAIL = "(torch-free run: neither torch nor transformers loaded)"


@pytest.mark.parametrize("sampling", [["--greedy"], ["--seed", "3"]])
def test_torch_free_run_gives_the_engines_answer(q_file, tmp_path, capsys, monkeypatch, sampling):
    """The first run (the Engine) saves the config and tokenizer; the second is torch-free and answers the same:
    tokens, text, counters, resolved options, lossy settings; its note says which engine ran."""
    ggml_or_skip()
    first, err1 = _generate(q_file, tmp_path, capsys, monkeypatch, *sampling)
    assert TORCH_FREE_NOTE not in err1
    assert (tmp_path / "gguf-config.json").exists()
    second, err2 = _generate(q_file, tmp_path, capsys, monkeypatch, *sampling)
    assert TORCH_FREE_NOTE in err2, err2
    assert second["token_ids"] == first["token_ids"] and second["text"] == first["text"]
    assert second["lossy"] == first["lossy"] and second["config"] == first["config"]
    for key in ("hits", "misses", "bytes_loaded", "hit_rate", "tokens", "experts_per_token", "threads",
                "cpu_experts", "load_wait_s", "bytes_per_token"):
        assert second["stats"][key] == first["stats"][key], key
    assert set(second["stats"]) == set(first["stats"])
    monkeypatch.setenv("MOECTL_TORCH_FREE", "0")            # the switch: the Engine again, the same answer
    third, err3 = _generate(q_file, tmp_path, capsys, monkeypatch, *sampling)
    assert TORCH_FREE_NOTE not in err3 and third["token_ids"] == first["token_ids"]


def test_header_figures_equal_the_engines(q_file, tmp_path, capsys, monkeypatch):
    """The saved config's fingerprint, the sizes the resolver splits, the host-memory check's need and the dense
    bytes a run holds: the torch-free engine's equal the Engine's (lean load) on the same file; its load names the
    dense tensors computed in place once."""
    ggml_or_skip()
    needs = []
    for mod in (ge, __import__("moectl.runtime.load", fromlist=["x"])):
        real = mod.check_host_memory
        monkeypatch.setattr(mod, "check_host_memory",
                            lambda need, what, fits, real=real: (needs.append((need, what)), real(need, what, fits))[1])
    eng = Engine.load(str(q_file), progress=False, threads=1, workdir=str(tmp_path), device="cpu")
    eng.tokenizer                                           # saved in the workdir, as generate does
    asked = []                                              # the header's dense names: one pass over it a load
    names = ge.dense_in_place_names
    monkeypatch.setattr(ge, "dense_in_place_names", lambda files: (asked.append(files), names(files))[1])
    fast, why = ge.GraphEngine.try_load(str(q_file), RuntimeOptions(threads=1, workdir=str(tmp_path), device="cpu"))
    assert why is None and fast is not None
    assert len(asked) == 1
    view = saved_config(tmp_path, eng.adapter.gguf.files.paths)
    assert view.model_type == eng.adapter.family             # view_fingerprint's family: its model_type
    assert view_fingerprint(view) == config_fingerprint(eng.config) == fast.fingerprint
    dt = eng.dtype
    want = checkpoint_sizes(eng.config, eng.adapter, dt, lean_dense_nbytes(eng.config, eng.adapter, dt),
                            len(eng.moe_layer_ids), path=q_file)
    assert fast.sizes == want
    assert needs[0] == needs[1]
    a = eng.generate(PROMPT, max_new_tokens=3, greedy=True)
    b = fast.generate(PROMPT, max_new_tokens=3, greedy=True)
    assert a.token_ids == b.token_ids and a.stats["device_held_bytes"] == b.stats["device_held_bytes"]
    assert fast.threads == eng.threads
    assert fast.plan_note == eng.plan_note.replace(LEAN_NOTE, TORCH_FREE_NOTE_TAIL)
    shared = "(attention, shared expert, lm_head, embedding)" in fast.plan_note     # Qwen2-MoE's shared expert
    assert shared == (eng.config.model_type == "qwen2_moe")


def test_a_fresh_process_imports_neither_torch_nor_transformers(q_file, tmp_path, capsys, monkeypatch):
    ggml_or_skip()
    first, _ = _generate(q_file, tmp_path, capsys, monkeypatch, "--greedy")
    code = ("import sys, json\nfrom moectl import cli\nsys.argv = %r\ntry:\n    cli.main()\nexcept SystemExit:\n"
            "    pass\nprint(json.dumps(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules)),"
            " file=sys.stderr)\n") % (["moectl", "generate", "--model", str(q_file), "--prompt", PROMPT, "-n", "6",
                                      "--threads", "1", "--device", "cpu", "--workdir", str(tmp_path), "--json",
                                      "--greedy"],)
    env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stderr.strip().splitlines()[-1]) == [], r.stderr
    assert TORCH_FREE_NOTE in r.stderr
    assert json.loads(r.stdout)["token_ids"] == first["token_ids"]


def test_runs_it_cannot_serve_say_why(q_file, tmp_path, capsys, monkeypatch):
    """No saved config yet, a rewritten file, low-bit copies, gating, a device cache, the switch: each a reason,
    and the command takes the Engine."""
    ggml_or_skip()
    q_file = Path(shutil.copy(q_file, tmp_path / "Q.gguf"))     # its own copy: this test rewrites its mtime

    def why(**kw):
        eng, reason = ge.GraphEngine.try_load(str(q_file), RuntimeOptions(threads=1, workdir=str(tmp_path),
                                                                         device="cpu", **kw))
        assert (eng is None) == (reason is not None)
        return reason

    assert "no config saved" in why()
    _generate(q_file, tmp_path, capsys, monkeypatch, "--greedy")
    assert why() is None
    assert "low-bit" in why(dense_lowbit="q8")
    assert "gating" in why(gating="adaptive")
    assert "device cache" in why(emulate_device=True)
    monkeypatch.setenv("MOECTL_TORCH_FREE", "0")
    assert "MOECTL_TORCH_FREE" in why()
    monkeypatch.delenv("MOECTL_TORCH_FREE")
    os.utime(q_file, ns=(os.stat(q_file).st_atime_ns, os.stat(q_file).st_mtime_ns + 10**9))   # "rewritten"
    assert "no config saved" in why()


def test_chat_runs_torch_free_with_the_engines_answers(q_file, tmp_path, capsys, monkeypatch):
    """`moectl chat` on a pipe: the same answers (greedy) from the Engine and, once the config is saved, from the
    torch-free engine; the session figures but the timings equal too."""
    ggml_or_skip()

    def chat():
        code, out, err = run_cli(["chat", "--model", str(q_file), "--greedy", "-n", "4", "--threads", "1",
                                  "--device", "cpu", "--workdir", str(tmp_path)], capsys, monkeypatch,
                                 stdin="Hello there\nAnd then?\n")
        assert code == 0, err
        return [ln for ln in out.splitlines() if "tok/s" not in ln], err

    first, err1 = chat()
    second, err2 = chat()
    assert TORCH_FREE_NOTE not in err1 and TORCH_FREE_NOTE in err2, err2
    assert second == first and len(first) >= 2


def test_the_bench_child_times_the_torch_free_engine(q_file, request):
    """bench/moectl_timed.py's torch-free child (what `bench/gguf_vs_llamacpp.py` times): its first `moectl
    generate` saves what it reads, then it loads, warms up, prefills and decodes with neither torch nor transformers
    and reports every field."""
    ggml_or_skip()
    if "qwen3_moe" not in request.node.callspec.id:
        pytest.skip("one family is enough for the bench's plumbing")
    sys.path.insert(0, str(ROOT / "bench"))
    import moectl_timed

    res = moectl_timed.moectl_run({"model": str(q_file)}, 1, 2, 2, 8, time_load=True, torch_free=True)
    assert res["kernels"]["torch_free"] and not res["kernels"]["torch_imported"] and res["decode_ms"] > 0 and res["prefill_tps"] > 0 and res["load_s"] > 0
    assert TORCH_FREE_NOTE in res["note"] and res["rss_gb"] > 0
    assert {"ggml", "ggml_features", "ggml_why_not", "moectl_avx512", "moectl_avx512_why_not"} <= set(res["kernels"])


def test_prompt_ids_is_one_rule_for_both_engines():
    """`generation.prompt_ids`, both engines' prompt: ids as a list, an array or a tensor (any shape) flattened to
    ints without asking for the tokenizer; text encoded by it (the chat template when asked); one clear error for
    no prompt, text that is not UTF-8 (before the tokenizer is loaded) or a prompt of no tokens."""
    import numpy as np
    import torch

    from moectl.errors import MoectlError
    from moectl.runtime.generation import prompt_ids

    def no_tokenizer():
        raise AssertionError("the tokenizer was asked for")

    for given in ([5, 6, 7], np.array([[5, 6, 7]]), torch.tensor([[5, 6, 7]])):
        assert prompt_ids(None, given, False, no_tokenizer) == [5, 6, 7]

    class Tok:                                   # what the engines ask of a tokenizer here
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [len(w) for w in text.split()]}

    assert prompt_ids("ab cde", None, False, Tok) == [2, 3]
    assert prompt_ids("ab", None, True, Tok) == [5, 2, 10]       # "User: ab\nAssistant:": no template, the fallback
    with pytest.raises(MoectlError, match="^generate needs a prompt or input_ids$"):
        prompt_ids(None, None, False, Tok)
    with pytest.raises(MoectlError, match="^the prompt encodes to no tokens$"):
        prompt_ids("", None, False, Tok)
    with pytest.raises(MoectlError, match="^the prompt is not UTF-8 text: byte 0xff at character 2"):
        prompt_ids("a\udcff", None, False, no_tokenizer)


def test_routed_counts_of_a_decode_step_are_the_sorted_counts():
    """routed_counts' decode-step shortcut (one row: its top-k are distinct experts, no sort) gives what counting
    distinct sorted ids gives; a prefill's rows (repeats across rows, unrouted -1 rows) still sort."""
    import numpy as np

    rng = np.random.default_rng(0)
    L, U, E = 5, 4, 16
    step = np.stack([rng.permutation(E)[:U] for _ in range(L)])[:, None, :].astype(np.int32)     # [L, 1, U]
    distinct, calls = ge.routed_counts(step, L)
    assert distinct.tolist() == [U] * L and calls == L * U
    prefill = np.stack([[rng.permutation(E)[:U] for _ in range(3)] for _ in range(L)]).astype(np.int32)  # [L, 3, U]
    prefill[-1, :2] = -1                                     # the last layer keeps one row
    distinct, calls = ge.routed_counts(prefill, L)
    assert distinct.tolist() == [len(set(prefill[l][prefill[l] >= 0].tolist())) for l in range(L)]
    assert calls == int((prefill >= 0).sum())


def test_token_sink_is_one_rule_for_both_engines():
    """`TokenSink.for_generate`, both engines' sink: done at the config's and the tokenizer's EOS ids (an int or a
    list), at none with stop_at_eos False, else at max_new tokens."""
    from types import SimpleNamespace

    from moectl.runtime.generation import TokenSink

    config, tokenizer = SimpleNamespace(eos_token_id=[2, 7]), SimpleNamespace(eos_token_id=9)
    sink = TokenSink.for_generate(config, tokenizer, 5, True)
    assert sink.eos == {2, 7, 9} and sink.emit(9) and sink.tokens == [9]
    sink = TokenSink.for_generate(config, tokenizer, 2, False)
    assert sink.eos == set() and not sink.emit(9) and sink.emit(2) and sink.tokens == [9, 2]


def test_the_mapped_dense_note_names_what_is_mapped():
    """The note on the dense matrices computed in place names the kinds the file's GGUF names are: Mixtral's
    attention, lm_head and embedding; Qwen2-MoE's shared expert too; a tied lm_head (one matrix more than names,
    no output.weight) still named; DeepSeek's dense layers' FFN."""
    layer = {f"blk.0.attn_{p}.weight" for p in ("q", "k", "v", "output")}
    mixtral = frozenset(layer | {"output.weight", "token_embd.weight"})
    assert "(attention, lm_head, embedding)" in ge.mapped_dense_note(mixtral, 6)
    qwen2 = mixtral | {f"blk.0.ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}
    assert "9 dense matrices (attention, shared expert, lm_head, embedding)" in ge.mapped_dense_note(qwen2, 9)
    tied = mixtral - {"output.weight"}
    assert "6 dense matrices (attention, lm_head, embedding)" in ge.mapped_dense_note(tied, 6)
    assert "(attention, embedding)" in ge.mapped_dense_note(tied, 5)
    deepseek = mixtral | {"blk.0.ffn_gate.weight"}
    assert "(attention, dense FFN, lm_head, embedding)" in ge.mapped_dense_note(deepseek, 7)
