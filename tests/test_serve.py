"""moectl serve against a live server on 127.0.0.1 with the small tiny model: the official openai client,
concurrent clients, the 429 path, bad input, disconnects, /metrics, the cache state, CLI failures."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="moectl[serve] is not installed")
openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serve_helpers import API_KEY, MODEL, cli_server, greedy_chat, sse_events, thread_server  # noqa: E402

QUESTIONS = ["What does bisect_left do?", "hello", "What is a list?", "Explain heapq.heappush.",
             "What does os.path.join return?", "How do I sort a dict?", "What is a generator?", "re.match?"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def engine(tiny_small):
    from moectl.runtime.engine import Engine

    return Engine.load(str(tiny_small), cache_experts=6, emulate_device=True, progress=False)


@pytest.fixture(scope="module")
def server(tiny_small, tmp_path_factory):
    with cli_server(tiny_small, tmp_path_factory.mktemp("serve"), "--api-key", API_KEY, "--cache-experts", "6", "--emulate-device",
                    "--max-queue", "16") as live:
        yield live


def stop_inside(answer: str, width: int = 3) -> str:
    """A stop string taken from the greedy answer, whatever the model's text: the first `width`-character window
    from the answer's middle on that holds a non-space character (searching back from the middle when the second
    half is all blank). Which model trained the answer decides the text, never whether the window is blank."""
    n, mid = min(width, len(answer)), len(answer) // 2
    for i in [*range(mid, len(answer) - n + 1), *range(min(mid, len(answer) - n), -1, -1)]:
        if answer[i:i + n].strip():
            return answer[i:i + n]
    raise AssertionError(f"the greedy answer is blank: {answer!r}")


def test_stop_inside_never_picks_a_blank_window():
    assert stop_inside("abcdefgh") == "efg"
    assert stop_inside("word" + " " * 20) == "d  "            # second half blank: the window nearest the middle
    assert stop_inside("a b     c") == "  c" and stop_inside("ab") == "ab"
    with pytest.raises(AssertionError):
        stop_inside("    ")


def state(live) -> dict:
    return httpx.get(live.url + "/api/state").json()


def metrics(live) -> dict:
    """{(name, labels tuple): value} of every sample on /metrics."""
    text = httpx.get(live.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def good_request(live) -> None:
    r = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_chat_stream_completion_models(server, engine):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL

    ids, expected = greedy_chat(engine, QUESTIONS[0], 24)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                          temperature=0, max_tokens=24)
    answer = chat.choices[0].message.content
    assert answer == expected and answer
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                 temperature=0, max_tokens=24, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1                      # really streamed, piece by piece
    assert "".join(pieces) == answer
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    prompt = "The list type"
    want = engine.generate(prompt, max_new_tokens=12, greedy=True).text
    done = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    assert done.choices[0].text == want
    assert done.usage.prompt_tokens == len(engine.tokenizer(prompt)["input_ids"])

    stop = stop_inside(answer)                                    # a stop string inside the greedy answer
    assert stop.strip() and stop in answer
    for streamed in (False, True):
        cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                             temperature=0, max_tokens=24, stop=[stop, "never said"], stream=streamed)
        chunks = list(cut) if streamed else [cut]
        text = "".join((c.choices[0].delta.content if streamed else c.choices[0].message.content) or "" for c in chunks)
        assert text == answer[:answer.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_eight_concurrent_clients_get_their_greedy_answers(server, engine):
    # each client its own question and its own max_tokens (9..16): the expected answers differ even from a model
    # that answers every question alike (one trained run answers each with "assistant\n" repeated)
    limit = {q: 16 - i for i, q in enumerate(QUESTIONS)}
    expected = {q: greedy_chat(engine, q, limit[q])[1] for q in QUESTIONS}
    got, errors = {}, []
    start = threading.Barrier(len(QUESTIONS))

    def ask(q):
        try:
            start.wait()
            r = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                        temperature=0, max_tokens=limit[q])
            got[q] = r.choices[0].message.content
        except Exception as e:                                    # noqa: BLE001 -- reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert got == expected
    assert len(set(expected.values())) > 1                        # the requests really differ


BAD = [  # (what, path, headers, body, status, error code)
    ("malformed JSON", "/v1/chat/completions", AUTH, '{"model": "tiny", "messages": [', 400, "invalid_json"),
    ("body not an object", "/v1/chat/completions", AUTH, "[1, 2]", 400, "invalid_json"),
    ("messages not a list", "/v1/chat/completions", AUTH, {"model": MODEL, "messages": "hello"}, 400, "invalid_value"),
    ("max_tokens a string", "/v1/chat/completions", AUTH,
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "invalid_value"),
    ("temperature a string", "/v1/completions", AUTH, {"model": MODEL, "prompt": "a", "temperature": "hot"},
     400, "invalid_value"),
    ("temperature a bool", "/v1/completions", AUTH, {"model": MODEL, "prompt": "a", "temperature": True},
     400, "invalid_value"),
    ("seed out of range", "/v1/completions", AUTH, {"model": MODEL, "prompt": "a", "seed": 2**70}, 400,
     "invalid_value"),
    ("body over 16 MB", "/v1/completions", AUTH, {"model": MODEL, "prompt": "a" * (17 * 2**20)}, 413,
     "body_too_large"),
    ("stream not a bool", "/v1/completions", AUTH, {"model": MODEL, "prompt": "a", "stream": "yes"}, 400,
     "invalid_value"),
    ("negative max_tokens", "/v1/completions", AUTH, {"model": MODEL, "prompt": "a", "max_tokens": -3}, 400,
     "invalid_value"),
    ("prompt a number", "/v1/completions", AUTH, {"model": MODEL, "prompt": 5}, 400, "invalid_value"),
    ("token id out of range", "/v1/completions", AUTH, {"model": MODEL, "prompt": [1, 10**9]}, 400, "invalid_value"),
    ("unknown role", "/v1/chat/completions", AUTH, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     400, "invalid_value"),
    ("unknown model", "/v1/chat/completions", AUTH,
     {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
    ("prompt longer than the context", "/v1/chat/completions", AUTH,
     {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "context_length_exceeded"),
    ("prompt + max_tokens over the context", "/v1/completions", AUTH,
     {"model": MODEL, "prompt": "hello", "max_tokens": 5000}, 400, "context_length_exceeded"),
    ("missing API key", "/v1/chat/completions", {}, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
     401, "missing_api_key"),
    ("wrong API key", "/v1/completions", {"Authorization": "Bearer nope"}, {"model": MODEL, "prompt": "a"}, 401,
     "invalid_api_key"),
    ("wrong key on the models list", "/v1/models", {"Authorization": "Bearer nope"}, None, 401, "invalid_api_key"),
    ("no such route", "/v1/engines", AUTH, {}, 404, "not_found"),
]


@pytest.mark.parametrize("what,path,headers,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_and_server_goes_on(server, what, path, headers, body, status, code):
    if body is None:
        r = httpx.get(server.url + path, headers=headers)
    else:
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(server.url + path, headers=headers | {"Content-Type": "application/json"}, content=content)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    assert "Traceback" not in r.text
    good_request(server)


def test_openai_client_raises_the_matching_errors(server):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").chat.completions.create(model=MODEL, messages=messages)
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=messages)
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("nope")
    with pytest.raises(openai.BadRequestError, match="context"):
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 3000}])


def wait_idle_after(live, before: dict) -> dict:
    """The state once the request after `before` has finished (the runtime must be free soon)."""
    deadline = time.time() + 30
    while (s := state(live))["busy"] or s["requests"] == before["requests"]:
        assert time.time() < deadline
        time.sleep(0.05)
    return s


def test_client_disconnect_mid_stream_stops_generation(server):
    before = state(server)
    body = {"model": MODEL, "prompt": "The", "max_tokens": 900, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", headers=AUTH, json=body) as r:
            assert r.status_code == 200
            events = sse_events(r)
            for _ in range(3):
                assert next(events)["choices"][0]["text"] is not None
    s = wait_idle_after(server, before)
    assert s["cancelled"] == before["cancelled"] + 1
    assert 3 <= s["generated_tokens"] - before["generated_tokens"] < 900
    good_request(server)


def test_client_leaving_a_plain_request_stops_generation(server):
    before = state(server)
    body = {"model": MODEL, "prompt": "The", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):                        # the client gives up after 0.1 s
        httpx.post(server.url + "/v1/completions", headers=AUTH, json=body, timeout=httpx.Timeout(5, read=0.1))
    s = wait_idle_after(server, before)
    assert s["cancelled"] == before["cancelled"] + 1
    assert s["generated_tokens"] - before["generated_tokens"] < 1000
    good_request(server)


def test_metrics_prometheus_text(server):
    before = metrics(server)
    httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={"model": "nope", "messages": []})
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5})
    usage = r.json()["usage"]
    after = metrics(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("moectl_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert delta("moectl_requests_total", endpoint="/v1/chat/completions", status="400") == 1   # empty messages
    assert delta("moectl_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("moectl_generated_tokens_total") == usage["completion_tokens"]
    assert delta("moectl_cache_hits_total") + delta("moectl_cache_misses_total") > 0
    assert delta("moectl_bytes_loaded_total") >= 0 and after[("moectl_bytes_loaded_total", ())] > 0
    assert after[("moectl_tokens_per_second", ())] > 0
    assert after[("moectl_queue_depth", ())] == 0
    assert 0 <= after[("moectl_cache_hit_rate", ())] <= 1
    layer_rates = [v for (name, labels), v in after.items() if name == "moectl_layer_hit_rate"]
    assert len(layer_rates) == 2 and all(0 <= v <= 1 for v in layer_rates)


def test_cache_state_adds_up_and_moves(server):
    before = state(server)
    good_request(server)
    s = state(server)
    assert s["step"] > before["step"] and s["requests"] == before["requests"] + 1
    assert len(s["layers"]) == 2
    for layer in s["layers"]:
        assert layer["slots"] == 3 and 0 < len(layer["resident"]) <= 3
        assert set(layer["resident"].values()) == {"fp32"}
        assert all(0 <= int(e) < s["experts"] for e in layer["resident"])
    # the per-layer counts (routing time) are the runtime's own cache counts, split by layer
    assert sum(layer["hits"] for layer in s["layers"]) == s["hits"]
    assert sum(layer["misses"] for layer in s["layers"]) == s["misses"]
    assert s["request"]["bytes_per_token"] == s["request"]["bytes_loaded"] / s["request"]["tokens"]
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "cache-panel" in page.text
    assert "http://" not in page.text and "https://" not in page.text          # no external assets
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_queue_full_answers_429_with_retry_after(engine):
    """--max-queue 1: one request runs, one waits, the third is refused; the waiting one is served after."""
    with thread_server(engine, max_queue=1) as live:
        _ids, expected = greedy_chat(engine, "hello", 8)
        long = {"model": MODEL, "prompt": "The", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", live.url + "/v1/completions", json=long) as running:
            events = sse_events(running)                          # (kept: dropping it would close the stream)
            next(events)                                          # the long request is generating
            waited = {}
            waiter = threading.Thread(target=lambda: waited.update(httpx.post(
                live.url + "/v1/chat/completions", timeout=60, json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                    "temperature": 0}).json()))
            waiter.start()
            deadline = time.time() + 20
            while state(live)["queue_depth"] < 1:
                assert time.time() < deadline
                time.sleep(0.02)
            refused = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
        waiter.join(timeout=60)                                   # leaving the stream freed the runtime
        assert waited["choices"][0]["message"]["content"] == expected
        good = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
        assert good.status_code == 200


def _serve_cli(*args, tmp_path):
    env = dict(os.environ, MOECTL_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", COLUMNS="250")
    return subprocess.run([sys.executable, "-m", "moectl.cli", "serve", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_port_in_use_is_one_error_line_and_public_host_warns(tiny_small, tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _serve_cli("--model", str(tiny_small), "--host", "0.0.0.0", "--port", str(port), tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "warning:" in proc.stderr and "--api-key" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(port) in errors[0] and "in use" in errors[0]
    assert "Traceback" not in proc.stderr


def test_model_that_fails_to_load_is_one_error_line(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"junk")
    proc = _serve_cli("--model", str(broken), "--port", "0", "--api-key", "k", tmp_path=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr      # and no warning: a key was given
    assert "Traceback" not in proc.stderr


def test_stop_matcher_cuts_across_pieces_and_holds_back_only_prefixes():
    from moectl.serve.protocol import StopMatcher

    m = StopMatcher(["cd", "xyz"])
    sent = [m.feed(p) for p in ["ab", "c", "x", "y", "c", "de", "more"]]
    assert sent == ["ab", "", "c", "", "xy", "", ""]               # "c" and "x", "xy" held until ruled out
    assert "".join(sent) + m.flush() == "abcxy" and m.stopped
    m = StopMatcher(["end"])
    assert m.feed("the e") == "the " and m.flush() == "e"            # a held tail is sent when the answer ends
