"""Where the project's shared material (`shared/traces/*.jsonl`) is, for every test.

`$MOECTL_SHARED` if set, else the `shared/` folder beside the repository (how CI and every checkout lay it
out). Tests that need it are marked `needs_shared`: they skip on a checkout without it, but under CI
(`CI=true`) a missing folder is not skipped -- those tests then fail, so a moved folder cannot go unnoticed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("MOECTL_SHARED") or Path(__file__).resolve().parents[2] / "shared")
SHARED_TRACES = SHARED / "traces"
TRACE_FILES = sorted(SHARED_TRACES.glob("*.jsonl"))

needs_shared = pytest.mark.skipif(not TRACE_FILES and not os.environ.get("CI"),
                                  reason=f"no shared traces under {SHARED_TRACES} (set MOECTL_SHARED)")
