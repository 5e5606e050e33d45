"""The one thread that runs the (batch-1) runtime for `moectl serve`, and the live state it publishes.

Requests become `Job`s in a bounded FIFO; the worker runs them one at a time and sends each job's events
(`("token", text)`, then `("done", info)` or `("error", message)`) to the asyncio loop that waits for them.
A job whose client went away is flagged `cancelled`: the engine checks the flag after every token, so the
runtime is free again one token later; a cancelled job still in the queue is skipped.

While generating (at most every 20 ms) and after each request the worker publishes a `state` dict
(per-layer residency and hit rates, bytes per token, prefetch accuracy, ...) built from the runtime's own
stats: the cache page and /metrics read only that, never the runtime itself from another thread. It names the
engine ("torch", or "torch-free": `runtime/graph_engine.py`) and whether the experts are in place (no device cache:
every routed expert a hit, nothing loaded); both engines count each layer's hits.

A GGUF run with ggml repacks an expert for llama.cpp's CPU kernels when a token first routes to it (llama.cpp's
loader repacks all at load). While no job waits, the worker repacks the rest a piece at a time
(`REPACK_PIECE_BYTES`), looking at the queue between pieces: a request arriving meanwhile waits for one piece, not
the whole remainder. The state's `repack` says how far it is (None: no ggml loaded).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from ..kernels import ggml
from ..runtime.live_view import layer_rows
from .protocol import StopMatcher

SNAPSHOT_EVERY_S = 0.02      # live state at most this often while generating (residency of L x E experts)
ENGINE_NAMES = {False: "torch", True: "torch-free"}      # engine.torch_free -> the state's "engine"
# an idle server's piece of the first-use repack: about 25 ms at the rate docs/gguf.md measured (1.19 GB in 0.93 s),
# what a request arriving during it waits at most (one Mixtral Q4_0 expert matrix is 33 MB: a piece is one of them)
REPACK_PIECE_BYTES = 32 << 20


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    greedy: bool
    temperature: float
    top_p: float
    seed: int | None
    stops: list[str]
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


@dataclass
class Totals:
    requests: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    last_tokens_per_s: float = 0.0


class Worker:
    def __init__(self, engine, max_queue: int):
        self.engine, self.max_queue = engine, max_queue
        self.jobs: queue.Queue = queue.Queue()
        self.waiting = 0                                 # jobs queued, not started
        self.busy = False
        self.lock = threading.Lock()
        self.totals = Totals()
        self.request_stats: dict = {}
        self.step = 0
        self.state = self._snapshot(None)
        self.thread = threading.Thread(target=self._run, name="moectl-runtime", daemon=True)
        self.thread.start()

    # --- queue --------------------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queue `job`; False (nothing queued) when max_queue jobs already wait."""
        with self.lock:
            if self.waiting >= self.max_queue:
                return False
            self.waiting += 1
        self.jobs.put(job)
        return True

    @property
    def queue_depth(self) -> int:
        return self.waiting

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the mean request time so far, at least 1."""
        t = self.totals
        return max(1, round(t.generate_seconds / t.requests)) if t.requests else 1

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)

    # --- the runtime thread -------------------------------------------------------------
    def _next_job(self) -> Job | None:
        """The next job (None: stop). While none waits and ggml's first-use repack has matrices left, a piece of
        them is repacked and the queue looked at again; then it waits for a job."""
        while (progress := ggml.repack_progress()) is not None and progress[0] < progress[1]:
            try:
                return self.jobs.get_nowait()
            except queue.Empty:
                if not ggml.finish_repack(REPACK_PIECE_BYTES):
                    break                                # nothing left after all (a copy went meanwhile)
                self.state = self._snapshot(self.request_stats)
        return self.jobs.get()

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            with self.lock:
                self.waiting -= 1
                self.busy = True
            try:
                if job.cancelled.is_set():
                    self.totals.cancelled += 1
                    job.send("done", {"finish_reason": "cancelled", "completion_tokens": 0})
                else:
                    self._generate(job)
            except Exception as e:                       # never lose the worker; the client gets a 500
                job.send("error", f"{type(e).__name__}: {e}")
            finally:
                with self.lock:
                    self.busy = False
                self.state = self._snapshot(self.request_stats)

    def _generate(self, job: Job) -> None:
        eng = self.engine
        stop = StopMatcher(job.stops)
        mark = eng.cache.snapshot()
        n = 0
        self.request_stats = {}

        def on_token(_tok: int, piece: str) -> None:
            nonlocal n
            n += 1
            text = stop.feed(piece)
            if text:
                job.send("token", text)
            self.step += 1
            now = eng.cache.stats.as_dict()
            self.request_stats = {"tokens": n, "bytes_loaded": now["bytes_loaded"] - mark["bytes_loaded"],
                                  "hits": now["hits"] - mark["hits"], "misses": now["misses"] - mark["misses"]}
            if time.time() - self.state["time"] >= SNAPSHOT_EVERY_S:
                self.state = self._snapshot(self.request_stats)

        res = eng.generate(input_ids=job.ids, max_new_tokens=job.max_tokens, greedy=job.greedy,
                           temperature=job.temperature, top_p=job.top_p, seed=job.seed, on_token=on_token,
                           stop_at_eos=not job.ignore_eos,
                           should_stop=lambda: stop.stopped or job.cancelled.is_set())
        tail = stop.flush()
        if tail:
            job.send("token", tail)
        t = self.totals
        t.requests += 1
        t.prompt_tokens += len(job.ids)
        t.generated_tokens += len(res.token_ids)
        t.generate_seconds += res.stats["seconds"]
        t.last_tokens_per_s = res.stats["tokens_per_s"]
        if job.cancelled.is_set():
            t.cancelled += 1
            reason = "cancelled"
        elif stop.stopped or (res.token_ids and len(res.token_ids) < job.max_tokens):
            reason = "stop"                              # a stop string or EOS
        else:
            reason = "length"
        self.state = self._snapshot(self.request_stats)  # before the reply: a client's next look counts this request
        job.send("done", {"finish_reason": reason, "completion_tokens": len(res.token_ids),
                          "prompt_tokens": len(job.ids), "stats": res.stats})

    def _snapshot(self, request: dict | None) -> dict:
        """The live state: built in the runtime thread, read (as a whole) by the event loop."""
        cache, t = self.engine.cache, self.totals
        s = cache.stats.as_dict()
        repack = ggml.repack_progress()
        return {"engine": ENGINE_NAMES[self.engine.torch_free], "in_place": cache.in_place,
                "step": self.step, "busy": self.busy, "queue_depth": self.waiting,
                "requests": t.requests, "cancelled": t.cancelled, "prompt_tokens": t.prompt_tokens,
                "generated_tokens": t.generated_tokens, "tokens_per_s": t.last_tokens_per_s,
                "hits": s["hits"], "misses": s["misses"], "hit_rate": s["hit_rate"],
                "bytes_loaded": s["bytes_loaded"], "expert_bytes": cache.store.expert_nbytes,
                "experts": cache.store.num_experts,
                "prefetches": s["prefetches"], "prefetch_used": s["prefetch_used"],
                "prefetch_accuracy": s["prefetch_used"] / s["prefetches"] if s["prefetches"] else None,
                "request": (request or {}) | ({"bytes_per_token": request["bytes_loaded"] / request["tokens"]}
                                              if request else {}),
                "repack": {"done": repack[0], "matrices": repack[1]} if repack else None,
                "layers": layer_rows(cache), "time": time.time()}
