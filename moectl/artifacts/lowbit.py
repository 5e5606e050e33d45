"""Low-bit copy sets (written by `moectl quantize`, quant/quantize.py; read by store/lowbit.py): where they lie and
what their descriptor says.

    <workdir>/experts-q{bits}g{group}.safetensors         one file, tensors `layers.{l}.experts` [E, N]
    (or experts-q{bits}g{group}-0000i-of-0000L.safetensors, one per layer, when the set exceeds SHARD_BYTES)
    <workdir>/experts-q{bits}g{group}.json                 settings, per-layer relative error, bytes per expert,
                                                           format version, model fingerprint (written last)
    <workdir>/experts-q{bits}g{group}.parts/               finished layers of an unfinished run

ggml block copies (`moectl quantize --format ggml-q4_0`) are named by their format: experts-ggml-q4_0.json, ...
"""

from __future__ import annotations

from pathlib import Path

FORMAT, VERSION = "moectl-lowbit-copies", 2
# 1: HQQ copies (q{bits}g{group}); 2 adds ggml block copies (ggml-q4_0, ggml-q8_0, ggml-q4_k: `encoding` and
# `ggml_format_version` in the descriptor). HQQ copies are still written as 1, so older moectl reads them.
HQQ_VERSION = 1
SHARD_BYTES = 4 * 2**30              # a copy set bigger than this is written one shard per layer
KEY = "layers.{l}.experts"


def copy_paths(workdir: Path, name: str) -> tuple[Path, Path]:
    """(JSON descriptor, parts directory) of the copy set `name` (e.g. q4g64) in `workdir`."""
    return Path(workdir) / f"experts-{name}.json", Path(workdir) / f"experts-{name}.parts"
