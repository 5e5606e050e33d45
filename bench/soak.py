"""Soak `moectl serve` on loopback: N mixed good/bad requests from concurrent clients, with mid-stream disconnects.

Checks afterwards: /health is OK, every good answer equals the runtime's own greedy answer (computed in this
process), every bad request got its 4xx, disconnected streams were cancelled, and the server's RSS grew by
less than --rss-bound-mb between the end of the warm-up and the end. Bounded in count (--requests) and time
(--max-seconds). Prints a table and one JSON line; exit code 1 if a check failed.

Usage: python bench/soak.py [--requests 1000] [--clients 6] [--model DIR]  (default model: the small tiny
model, built into a temporary directory in ~20 s).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))      # the tests' live-server helpers
from serve_helpers import API_KEY, MODEL, cli_server, greedy_chat, sse_events  # noqa: E402

PROMPTS = ["What does bisect_left do?", "hello", "What is a list?", "Explain heapq.heappush.",
           "What does os.path.join return?", "How do I sort a dict?", "What is a generator?", "re.match?"]
BAD = [  # (kind, path, headers, raw body, expected status)
    ("malformed_json", "/v1/chat/completions", True, '{"model": "tiny", "messages": [', 400),
    ("wrong_type", "/v1/chat/completions", True, json.dumps({"model": MODEL, "messages": "hi"}), 400),
    ("wrong_type", "/v1/completions", True, json.dumps({"model": MODEL, "prompt": "a", "max_tokens": "x"}), 400),
    ("unknown_model", "/v1/chat/completions", True,
     json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}), 404),
    ("too_long", "/v1/completions", True, json.dumps({"model": MODEL, "prompt": "word " * 3000}), 400),
    ("missing_key", "/v1/chat/completions", False,
     json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}), 401),
    ("no_route", "/v1/nothing", True, "{}", 404),
]


def plan(n: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    kinds = ["chat"] * 30 + ["chat_stream"] * 15 + ["completion"] * 10 + ["disconnect"] * 10 + ["bad"] * 35
    out = []
    for _ in range(n):
        kind = rng.choice(kinds)
        out.append((kind, rng.choice(BAD) if kind == "bad" else rng.choice(PROMPTS)))
    return out


def one(client, url: str, kind: str, arg, expected: dict, max_tokens: int) -> tuple[str, bool, str]:
    """(what, ok, detail) of one request."""
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    if kind == "bad":
        what, path, with_key, body, status = arg
        r = client.post(url + path, content=body, headers=auth if with_key else {"Content-Type": "application/json"})
        ok = r.status_code == status and "error" in r.json() and "Traceback" not in r.text
        return f"bad:{what}", ok, f"{r.status_code}"
    if kind == "disconnect":
        body = {"model": MODEL, "prompt": arg, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with client.stream("POST", url + "/v1/completions", json=body, headers=auth) as r:
            if r.status_code != 200:
                return kind, False, str(r.status_code)
            events = sse_events(r)
            next(events), next(events)
        return kind, True, ""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": arg}], "temperature": 0, "max_tokens": max_tokens}
    if kind == "chat":
        r = client.post(url + "/v1/chat/completions", json=chat, headers=auth)
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
        return kind, text == expected["chat", arg], str(r.status_code)
    if kind == "chat_stream":
        with client.stream("POST", url + "/v1/chat/completions", json=chat | {"stream": True}, headers=auth) as r:
            if r.status_code != 200:
                return kind, False, str(r.status_code)
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r))
        return kind, text == expected["chat", arg], ""
    r = client.post(url + "/v1/completions", headers=auth,
                    json={"model": MODEL, "prompt": arg, "temperature": 0, "max_tokens": max_tokens})
    text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
    return kind, text == expected["completion", arg], str(r.status_code)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-seconds", type=float, default=600, help="stop sending after this long")
    ap.add_argument("--max-tokens", type=int, default=8, help="answer length of the good requests")
    ap.add_argument("--rss-bound-mb", type=float, default=64, help="allowed server RSS growth after warm-up")
    ap.add_argument("--warmup", type=int, default=100, help="requests before the first RSS reading")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: build the small tiny model)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import httpx
    import psutil
    import torch

    from moectl.runtime.engine import Engine

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="moectl-soak-"))
    if a.model is None:
        from moectl.synth.tiny import build_tiny

        print("building the small tiny model ...", flush=True)
        a.model = str(build_tiny(tmp / "tiny", small=True, progress=False))
    engine = Engine.load(a.model, cache_experts=6, emulate_device=True, progress=False)
    expected = {("chat", p): greedy_chat(engine, p, a.max_tokens)[1] for p in PROMPTS}
    expected |= {("completion", p): engine.generate(p, max_new_tokens=a.max_tokens, greedy=True).text for p in PROMPTS}

    work = plan(a.requests, a.seed)
    results: list[tuple[str, bool, str]] = []
    lock = threading.Lock()
    next_index = iter(range(len(work)))
    rss: dict[str, float] = {}
    with cli_server(Path(a.model), tmp, "--api-key", API_KEY, "--cache-experts", "6", "--emulate-device", "--max-queue", "32") as live:
        server = psutil.Process(live.proc.pid)
        t0 = time.time()

        def client_loop():
            with httpx.Client(timeout=120) as client:
                while time.time() - t0 < a.max_seconds:
                    with lock:
                        i = next(next_index, None)
                    if i is None:
                        return
                    if i == a.warmup:
                        rss["warm"] = server.memory_info().rss / 2**20
                    try:
                        r = one(client, live.url, *work[i], expected, a.max_tokens)
                    except Exception as e:                    # noqa: BLE001 -- a failed request is a result
                        r = (work[i][0], False, f"{type(e).__name__}: {e}")
                    with lock:
                        results.append(r)

        threads = [threading.Thread(target=client_loop) for _ in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        while (state := httpx.get(live.url + "/api/state").json())["busy"] or state["queue_depth"]:
            time.sleep(0.1)
        rss["end"] = server.memory_info().rss / 2**20
        health = httpx.get(live.url + "/health")
        metrics = httpx.get(live.url + "/metrics").text

    from prometheus_client.parser import text_string_to_metric_families

    statuses = Counter()
    for fam in text_string_to_metric_families(metrics):
        for sample in fam.samples:
            if sample.name == "moectl_requests_total" and sample.labels["endpoint"].startswith("/v1"):
                statuses[sample.labels["status"]] += sample.value
    by_kind = Counter(k for k, _, _ in results)
    failed = [(k, d) for k, ok, d in results if not ok]
    growth = rss["end"] - rss.get("warm", rss["end"])
    checks = {"all_sent": len(results) == a.requests, "health_ok": health.status_code == 200
              and health.json()["status"] == "ok", "all_answers_right": not failed,
              "disconnects_cancelled": state["cancelled"] >= by_kind["disconnect"],
              "rss_growth_below_bound": growth < a.rss_bound_mb}
    summary = {"requests": len(results), "wall_s": round(wall, 1), "requests_per_s": round(len(results) / wall, 1),
               "by_kind": dict(sorted(by_kind.items())), "failed": len(failed), "failures": failed[:10],
               "server_generated_tokens": state["generated_tokens"], "server_cancelled": state["cancelled"],
               "server_requests_finished": state["requests"], "cache_hit_rate": round(state["hit_rate"], 3),
               "rss_warm_mb": round(rss.get("warm", 0), 1), "rss_end_mb": round(rss["end"], 1),
               "rss_growth_mb": round(growth, 1), "http_statuses": dict(statuses), "rss_bound_mb": a.rss_bound_mb, "checks": checks}
    print(f"{len(results)} requests from {a.clients} clients in {wall:.1f} s ({summary['requests_per_s']} req/s)")
    for kind, n in sorted(by_kind.items()):
        print(f"  {kind:28s} {n:5d}  failed {sum(1 for k, d in failed if k == kind)}")
    print(f"server: {state['requests']} generations finished, {state['cancelled']} cancelled by disconnects, "
          f"{state['generated_tokens']} tokens, cache hit rate {state['hit_rate']:.1%}")
    print(f"server RSS: {summary['rss_warm_mb']} MB after {a.warmup} requests -> {summary['rss_end_mb']} MB at the end "
          f"(growth {growth:.1f} MB, bound {a.rss_bound_mb} MB)")
    print("HTTP status counts on /metrics: " + ", ".join(f"{k} x{int(v)}" for k, v in sorted(statuses.items())))
    print("checks: " + ", ".join(f"{k} {'OK' if v else 'FAILED'}" for k, v in checks.items()))
    print(json.dumps(summary))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
