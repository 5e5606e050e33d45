"""Replacement and prefetch policies (no device code). See `base.py` for the interfaces."""

from .base import LRU, PrefetchPolicy, ReplacementPolicy

__all__ = ["LRU", "PrefetchPolicy", "ReplacementPolicy"]
