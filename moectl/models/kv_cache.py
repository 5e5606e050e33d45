"""The KV cache argument of a transformers model's forward, by the name the installed transformers gives it.

transformers 5.24 renamed `past_key_values` to `cache` (the old keyword and output attribute still work but print
a FutureWarning and a log line on every call, and go in 5.40); 5.23, which constraints.txt pins, knows only
`past_key_values` (a `cache=` there would land in **kwargs and be ignored: no KV cache at all). So moectl reads the
name off the forward's signature once per model class, and never touches the old name on a newer transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect


@functools.lru_cache(maxsize=None)
def _cache_name(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """{name: cache}: the keyword a forward of `model` takes its KV cache by."""
    return {_cache_name(type(model)): cache}


def output_cache(out):
    """The KV cache a forward returned (`out.cache` from 5.24 on, `out.past_key_values` before)."""
    names = {f.name for f in dataclasses.fields(out)} if dataclasses.is_dataclass(out) else set(out.keys())
    return out["cache"] if "cache" in names else out["past_key_values"]
