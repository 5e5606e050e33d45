"""How the `moectl` script and `python -m moectl` end (moectl/cli.py: `run`, `exit_now`): the exit status `main()`
gives, the atexit handlers run and stdout flushed, but the interpreter's teardown of its heap skipped (seconds after
a model's load); a live thread that is not moectl's own still waited for. Each check runs in a fresh interpreter:
`exit_now` ends the process it runs in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# An object whose finaliser prints: the interpreter's teardown runs it at a normal exit, exit_now does not.
PRELUDE = r"""
import atexit, sys, threading, time
from moectl.cli import exit_now
class Torn:
    def __del__(self):
        print("torn down", flush=True)
kept = Torn()
atexit.register(lambda: print("atexit ran"))
print("answer", end="")                         # unflushed when exit_now is called
"""


def child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_exit_now_runs_atexit_flushes_and_skips_teardown():
    p = child("exit_now(3)")
    assert p.returncode == 3
    assert p.stdout == "answeratexit ran\n"     # flushed; atexit ran; no "torn down"


def test_exit_now_status_as_sys_exit():
    assert child("exit_now(None)").returncode == 0
    p = child("exit_now('bad thing')")
    assert p.returncode == 1 and p.stderr == "bad thing\n"


def test_exit_now_waits_for_a_foreign_thread_as_python_does():
    """A live non-daemon thread (not one of moectl's pools) may be writing: the normal exit, which waits for it."""
    p = child("t = threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True)))\n"
              "t.start()\nexit_now(4)")
    assert p.returncode == 4
    assert "thread done" in p.stdout and "atexit ran" in p.stdout and "torn down" in p.stdout


def test_exit_now_does_not_wait_for_moectl_pools():
    """moectl's read / CPU-expert pool workers (idle, or reading) are ended with the process."""
    p = child("from concurrent.futures import ThreadPoolExecutor\n"
              "pool = ThreadPoolExecutor(1, thread_name_prefix='moectl-reader')\n"
              "pool.submit(lambda: None).result()\nexit_now(0)")
    assert p.returncode == 0 and p.stdout == "answeratexit ran\n"


def test_script_entry_exits_with_mains_status():
    """`python -m moectl` goes through run(): a bad input is still one `error:` line and exit status 2."""
    p = subprocess.run([sys.executable, "-m", "moectl", "inspect", str(ROOT / "no-such-model.gguf")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.startswith("error:") and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "moectl", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "Usage" in p.stdout
