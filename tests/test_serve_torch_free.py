"""`moectl serve` on a GGUF the one ggml graph serves: the torch-free engine (runtime/graph_engine.py), as `generate`
and `chat` take it. A fresh `moectl serve` process answers a greedy completion with `moectl generate --greedy`'s text
and imports neither torch nor transformers; its startup lines name the engine; streaming, /api/state and /metrics
work and give the torch engine's counters on the same requests (in place: every routed expert a hit, nothing
loaded; its per-layer counts are the torch engine's); the first run of a file (no saved config) and MOECTL_TORCH_FREE=0 take `Engine`."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="moectl[serve] is not installed")
import httpx  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serve_helpers import MODEL, cli_server, sse_events  # noqa: E402

from gguf_build import write_gguf  # noqa: E402
from test_bad_input import run_cli  # noqa: E402
from test_ggml_graph import _checkpoint  # noqa: E402
from test_gguf_run import ggml_or_skip  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
N = 8                                                        # tokens a completion asks for
TORCH_FREE_NOTE = "torch-free run"                           # the load's note (`generate`'s too)
SERVING_TAG = "torch-free engine"                            # serve's "serving ... on URL (...)" line


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    """A tiny Mixtral as a Q8_0 dense + Q4_0 experts GGUF."""
    root = tmp_path_factory.mktemp("serve_torch_free")
    return write_gguf(_checkpoint("mixtral", root), root / "Q.gguf", dense_encoding=T.Q8_0, expert_encoding=T.Q4_0)


@pytest.fixture(scope="module")
def primed(gguf_file, tmp_path_factory) -> tuple[Path, dict]:
    """(a workdir where a first `moectl generate` saved the config and tokenizer, the second run's --json: torch-free,
    greedy, N tokens of PROMPT)."""
    ggml_or_skip()
    workdir = tmp_path_factory.mktemp("serve_torch_free_wd")
    args = ["generate", "--model", str(gguf_file), "--prompt", PROMPT, "-n", str(N), "--threads", "1", "--device",
            "cpu", "--workdir", str(workdir), "--json", "--greedy"]
    env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs = [subprocess.run([sys.executable, "-m", "moectl.cli", *args], capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert TORCH_FREE_NOTE not in runs[0].stderr and TORCH_FREE_NOTE in runs[1].stderr, runs[1].stderr
    return workdir, json.loads(runs[1].stdout)


# The server process: `moectl serve` in its main thread; a helper thread asks it for a greedy completion, a streamed
# chat, /api/state and /metrics (stdlib HTTP: the helper imports nothing that could pull torch in), records which of
# torch, transformers and accelerate the process has imported, and stops the server (SIGINT: uvicorn's shutdown).
SERVER_PROCESS = r'''
import json, os, signal, socket, sys, threading, time, urllib.request
from moectl import cli

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
url = f"http://127.0.0.1:{port}"

def post(path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()

def ask():
    out = {}
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)
        out["completion"] = json.loads(post("/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": N,
                                                                 "temperature": 0}))
        out["stream"] = post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 4, "temperature": 0, "stream": True})
        out["state"] = json.loads(urllib.request.urlopen(url + "/api/state", timeout=30).read())
        out["metrics"] = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    except Exception as e:
        out["error"] = repr(e)
    out["imported"] = sorted(m for m in ("torch", "transformers", "accelerate") if m in sys.modules)
    with open(RESULT, "w") as f:
        json.dump(out, f)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=ask, daemon=True).start()
sys.argv = ["moectl", "serve", "--model", MODEL_PATH, "--workdir", WORKDIR, "--port", str(port), "--threads", "1",
            "--device", "cpu", "--served-model-name", "m"]
try:
    cli.main()
except SystemExit:
    pass
'''


def test_a_fresh_serve_process_is_torch_free_and_answers_generates_text(gguf_file, primed, tmp_path):
    workdir, generated = primed
    result = tmp_path / "result.json"
    code = (f"PROMPT, N, RESULT, MODEL_PATH, WORKDIR = {PROMPT!r}, {N}, {str(result)!r}, {str(gguf_file)!r}, "
            f"{str(workdir)!r}\n" + SERVER_PROCESS)
    env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "250"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(result.read_text())
    assert "error" not in out, out.get("error")
    assert out["imported"] == [], r.stderr
    assert TORCH_FREE_NOTE in r.stderr                                     # the load's note, as generate's
    serving = [ln for ln in r.stdout.splitlines() if ln.startswith("serving m on ")]
    assert len(serving) == 1 and SERVING_TAG in serving[0], r.stdout
    completion = out["completion"]
    assert completion["choices"][0]["text"] == generated["text"]
    assert completion["usage"]["completion_tokens"] == len(generated["token_ids"])
    events = [json.loads(ln[6:]) for ln in out["stream"].splitlines() if ln.startswith("data: {")]
    assert out["stream"].rstrip().endswith("data: [DONE]") and events[-1]["choices"][0]["finish_reason"]
    state = out["state"]
    assert state["engine"] == "torch-free" and state["in_place"] is True and state["requests"] == 2
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(out["metrics"]) for s in fam.samples}
    assert samples[("moectl_engine_info", (("cache", "in place"), ("engine", "torch-free")))] == 1
    assert samples[("moectl_cache_hits_total", ())] == state["hits"] > 0


@pytest.fixture(scope="module")
def engines(gguf_file, primed):
    """(the torch engine, the torch-free engine) of the same file and options."""
    from moectl.runtime.engine import Engine
    from moectl.runtime.graph_engine import GraphEngine
    from moectl.setting.options import RuntimeOptions

    workdir, _ = primed
    torch_engine = Engine.load(str(gguf_file), progress=False, threads=1, workdir=str(workdir), device="cpu")
    fast, why = GraphEngine.try_load(str(gguf_file), RuntimeOptions(threads=1, workdir=str(workdir), device="cpu"))
    assert why is None, why
    return torch_engine, fast


def serve_requests(engine) -> tuple[dict, list[str], dict, dict, str]:
    """The app of `engine` (TestClient): a greedy chat answer, the same chat streamed (its pieces), then
    /api/state and /metrics' samples, and the page."""
    from fastapi.testclient import TestClient

    from moectl.serve.app import create_app

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "temperature": 0}
    with TestClient(create_app(engine, MODEL)) as client:
        whole = client.post("/v1/chat/completions", json=chat)
        assert whole.status_code == 200, whole.text
        with client.stream("POST", "/v1/chat/completions", json=chat | {"stream": True}) as r:
            assert r.status_code == 200
            pieces = [e["choices"][0]["delta"].get("content", "") for e in sse_events(r)]
        state = client.get("/api/state").json()
        text = client.get("/metrics").text
        page = client.get("/")
        assert page.status_code == 200 and "cache-panel" in page.text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    return whole.json(), pieces, state, samples, page.text


