"""Shared pytest fixtures. Append yours below; keep session fixtures cheap or cached."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# bench/llamacpp.py (the llama.cpp harness of the bench scripts) is imported by the llama.cpp tests as `llamacpp`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# ggml's CPU backend (moectl/kernels/ggml.py) is built once, into the user's MOECTL_HOME: tests that switch to a
# private MOECTL_HOME find it there instead of rebuilding it (minutes)
from moectl.kernels.ggml import llamacpp_home  # noqa: E402

os.environ.setdefault("MOECTL_GGML_ROOT", str(llamacpp_home()))
# and never prunes it: checkouts whose patch or shim differ share that build folder, and a build by one would remove
# the others' (ggml.remove_stale; tests/test_ggml_build_cache.py turns it on for its fake cache)
os.environ.setdefault("MOECTL_GGML_PRUNE", "0")
# Everything else a test writes under MOECTL_HOME (a path model's workdir, corpus caches) goes to a private home,
# removed at exit: tests make models named "ck", "Q", ... in temporary directories, and each run left `ck-<hex>`
# workdirs in the user's home (core/model_workdir.py: a name another source claims gets a suffix). The suite thus
# runs as CI's does, from an empty home, with the ggml and llama.cpp builds found through MOECTL_GGML_ROOT.
_TEST_HOME = tempfile.mkdtemp(prefix="moectl-test-home-")
os.environ["MOECTL_HOME"] = _TEST_HOME
atexit.register(shutil.rmtree, _TEST_HOME, True)

import torch  # noqa: E402

# Triton kernels (moectl/kernels/triton_lowbit.py) run under Triton's interpreter where no GPU is: their CPU twins.
# The variable is read when a kernel is decorated (module import), so it is set before any moectl import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models are dispatch-bound: one intra-op thread is faster, and far faster on a busy 2-core machine.
torch.set_num_threads(1)


def pytest_report_header(config):
    """Which trained tiny model and which torch kernels this run used (the suite must pass with any of them)."""
    from moectl.synth.tiny import SEED_ENV, default_seed

    return (f"moectl: tiny models trained with seed {default_seed()} (${SEED_ENV}), torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')})")


@pytest.fixture(scope="session")
def tiny_small(tmp_path_factory) -> Path:
    """Checkpoint dir of the small trained tiny Mixtral (built once per session, ~15-40 s), trained with seed
    $MOECTL_TINY_SEED (default 0): tests must hold for any competently trained model, not this run's text or routing.

    Its workdir (with tiny.json) is the parent directory; the corpus cache lives in a private MOECTL_HOME
    (`<tmp>/home`, also available as `tiny_small.parent.parent / "home"`)."""
    from moectl.synth.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny_small")
    old = os.environ.get("MOECTL_HOME")
    os.environ["MOECTL_HOME"] = str(root / "home")
    try:
        return build_tiny(root / "tiny", small=True, progress=False)
    finally:
        if old is None:
            os.environ.pop("MOECTL_HOME", None)
        else:
            os.environ["MOECTL_HOME"] = old


@pytest.fixture
def cli():
    """`moectl ARGS` in this process through typer's test runner: `cli(args, env=None)` -> click's Result
    (exit_code, stdout, output, exception). For the console script's own error handling (one `error:` line, exit
    code 2) use test_bad_input.run_cli, which goes through `moectl.cli.main`."""
    from typer.testing import CliRunner

    from moectl.cli import app

    runner = CliRunner()
    return lambda args, env=None: runner.invoke(app, [str(a) for a in args], env=env)


@pytest.fixture(scope="module")
def random_mixtral(tmp_path_factory) -> Path:
    """A random 4-layer Mixtral (8 experts, top-2: L, E, K = 4, 8, 2) with a tokenizer; one per test module (the
    tests write artifacts into its directory)."""
    from model_factory import build_family, save_tokenizer

    out = tmp_path_factory.mktemp("mixtral")
    build_family("mixtral", out)
    save_tokenizer(out)
    return out
