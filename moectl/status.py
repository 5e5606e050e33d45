"""The status lines every runtime front end prints (the commands and `serve`'s chat loop): which plan applied,
what the runtime prefetches with, a run's figures."""

from __future__ import annotations


def print_plan_note(eng, console=None) -> None:
    """The line that says which plan.yaml the runtime applied (stderr: JSON on stdout stays clean)."""
    from rich.console import Console

    if getattr(eng, "plan_note", ""):
        (console or Console(stderr=True)).print(f"[dim]{eng.plan_note}[/]", highlight=False)


def print_device(eng, console=None) -> None:
    """The device the run took and why (`--device auto` is the default), and the budget when the device's free
    memory set it (stderr: JSON on stdout stays clean)."""
    from rich.console import Console

    opts = getattr(eng, "options", None)
    for note in (getattr(opts, "device_note", ""), getattr(opts, "budget_note", "")):
        if note:
            (console or Console(stderr=True)).print(f"[dim]{note}[/]", highlight=False)


def print_stats_line(stats: dict, console=None) -> None:
    """One status line: tokens/s, hit rate, bytes loaded, load wait."""
    from rich.console import Console

    from .core.recipes import format_bytes

    (console or Console()).print(
        f"[dim]{stats['tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s | cache hit rate {stats['hit_rate']:.1%} "
        f"({stats['hits']} hits, {stats['misses']} misses) | loaded {format_bytes(stats['bytes_loaded'])} "
        f"({format_bytes(stats['bytes_per_token'])}/token) | load wait {stats['load_wait_s'] * 1000:.1f} ms"
        + (f" | {stats['prefetches']} prefetched" if stats.get("prefetches") else "")
        + (f" | {stats['gating']}, {stats['experts_per_token']:.2f} experts/token/layer" if stats.get("gating") else "")
        + (f" | low-bit misses {stats['low_misses']}, skipped {stats['skips']}" if "low_misses" in stats else "")
        + "[/]",
        highlight=False)


def prefetch_note(eng) -> str:
    """What the runtime prefetches with, for one status line."""
    p = eng.prefetch
    if p is None:
        return "prefetch: none"
    inner = getattr(p, "inner", None)
    name = p.name + (f" + {inner.name}" if inner is not None and inner.name != "none" else "")
    return f"prefetch: {name}"
