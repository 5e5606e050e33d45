"""moectl chat: piped stdin answers, /stats, /reset, /exit; multi-turn prompts use the chat template."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from moectl.serve.chat import ChatSession, run_chat


def test_chat_subprocess_piped_stdin(tiny_small, tmp_path):
    env = dict(os.environ, MOECTL_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", "moectl.cli", "chat", "--model", str(tiny_small), "--cache-experts", "6",
         "--max-new-tokens", "16", "--greedy"],
        input="hello\nWhat does bisect_left do?\n/stats\n/exit\nnever read\n", capture_output=True, text=True,
        env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    status_lines = [line for line in out.splitlines() if "tok/s" in line and "cache hit rate" in line]
    assert len(status_lines) == 2                          # one status line per answer
    assert "loaded" in status_lines[0]
    answer = out.split(status_lines[0])[0].strip()
    assert answer                                          # the model said something before the status line
    assert "session stats" in out and "turns" in out and "tokens generated" in out
    assert "Traceback" not in proc.stderr


class FakeTokenizer:
    """Characters as tokens; optional ChatML template."""
    chat_template = "chatml"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [ord(c) for c in text]

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    @staticmethod
    def text(ids):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    def __init__(self, context=4096):
        self.tokenizer = FakeTokenizer()
        self.config = SimpleNamespace(max_position_embeddings=context)
        self.cache = SimpleNamespace(slots_per_layer=[2, 2])
        self.ref = SimpleNamespace(name="fake")
        self.prompts = []

    def generate(self, input_ids, max_new_tokens, greedy, temperature, top_p, seed, on_token):
        self.prompts.append(FakeTokenizer.text(input_ids))
        answer = f"answer{len(self.prompts)}"
        for ch in answer:
            on_token(ord(ch), ch)
        stats = dict(tokens=len(answer), seconds=0.5, tokens_per_s=len(answer) / 0.5, hits=3, misses=1,
                     hit_rate=0.75, bytes_loaded=1000, bytes_per_token=1000 / len(answer), load_wait_s=0.001)
        return SimpleNamespace(text=answer, token_ids=[ord(c) for c in answer], stats=stats)


def _run(engine, lines, **kw):
    out = io.StringIO()
    session = ChatSession(engine, max_new_tokens=8, **kw)
    code = run_chat(session, console=Console(file=out, width=200), stdin=io.StringIO(lines), interactive=False)
    return code, out.getvalue(), session


def test_multi_turn_reset_and_commands():
    eng = FakeEngine()
    code, out, session = _run(eng, "first\n\nsecond\n/stats\n/reset\nthird\n/bogus\n")    # EOF ends the loop
    assert code == 0
    assert eng.prompts == [
        "<user>first<assistant>",
        "<user>first<assistant>answer1<user>second<assistant>",      # the conversation is kept
        "<user>third<assistant>",                                      # ... until /reset
    ]
    assert "answer1\n" in out and "answer3\n" in out
    assert out.count("cache hit rate") == 3 + 1                        # 3 status lines + the /stats table
    assert "conversation reset" in out and "unknown command /bogus" in out
    t = session.totals.as_dict()
    assert t["turns"] == 3 and t["tokens"] == 21 and t["hit_rate"] == pytest.approx(0.75)
    assert t["bytes_loaded"] == 3000


def test_exit_stops_reading_and_system_message_survives_reset():
    eng = FakeEngine()
    code, out, session = _run(eng, "a\n/reset\nb\n/exit\nc\n", system="be brief")
    assert code == 0
    assert eng.prompts == ["<system>be brief<user>a<assistant>", "<system>be brief<user>b<assistant>"]


def test_old_turns_dropped_when_context_is_full():
    eng = FakeEngine(context=60)
    _run(eng, "one\ntwo\nthree\n")
    assert all(len(p) + 8 <= 60 for p in eng.prompts)
    assert eng.prompts[-1].startswith("<user>t") and "one" not in eng.prompts[-1]


def test_plain_fallback_without_template(tiny_small):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_small)
    tok.chat_template = None
    eng = FakeEngine()
    eng.tokenizer = tok
    session = ChatSession(eng)
    session.messages = [{"role": "user", "content": "hi"}]
    assert tok.decode(session.prompt_ids()) == "User: hi\nAssistant:"


def test_demo_runs_steps_skips_missing_and_reports_failures(cli, tiny_small, tmp_path, monkeypatch):
    """The demo on the (small) tiny build: a real step, a missing one, a failing one, then chat and the summary."""
    import shutil

    from moectl.commands import demo

    workdir = tmp_path / "tiny"
    shutil.copytree(tiny_small.parent, workdir)                     # reuse the session build (tiny.json is there)
    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(demo, "PIPELINE", [
        demo.Step("profile", ["--dataset", "default", "--max-samples", "2", "--max-tokens", "32", "--device", "cpu"],
                  ["traces"]),
        demo.Step("no-such-command", [], ["nothing"]),
        demo.Step("generate", ["--prompt", "x", "--bogus-flag"], []),   # exists, but this call fails
    ])
    result = cli(["demo", "--workdir", str(workdir), "--question", "hello"],
            env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output             # the failed step fails the demo, after the summary
    out = result.output
    assert "demo: generate failed" in out
    assert (workdir / "traces").is_dir()
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") >= 4}
    assert "reused" in rows["build-tiny"] and "val ppl" in rows["build-tiny"]
    assert "ok" in rows["profile"] and "traces (" in rows["profile"]
    assert "skipped" in rows["no-such-command"]
    assert "failed" in rows["generate"] and "bogus" in rows["generate"]
    assert "ok" in rows["chat"] and "hit rate" in rows["chat"]
    import re

    slots = re.search(r"with (\d+)(?: \+ (\d+) low-bit)? expert slots", rows["chat"])  # every pool's slots
    assert slots and int(slots.group(1)) + int(slots.group(2) or 0) > 0
    assert "you> hello" in out and "cache hit rate" in out