def test_streaming_state_and_metrics_match_the_torch_engine(engines):
    """The same requests to either engine's app: the same answers, streamed piece by piece; the same totals on
    /api/state and /metrics (in place: each routed expert a hit, no miss, nothing loaded); the state names the
    engine; the torch-free engine's layers hold every expert in the file's encoding and count no layer apart."""
    torch_engine, fast = engines
    slow = serve_requests(torch_engine)
    quick = serve_requests(fast)
    for (whole, pieces, state, samples, _page), name in ((slow, "torch"), (quick, "torch-free")):
        answer = whole["choices"][0]["message"]["content"]
        assert "".join(pieces) == answer and len([p for p in pieces if p]) >= 1
        assert state["engine"] == name and state["in_place"] is True
        assert samples[("moectl_engine_info", (("cache", "in place"), ("engine", name)))] == 1
        assert state["misses"] == 0 and state["bytes_loaded"] == 0 and state["hit_rate"] == 1.0
        assert samples[("moectl_cache_hits_total", ())] == state["hits"]
    assert quick[0]["choices"][0]["message"] == slow[0]["choices"][0]["message"]
    assert quick[0]["usage"] == slow[0]["usage"]
    assert quick[1] == slow[1]                                           # the same pieces
    for key in ("hits", "misses", "bytes_loaded", "generated_tokens", "prompt_tokens", "requests", "experts",
                "expert_bytes", "prefetches", "prefetch_used", "context", "step"):
        assert quick[2][key] == slow[2][key], key
    assert quick[2]["request"] == slow[2]["request"]                     # the last request's hits and bytes
    E, layers = fast.graph.n_expert, quick[2]["layers"]
    assert len(layers) == fast.n_layer == len(slow[2]["layers"])
    for row, torch_row in zip(layers, slow[2]["layers"]):
        assert row["resident"] == torch_row["resident"] == {str(e): "gguf-Q4_0" for e in range(E)}
        assert row["slots"] == torch_row["slots"] == E
        assert row["hits"] == torch_row["hits"] > 0 and row["misses"] == torch_row["misses"] == 0
        assert row["hit_rate"] == torch_row["hit_rate"] == 1.0
    assert sum(r["hits"] for r in slow[2]["layers"]) == quick[2]["hits"]
    for samples in (quick[3], slow[3]):
        assert len([k for k in samples if k[0] == "moectl_layer_hit_rate"]) == fast.n_layer


def test_the_first_run_and_the_switch_take_the_torch_engine(gguf_file, primed, tmp_path, monkeypatch):
    """A fresh workdir (no config saved yet) and MOECTL_TORCH_FREE=0 serve through `Engine`: no torch-free note or
    tag, the state says torch, and the greedy completion is `moectl generate --greedy`'s text all the same."""
    workdir, generated = primed
    for where, switch in ((tmp_path / "fresh", None), (workdir, "0")):
        if switch is not None:
            monkeypatch.setenv("MOECTL_TORCH_FREE", switch)
        with cli_server(gguf_file, tmp_path, "--workdir", str(where), "--device", "cpu") as live:
            r = httpx.post(live.url + "/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": N, "temperature": 0})
            state = httpx.get(live.url + "/api/state").json()
            log = live.log.read_text()
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == generated["text"]
        assert state["engine"] == "torch" and state["in_place"] is True
        assert TORCH_FREE_NOTE not in log and SERVING_TAG not in log, log


