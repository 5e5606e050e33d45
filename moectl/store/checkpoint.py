"""Read a Hugging Face checkpoint directory's safetensors shards, one tensor (or byte range) at a time.

The shard headers are parsed once (8-byte length + JSON: dtype, shape, byte offsets of every tensor),
so every tensor is a known byte range of a known file. Reads are `os.preadv` straight into the
caller's buffer: nothing is memory-mapped, so no shard stays in the process's RSS after its bytes
have been copied to where they are used, and an expert can be read into a cache slot in one pass.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MoectlError

# safetensors dtype names -> torch dtypes (the ones the families use).
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class ByteRange:
    """Where one tensor (or one row of a fused [E, ...] tensor) lies: absolute file offset and length."""

    file: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_at(fd: int, buf: memoryview, offset: int) -> int:
    """One positioned read of len(buf) bytes into `buf` (module-level so tests can count reads)."""
    return os.preadv(fd, [buf], offset)


_PROBE = bytearray(4096)


def in_page_cache(fd: int, offset: int) -> bool:
    """Whether the page at `offset` is in the OS page cache: a non-blocking 4 KB read (`RWF_NOWAIT`) that the
    kernel refuses when it would have to wait for the disk. True where the flag does not exist (not Linux)."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return True
    try:
        os.preadv(fd, [_PROBE], offset, flag)
    except BlockingIOError:
        return False
    except OSError:                             # flag not supported by this filesystem: behave as before
        return True
    return True


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def parse_header(f: Path) -> dict[str, ByteRange]:
    """Every tensor's byte range in one shard, from its header only; a clear error if it is damaged."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(fh.read(n))
        base, out = 8 + n, {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            shape = tuple(int(s) for s in info["shape"])
            dtype = DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {key} has dtype {info['dtype']}, which moectl does not read")
            if end < start or base + end > size or end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {key} has byte range {start}..{end} beyond the data or of the wrong size")
            out[key] = ByteRange(f, base + start, end - start, dtype, shape)
        return out
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise MoectlError(f"cannot read shard {f}: {e} (the file is corrupt or truncated)") from None


class Checkpoint:
    """Key -> byte range over a checkpoint directory (`model.safetensors[.index.json]`)."""

    @staticmethod
    def check_dir(path: str | Path) -> Path:
        """The directory, if it looks like a checkpoint (exists, has config.json); else a clear error."""
        path = Path(path).expanduser()
        if not path.exists():
            raise MoectlError(f"model path {path} does not exist")
        if not path.is_dir():
            raise MoectlError(f"{path} is not a directory; --model takes a checkpoint directory or a recipe name")
        if not (path / "config.json").exists() and path.suffix.lower() == ".gguf":    # a name says what was meant
            raise MoectlError(f"{path} is a directory, not a GGUF file (--model takes a .gguf file, a checkpoint "
                              "directory with config.json, or a recipe name)")
        if not (path / "config.json").exists():
            raise MoectlError(f"{path} is not a Hugging Face checkpoint: it has no config.json")
        return path

    def __init__(self, path: str | Path):
        self.path = self.check_dir(path)
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
                raise MoectlError(f"{self.path} has only PyTorch .bin weights; moectl reads safetensors checkpoints "
                                  f"(convert with `model.save_pretrained(dir)` once)")
            raise MoectlError(f"{self.path} has no *.safetensors weight files")
        self._fds: dict[Path, int] = {}
        self.ranges: dict[str, ByteRange] = {}
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise MoectlError(f"{index} is not a valid safetensors index ({e})") from None
            for fname in sorted(set(weight_map.values())):
                if not (self.path / fname).exists():
                    raise MoectlError(f"shard {fname} named in {index.name} is missing from {self.path}")
            shards = [self.path / fname for fname in sorted(set(weight_map.values()))]
        for f in shards:
            self.ranges.update(parse_header(f))

    def keys(self) -> list[str]:
        return list(self.ranges)

    def __contains__(self, key: str) -> bool:
        return key in self.ranges

    def files(self) -> list[Path]:
        return sorted({r.file for r in self.ranges.values()})

    def range(self, key: str, row: int | None = None) -> ByteRange:
        """Byte range of `key`, or of `key[row]` for a fused [E, ...] tensor (rows are contiguous)."""
        try:
            r = self.ranges[key]
        except KeyError:
            raise MoectlError(f"checkpoint {self.path} has no tensor {key!r}") from None
        if row is None:
            return r
        if not r.shape or not 0 <= row < r.shape[0]:
            raise MoectlError(f"{key} in {r.file.name} has shape {r.shape}: no row {row}")
        step = r.nbytes // r.shape[0]
        return ByteRange(r.file, r.offset + row * step, step, r.dtype, r.shape[1:])

    def _fd(self, file: Path) -> int:
        fd = self._fds.get(file)
        if fd is None:
            try:
                fd = self._fds[file] = os.open(file, os.O_RDONLY)
            except OSError as e:
                raise MoectlError(f"cannot open shard {file}: {e}") from None
        return fd

    def cached(self, ranges: list[ByteRange]) -> bool:
        """Whether the first page of `ranges` and their last are in the page cache (a warm file; see
        `in_page_cache`)."""
        first, last = ranges[0], ranges[-1]
        return in_page_cache(self._fd(first.file), first.offset) and \
            in_page_cache(self._fd(last.file), last.offset + max(last.nbytes - 4096, 0))

    def read_into(self, r: ByteRange, buf: memoryview) -> None:
        """The bytes of `r` into `buf` (len(buf) == r.nbytes) with as few positioned reads as the OS allows."""
        fd = self._fd(r.file)
        done = 0
        while done < r.nbytes:                  # preadv may return short counts (signals, >2 GB requests)
            try:
                n = read_at(fd, buf[done:], r.offset + done)
            except OSError as e:
                raise MoectlError(f"cannot read shard {r.file}: {e}") from None
            if n <= 0:
                raise MoectlError(f"cannot read shard {r.file}: it ended at byte {r.offset + done} "
                                  f"(the file is corrupt or truncated)")
            done += n

    def get(self, key: str, row: int | None = None) -> torch.Tensor:
        """A fresh tensor with the contents of `key` (or `key[row]`), in its on-disk dtype."""
        r = self.range(key, row)
        t = torch.empty(r.shape, dtype=r.dtype)
        if r.nbytes:
            self.read_into(r, byte_view(t))
        return t

    def shape(self, key: str) -> list[int]:
        return list(self.range(key).shape)

    def close(self) -> None:
        """Close the shard files (reads reopen them)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def nbytes_by_file(self) -> dict[Path, int]:
        return {f: f.stat().st_size for f in self.files()}
