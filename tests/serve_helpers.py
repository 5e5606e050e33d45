"""Live `moectl serve` servers for the tests: the real CLI in a subprocess, or the app in a thread."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

API_KEY = "test-key"
MODEL = "tiny"


class Live:
    def __init__(self, url: str, proc=None, log: Path | None = None, app=None):
        self.url, self.proc, self.log, self.app = url, proc, log, app

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(**({"base_url": self.url + "/v1", "api_key": API_KEY, "max_retries": 0, "timeout": 120} | kw))


@contextmanager
def cli_server(checkpoint: Path, tmp: Path, *args: str, timeout: float = 120):
    """`moectl serve` on 127.0.0.1, any free port (read from its 'serving ... on URL' line)."""
    log = tmp / "serve.log"
    env = dict(os.environ, MOECTL_HOME=str(tmp / "home"), HF_HUB_OFFLINE="1", COLUMNS="250")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "moectl.cli", "serve", "--model", str(checkpoint),
                                 "--port", "0", "--served-model-name", MODEL, "--threads", "1", *args],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + timeout
        while not (m := re.search(r"serving \S+ on (http://\S+)", log.read_text())):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"moectl serve did not start (rc {proc.poll()}):\n{log.read_text()}")
            time.sleep(0.2)
        yield Live(m.group(1), proc=proc, log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def thread_server(engine, **kw):
    """The app of `engine` under uvicorn in a thread of this process, on 127.0.0.1 and a free port."""
    import uvicorn

    from moectl.serve.app import create_app
    from moectl.serve.listen import bind

    app = create_app(engine, MODEL, **kw)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield Live(f"http://127.0.0.1:{sock.getsockname()[1]}", app=app)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def greedy_chat(engine, content: str, max_tokens: int) -> tuple[list[int], str]:
    """What the server must answer at temperature 0: the runtime's own greedy generation on the chat template."""
    from moectl.runtime.generation import chat_ids

    ids = chat_ids(engine.tokenizer, [{"role": "user", "content": content}])
    return ids, engine.generate(input_ids=ids, max_new_tokens=max_tokens, greedy=True).text


def sse_events(response):
    """Parsed `data:` events of a streamed httpx response, lazily."""
    import json

    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])
