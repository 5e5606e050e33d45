"""Python's cyclic garbage collector paused while a model loads (`runtime/load.py: load`).

A load builds most of the process's heap at once: transformers' and torch's model code imported (the first load
of a process), the config, the model object, the stores. Python's collector, which runs whenever allocations
outnumber frees by its threshold, meanwhile traverses that growing heap again and again: 551 collections (3 of
them full) in 0.65 s CPU of a 2-layer GGUF's load (`gc.callbacks` timed, one thread, the shared 2-core machine
under load; `bench/gguf_load_time.py`'s "gc in Engine.load"). Paused, nothing is traversed during the load, and one
full collection at its end (0.30 s) frees the load's cyclic garbage and files the survivors as old, so the first
tokens do not pay for traversing them. Reference-counted objects (tensors, most of everything) are freed as always; only cycles wait.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def collector_paused():
    """The block runs with the collector off; after it, one full collection and the collector on again, if it
    was on before (a caller that turned it off keeps it off). Nested blocks collect once, at the outermost."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.collect()
            gc.enable()