def test_serve_help_says_when_it_runs_torch_free(capsys, monkeypatch):
    code, out, _ = run_cli(["serve", "--help"], capsys, monkeypatch)
    assert code == 0 and "torch-free" in out and "MOECTL_TORCH_FREE=0" in out


def fresh_engines(path: Path, workdir: Path) -> tuple:
    """(the torch engine, the torch-free engine) of a file no run has saved a config for: the torch engine's load
    saves it, its tokenizer (built) saves that, then the torch-free engine loads."""
    from moectl.runtime.engine import Engine
    from moectl.runtime.graph_engine import GraphEngine
    from moectl.setting.options import RuntimeOptions

    torch_engine = Engine.load(str(path), progress=False, threads=1, workdir=str(workdir), device="cpu")
    assert torch_engine.tokenizer is not None
    fast, why = GraphEngine.try_load(str(path), RuntimeOptions(threads=1, workdir=str(workdir), device="cpu"))
    assert why is None, why
    return torch_engine, fast


def test_each_layer_shows_its_own_encoding_on_both_engines(tmp_path):
    """A file whose layers differ in encoding (a Q4_K_M-like mix: even layers Q8_0, odd ones Q4_0 with their down
    projection Q8_0): both engines' /api/state name each layer's experts by that layer's own encodings."""
    ggml_or_skip()
    path = write_gguf(_checkpoint("mixtral", tmp_path), tmp_path / "mixed.gguf", dense_encoding=T.Q8_0,
                      expert_encoding=lambda layer, proj: T.Q8_0 if layer % 2 == 0 or proj == "down" else T.Q4_0)
    torch_engine, fast = fresh_engines(path, tmp_path / "wd")
    # gate, up, down's encodings in order, duplicates dropped
    want = ["gguf-Q8_0" if layer % 2 == 0 else "gguf-Q4_0+Q8_0" for layer in range(fast.n_layer)]
    for engine in (torch_engine, fast):
        layers = serve_requests(engine)[2]["layers"]
        E = engine.cache.store.num_experts
        assert [row["resident"] for row in layers] == [{str(e): name for e in range(E)} for name in want]


@pytest.mark.parametrize("which", ["torch", "torch-free"])
def test_an_idle_server_finishes_the_first_use_repack(gguf_file, which, tmp_path, monkeypatch):
    """ggml repacks an expert when a token first routes to it; an idle server repacks the rest (in pieces, the queue
    looked at between them): after a request and an idle moment, every matrix of the copies held is repacked, the
    state says so, and the same greedy request gets the same answer from the finished copies."""
    from fastapi.testclient import TestClient

    from moectl.kernels import ggml
    from moectl.serve import worker as serve_worker
    from moectl.serve.app import create_app

    own = shutil.copy(gguf_file, tmp_path / "own.gguf")   # its own map: copies no earlier server finished
    engine = fresh_engines(own, tmp_path / "wd")[which == "torch-free"]    # the other's map goes at the collect
    if not ggml.repacks(T.Q4_0, (engine.config.intermediate_size, engine.config.hidden_size)):
        pytest.skip("this CPU's ggml does not repack Q4_0")
    monkeypatch.setattr(serve_worker, "REPACK_PIECE_BYTES", 1)           # a piece is one matrix: many pieces
    pieces = []                                                          # matrices each idle piece repacked
    finish = ggml.finish_repack
    monkeypatch.setattr(ggml, "finish_repack", lambda max_bytes=0: pieces.append(finish(max_bytes)) or pieces[-1])
    gc.collect()
    finish()                                # what copies earlier tests left are done: only this server's are left
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "temperature": 0}
    with TestClient(create_app(engine, MODEL)) as client:
        first = client.post("/v1/chat/completions", json=chat)
        assert first.status_code == 200, first.text
        deadline = time.time() + 60                                      # a wait, not a measurement
        # the state taken after the request (a server's first state holds only what earlier tests left, all done)
        while ((state := client.get("/api/state").json())["requests"] < 1
               or state["repack"]["done"] < state["repack"]["matrices"]):
            assert time.time() < deadline, state["repack"]
            time.sleep(0.05)
        done, held = ggml.repack_progress()
        assert done == held > 0 and state["repack"]["matrices"] > 0
        assert pieces and set(pieces) == {1}                             # the idle worker's pieces, one matrix each
        again = client.post("/v1/chat/completions", json=chat)
        assert ggml.repack_progress() == (held, held)                    # nothing left for the request to repack
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
