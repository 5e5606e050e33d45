"""Loader: the one copy engine every host -> device expert copy goes through (ProMoE, AdapMoE).

Legend: P = numel of one packed expert; a chunk = one contiguous row range of one of its weight matrices
(gate_up, down, biases, scales: the format's parts), at most CHUNK_BYTES.

Two priorities: DEMAND (a layer is waiting for the expert) before PREFETCH (a guess); first come first
served within one. A copy is cut into chunks: each weight matrix into as few equal row ranges as keep a chunk
within CHUNK_BYTES (`split_rows`). A chunk in flight is never interrupted, so a demand load waits at most one
chunk behind a prefetch that already started, then overtakes the rest of the queue (and the rest of that
prefetch, which keeps what it copied and goes on later). `promote` turns a queued prefetch into a demand load
when its layer needs it. The cap makes speculation cheap: a wrong prefetch delays a demand load by at most one
small chunk (8 MiB: 0.34 ms at 25 GB/s, against 9.4 ms for a Mixtral bf16 gate_up matrix), while copies of a few
MB still run near full PCIe bandwidth. The simulator cuts a copy into as many chunks (`chunk_count`).

Two ways to run the same queue:
  threaded (CUDA)  one worker thread issues the chunks on a dedicated copy stream from pinned buffers, one
                   CUDA event per chunk, at most two chunks issued ahead (else the stream's own FIFO would
                   decide the order); compute waits per chunk (`ready`), so an expert's first matrix can be
                   multiplied while its second still lands.
  synchronous (CPU) nothing runs on its own: `wait(job)` runs queued chunks in queue order on the calling
                   thread until `job` is done, so a demand load still passes every queued prefetch; a prefetch
                   runs when its expert is first used (or never, if its slot is reused first: `cancel`).
`log` lists the chunks in the order they ran: the tests read the ordering there.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass, field

DEMAND, PREFETCH = 0, 1


@dataclass(eq=False)
class CopyJob:
    layer: int
    expert: int
    slot: int
    priority: int
    chunks: list = field(default_factory=list)     # [(name, run)]: run() performs (CUDA: issues) the chunk's copy
    last: dict = field(default_factory=dict)       # part name -> index of its last chunk (what reading it waits for)
    done: int = 0                                  # chunks finished (CUDA: issued, with events[i] recorded)
    events: list = field(default_factory=list)     # CUDA: one event per issued chunk
    cancelled: bool = False
    after: object = None                           # CUDA: compute-stream event the first chunk waits for
    issued_as: int = -1                            # the priority it was submitted with

    def __post_init__(self):
        self.issued_as = self.priority

    @property
    def prefetch(self) -> bool:
        return self.issued_as == PREFETCH

    @property
    def finished(self) -> bool:
        return self.cancelled or self.done == len(self.chunks)


class Loader:
    def __init__(self, threaded: bool = False, stream=None, max_ahead: int = 2, name: str = "moectl-copy"):
        self.threaded, self.stream, self.max_ahead = threaded, stream, max_ahead
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self.log: list[tuple[int, int, str]] = []       # (layer, expert, chunk) in the order chunks ran
        self.keep_log = False
        self._worker = None
        self._stop = False
        if threaded:
            self._worker = threading.Thread(target=self._loop, name=name, daemon=True)
            self._worker.start()

    # --- queue --------------------------------------------------------------------------
    def submit(self, job: CopyJob) -> CopyJob:
        with self._cv:
            heapq.heappush(self._heap, (job.priority, next(self._seq), job))
            self._cv.notify_all()
        return job

    def promote(self, job: CopyJob) -> None:
        """A queued (or half-done) prefetch is needed now: it moves up to demand priority."""
        with self._cv:
            if job.priority != DEMAND and not job.finished:
                job.priority = DEMAND
                heapq.heappush(self._heap, (DEMAND, next(self._seq), job))     # the old entry is skipped later
                self._cv.notify_all()

    def cancel(self, job: CopyJob) -> None:
        """Drop a job whose slot is about to be reused: unstarted chunks never run; a started chunk finishes."""
        with self._cv:
            while self.threaded and self._running is job:
                self._cv.wait()
            job.cancelled = True
            self._cv.notify_all()

    def _next(self) -> tuple[CopyJob, int] | None:
        """The job whose next chunk runs now (caller holds the lock)."""
        while self._heap:
            prio, _, job = self._heap[0]
            if job.finished or prio != job.priority:
                heapq.heappop(self._heap)
                continue
            return job, job.done
        return None

    def _run_one(self, job: CopyJob, i: int) -> None:
        name, run = job.chunks[i]
        ev = run(job, i)
        with self._cv:
            if ev is not None:
                job.events.append(ev)
            job.done += 1
            if self.keep_log:
                self.log.append((job.layer, job.expert, name))
            self._cv.notify_all()

    # --- waiting ------------------------------------------------------------------------
    def wait(self, job: CopyJob, chunk: int | None = None) -> None:
        """Until `job`'s chunk `chunk` (default: all) is done (CUDA: issued; the compute stream then waits on its
        event). Synchronous: runs queued chunks in queue order on this thread until then."""
        need = len(job.chunks) if chunk is None else chunk + 1
        if not self.threaded:
            self.promote(job)
            while not job.cancelled and job.done < need:
                nxt = self._next()
                if nxt is None:
                    raise RuntimeError("loader queue is empty but a job is unfinished")
                self._run_one(*nxt)
            return
        self.promote(job)
        with self._cv:
            while not job.cancelled and job.done < need:
                self._cv.wait()

    def drain(self) -> None:
        """Run (CPU) or wait for (threaded) everything queued."""
        if not self.threaded:
            while (nxt := self._next()) is not None:
                self._run_one(*nxt)
            return
        with self._cv:
            while self._next() is not None or self._running is not None:
                self._cv.wait()

    # --- the worker (threaded) ------------------------------------------------------------
    _running: CopyJob | None = None

    def _loop(self) -> None:
        ahead: list = []                                  # events of chunks issued, maybe not landed yet
        while True:
            with self._cv:
                while not self._stop and self._next() is None:
                    self._cv.wait()
                if self._stop:
                    return
                job, i = self._next()
                self._running = job
            while len(ahead) >= self.max_ahead:           # keep the copy stream's FIFO short: order is ours
                ahead.pop(0).synchronize()
            try:
                self._run_one(job, i)
            finally:
                with self._cv:
                    self._running = None
                    self._cv.notify_all()
            if job.events:
                ahead.append(job.events[-1])

    def close(self) -> None:
        if self._worker is not None:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            self._worker.join(timeout=5)
            self._worker = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
