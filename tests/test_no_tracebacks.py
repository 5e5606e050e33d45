"""Tracebacks a new user hit (issue 45), each now one `error:` line (exit code 2), checked before the work it would
spoil; and two leftovers of issue 46: `--model tiny` honours $MOECTL_TINY_SEED when a checkpoint is already there,
and the built-in corpus is the same text whichever process builds it.

A read-only directory is made by a path under a regular file (ENOTDIR), which fails for root too (root ignores
permission bits); where the order of two steps is the point, the check is replaced by one that fails.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input import assert_one_error, run_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def a_file(tmp_path) -> Path:
    """A regular file: every path under it is a directory no one, root included, can make."""
    f = tmp_path / "a-file"
    f.write_text("not a directory\n")
    return f


def the_error(code: int, err: str) -> str:
    """The one `error:` line of a failed run (status lines before it are fine; a traceback is not)."""
    assert code == 2 and "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


# --- text that is not UTF-8 ---------------------------------------------------------------------------------------
def test_chat_input_that_is_not_utf8_is_one_error(random_mixtral, capsys, monkeypatch):
    # stdin as Python opens it on a pipe: undecodable bytes become lone surrogates (surrogateescape)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi \xff\xfe there\n"), encoding="utf-8",
                                                       errors="surrogateescape"))
    code, out, err = run_cli(["chat", "--model", str(random_mixtral), "-n", "2", "--device", "cpu"], capsys,
                             monkeypatch)
    assert the_error(code, err) == "error: input line 1 is not UTF-8 text: byte 0xff at character 4; convert it to " \
                                   "UTF-8 first"


def test_a_prompt_that_is_not_utf8_is_one_error_before_loading(random_mixtral, capsys, monkeypatch):
    import moectl.runtime.engine as engine

    monkeypatch.setattr(engine.Engine, "load", classmethod(lambda *a, **kw: pytest.fail("loaded")))
    code, out, err = run_cli(["generate", "--model", str(random_mixtral), "-p", "caf\udce9"], capsys, monkeypatch)
    assert_one_error(code, err, "--prompt is not UTF-8 text: byte 0xe9 at character 4")


def test_a_chat_session_refuses_the_message_and_keeps_its_history(random_mixtral, monkeypatch):
    from rich.console import Console

    import moectl.serve.chat as chat
    from moectl.errors import MoectlError
    from moectl.runtime.engine import Engine

    session = chat.ChatSession(Engine.load(str(random_mixtral), progress=False), max_new_tokens=2)
    with pytest.raises(MoectlError, match="the message is not UTF-8 text: byte 0xff at character 1"):
        session.ask("\udcff")
    assert session.messages == []
    # at a terminal the message is refused on one line and the chat goes on
    monkeypatch.setattr(chat, "_read_lines", lambda *a: iter(["ok \udcfe", "/exit"]))
    screen = io.StringIO()
    assert chat.run_chat(session, console=Console(file=screen, width=200), interactive=True) == 0
    said = [ln for ln in screen.getvalue().splitlines() if ln.startswith("error:")]
    assert said == ["error: the message is not UTF-8 text: byte 0xfe at character 4; convert it to UTF-8 first"]
    assert session.messages == []


# --- trace import of a binary file --------------------------------------------------------------------------------
@pytest.mark.parametrize("content, needle", [
    (b"GGUF\x03\x00\x00\x00" + bytes(range(128, 256)), "model.gguf:1: a GGUF model file, not a moe-routing-v1 JSONL "
                                                       "trace; `moectl profile --model"),
    (b'{"format": "moe-routing-v1"}\n\x89PNG', "model.gguf:2: not UTF-8 text (byte 0x89), not a moe-routing-v1"),
])
def test_trace_import_of_a_binary_file_is_one_error(tmp_path, capsys, monkeypatch, content, needle):
    f = tmp_path / "model.gguf"
    f.write_bytes(content)
    code, _, err = run_cli(["trace", "import", str(f), "--model-name", "x", "--out", str(tmp_path / "t")], capsys,
                           monkeypatch)
    assert_one_error(code, err, needle)
    assert not (tmp_path / "t").exists()


# --- report --out naming a file -------------------------------------------------------------------------------------
def test_report_out_naming_a_file_is_one_error_before_the_work(tmp_path, capsys, monkeypatch):
    import moectl.calib.report as report

    from test_bad_input import HEADER, GOOD, _jsonl

    trace = _jsonl(tmp_path / "t.jsonl", HEADER, GOOD)
    out = tmp_path / "report.png"
    out.write_bytes(b"an old plot")
    monkeypatch.setattr(report, "analyze", lambda *a, **kw: pytest.fail("analysed before --out was checked"))
    code, _, err = run_cli(["report", "--traces", trace, "--out", str(out)], capsys, monkeypatch)
    assert_one_error(code, err, f"--out {out} is a file, not a directory")
    assert out.read_bytes() == b"an old plot"


def test_report_out_that_cannot_be_made_is_one_error(tmp_path, a_file, capsys, monkeypatch):
    from test_bad_input import HEADER, GOOD, _jsonl

    trace = _jsonl(tmp_path / "t.jsonl", HEADER, GOOD)
    code, _, err = run_cli(["report", "--traces", trace, "--out", str(a_file / "plots")], capsys, monkeypatch)
    assert_one_error(code, err, f"cannot write to --out {a_file / 'plots'}: Not a directory")


# --- a workdir or MOECTL_HOME that cannot be written ---------------------------------------------------------------
@pytest.mark.parametrize("command, extra, what", [
    ("sensitivity", ["--device", "cpu"], "the workdir"),
    ("quantize", ["--device", "cpu"], "the workdir"),
    ("profile", ["--device", "cpu", "--dataset", "builtin"], "the trace directory"),
])
def test_a_workdir_that_cannot_be_written_is_one_error_before_the_work(random_mixtral, a_file, capsys, monkeypatch,
                                                                       command, extra, what):
    import moectl.runtime.engine as engine

    monkeypatch.setattr(engine.Engine, "load", classmethod(lambda *a, **kw: pytest.fail("loaded")))
    workdir = a_file / "wd"
    code, _, err = run_cli([command, "--model", str(random_mixtral), "--workdir", str(workdir), *extra], capsys,
                           monkeypatch)
    assert_one_error(code, err, f"cannot write to {what} {workdir}", ": Not a directory", "--workdir")


def test_moectl_home_that_cannot_be_written_is_one_error(a_file, capsys, monkeypatch):
    monkeypatch.setenv("MOECTL_HOME", str(a_file / "home"))
    code, _, err = run_cli(["generate", "--model", "tiny", "-p", "hi"], capsys, monkeypatch)
    assert_one_error(code, err, f"cannot write to the workdir {a_file / 'home' / 'tiny'}: Not a directory",
                     "set MOECTL_HOME to one")


def test_profile_deletes_no_old_trace_before_it_can_write(tmp_path, monkeypatch):
    import moectl.artifacts.trace_dir as trace_dir
    from moectl.errors import MoectlError

    old = tmp_path / "traces"
    old.mkdir()
    shard = old / "shard-00000.safetensors"
    shard.write_bytes(b"an old shard")
    (old / "meta.json").write_text("{}")

    def refused(path, what):
        raise MoectlError(f"cannot write to {what} {path}: Read-only file system")

    monkeypatch.setattr(trace_dir, "writable_dir", refused)
    with pytest.raises(MoectlError, match="Read-only file system"):
        trace_dir.TraceWriter(old, {"model": "m"})
    assert shard.read_bytes() == b"an old shard" and (old / "meta.json").exists()


def test_a_refused_write_no_command_checked_is_still_one_line(tmp_path, capsys, monkeypatch):
    import moectl.store.facts as facts

    home = tmp_path / "home"
    monkeypatch.setenv("MOECTL_HOME", str(home))

    def read_only(*a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(home / "m" / "x.json"))

    monkeypatch.setattr(facts, "inspect_model", read_only)
    code, _, err = run_cli(["inspect", "--model", str(tmp_path), "--device", "cpu"], capsys, monkeypatch)
    assert_one_error(code, err, f"{home / 'm' / 'x.json'}: Read-only file system (under MOECTL_HOME",
                     "set MOECTL_HOME or --workdir to a writable directory")


# --- issue 46's leftovers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("built_seed, env_seed, rebuilt", [(5, "6", True), (5, "5", False), (0, None, False)])
def test_model_tiny_honours_the_seed_with_a_checkpoint_there(tmp_path, monkeypatch, built_seed, env_seed, rebuilt):
    import moectl.synth.tiny as tiny
    from moectl.commands._common import prepare_model

    wd = tmp_path / "tiny"
    (wd / "checkpoint").mkdir(parents=True)
    (wd / "checkpoint" / "config.json").write_text("{}")
    (wd / "tiny.json").write_text(json.dumps({"format": tiny.TINY_FORMAT, "seed": built_seed}))
    if env_seed is None:
        monkeypatch.delenv(tiny.SEED_ENV, raising=False)
    else:
        monkeypatch.setenv(tiny.SEED_ENV, env_seed)
    builds = []
    monkeypatch.setattr(tiny, "_build", lambda workdir, size, steps, progress, seed, stop_after:
                        builds.append((Path(workdir), size, seed)) or Path(workdir) / "checkpoint")
    prepare_model("tiny", wd)
    assert builds == ([(wd, "tiny", int(env_seed))] if rebuilt else [])


def test_builtin_corpus_is_the_same_text_in_any_process(tmp_path):
    import logging
    import pydoc

    from moectl.calib.builtin_corpus import build_builtin_corpus

    class ProcessStateHandler(logging.Handler):
        pass

    handler = ProcessStateHandler()          # in logging's handler list: pydoc shows it in `shutdown`'s default
    assert "ProcessStateHandler" in pydoc.render_doc(logging, renderer=pydoc.plaintext)     # the hazard, here
    modules = ("argparse", "logging", "threading")            # the modules whose text pytest's state changed
    build_builtin_corpus(tmp_path / "here", modules=modules)
    code = ("import sys; from pathlib import Path; from moectl.calib.builtin_corpus import build_builtin_corpus; "
            f"build_builtin_corpus(Path(sys.argv[1]), modules={modules!r})")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "fresh")], check=True, cwd=tmp_path,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    for name in ("train.jsonl", "validation.jsonl"):
        here = (tmp_path / "here" / name).read_text()
        assert here == (tmp_path / "fresh" / name).read_text(), name
        assert "ProcessStateHandler" not in here and "LogCaptureHandler" not in here
    meta = json.loads((tmp_path / "here" / "meta.json").read_text())
    assert meta["modules"] == list(modules) and not meta["missing_modules"]
    del handler


def test_builtin_corpus_on_a_home_that_cannot_be_written_is_built_for_the_process(a_file, monkeypatch):
    import moectl.calib.builtin_corpus as corpus

    monkeypatch.setenv("MOECTL_HOME", str(a_file / "home"))
    monkeypatch.setattr(corpus, "_PROCESS_DIR", [])
    text = "Json\n    json - JSON encoder and decoder.\n\n" + "\n\n".join(f"Paragraph {i}. " * 30 for i in range(40))
    monkeypatch.setattr(corpus, "render_pydoc", lambda modules: {"json": text})         # one module, fast
    docs = corpus.builtin_corpus("train") + corpus.builtin_corpus("validation")
    assert len(docs) > 1 and "Paragraph 39." in "".join(docs)
    assert corpus._PROCESS_DIR[0].is_dir() and not (a_file / "home").exists()
