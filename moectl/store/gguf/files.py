"""Open a GGUF file (or the parts of a split one) in place: metadata, and where every tensor's bytes are.

Legend: N = bytes of one tensor.

The header is parsed here (`_Header`: gguf's layout, read with `struct` off the memory-mapped file) rather than by
`gguf.GGUFReader`, whose per-value numpy views made a 152k-token vocabulary (tokens and merges: 300k strings) cost
1-4 s of every load on the shared test machine, once per open. Metadata arrays are read only when a key is asked
for (`Metadata`): a run reads the vocabulary's strings when it builds the tokenizer, never to size the model
(`array_len`). The values are gguf's own (`tests/test_gguf_model.py` checks them against `GGUFReader`, and the
tensor table, key by key). The file is memory-mapped; nothing of a tensor is read until its bytes are used.
A split model (`name-00001-of-00003.gguf`, as `llama-gguf-split` and llama.cpp's converter write it) is every
part: the metadata comes from part 1 (the others hold only `split.*`), the tensors from all. Each part is
checked (`split.no`, `split.count`, `split.tensors.count`), each tensor's encoding is one moectl reads and its
bytes lie inside its file, so a truncated download, a missing part or an unknown encoding is one MoectlError
naming the file (and tensor) before anything runs. The module imports no torch (sizing uses it).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from ...errors import MoectlError
from ...formats.gguf_encodings import check_supported, packed_nbytes

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's bytes: `nbytes` at `offset` (from the start of `file`), `shape` in torch order."""

    name: str
    file: Path
    offset: int
    nbytes: int
    encoding: int
    shape: tuple[int, ...]


# gguf's metadata value types of a fixed width: their struct code and numpy type (little-endian)
SCALAR = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
          GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f",
          GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?"}
NUMPY = {t: np.dtype("<" + c) for t, c in SCALAR.items()}
U64 = struct.Struct("<Q")                   # a string's length (its bytes follow)


class _Bad(ValueError):
    """The header does not parse (said in words by `_header_problem`)."""


class Metadata(Mapping):
    """key -> value of a GGUF's metadata, in the file's order. Scalars and strings are read with the header;
    an array (a vocabulary: 152k strings) when its key is first asked for, then kept. `array_len(key)` is an
    array's length without reading it. Values as `field_value` gives them from gguf's reader."""

    def __init__(self, buf: memoryview, order: list[str], values: dict, arrays: dict):
        self._buf, self._values, self._arrays = buf, values, arrays       # arrays: key -> (offset, item type, count)
        self._order = order

    def __getitem__(self, key: str):
        if key not in self._values:
            if key not in self._arrays:
                raise KeyError(key)
            offset, item, count = self._arrays[key]
            self._values[key] = _read_array(self._buf, offset, item, count)[0]
        return self._values[key]

    def __iter__(self):
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key) -> bool:
        return key in self._values or key in self._arrays

    def array_len(self, key: str) -> int | None:
        """The number of items of array `key` (None: no such array), without reading them."""
        return self._arrays[key][2] if key in self._arrays else None


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise _Bad("a string runs past the end")
    return str(buf[pos + 8:end], "utf-8"), end


def _scalar(buf: memoryview, pos: int, kind: GGUFValueType):
    (v,) = struct.unpack_from("<" + SCALAR[kind], buf, pos)
    if kind == GGUFValueType.FLOAT32:
        v = float(str(np.float32(v)))        # its shortest decimal: 1e-05, what the converter was given
    return v, pos + struct.calcsize(SCALAR[kind])


def _read_array(buf: memoryview, pos: int, item: GGUFValueType, count: int, read: bool = True) -> tuple:
    """(the array's values as a list -- None when not `read` -- , the offset past it)."""
    if item in NUMPY:
        end = pos + count * NUMPY[item].itemsize
        if end > len(buf):
            raise _Bad("an array runs past the end")
        return (np.frombuffer(buf[pos:end], NUMPY[item]).tolist() if read else None), end
    if item == GGUFValueType.STRING:
        length = U64.unpack_from                 # variable lengths: walked one by one
        out = [] if read else None
        if read:
            for _ in range(count):
                n = length(buf, pos)[0]
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
                pos += 8 + n
        else:                                    # skipped (a vocabulary at open): lengths only, one call each
            for _ in range(count):
                pos += 8 + length(buf, pos)[0]
        if pos > len(buf):
            raise _Bad("an array runs past the end")
        return out, pos
    if item == GGUFValueType.ARRAY:              # arrays of arrays: read whole
        out = [] if read else None
        for _ in range(count):
            sub, n = struct.unpack_from("<IQ", buf, pos)
            value, pos = _read_array(buf, pos + 12, GGUFValueType(sub), n, read)
            if read:
                out.append(value)
        return out, pos
    raise _Bad(f"unknown array item type {item}")


class _Header:
    """One GGUF file's header: `meta` (Metadata), `tensors` [(name, encoding, dims in gguf order, offset)] and
    `data_start` (where the tensor data begins, aligned), checked as gguf's reader checks it."""

    def __init__(self, path: Path):
        # copy-on-write: views are writable numpy arrays (torch.from_numpy takes them without a warning); the
        # file is never written, pages stay the page cache's until something writes one
        self.data = np.memmap(path, mode="c")
        buf = memoryview(self.data)
        if struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
            raise _Bad("GGUF magic invalid")
        (version,) = struct.unpack_from("<I", buf, 4)
        self.big_endian = version & 0xFFFF == 0     # written on a big-endian host: refused by the caller
        if self.big_endian:
            return
        if version not in READER_SUPPORTED_VERSIONS:
            raise _Bad(f"GGUF version {version}")
        n_tensors, n_keys = struct.unpack_from("<QQ", buf, 8)
        pos, order, values, arrays = 24, [], {}, {}
        for _ in range(n_keys):
            key, pos = _string(buf, pos)
            if key in values or key in arrays:
                raise _Bad(f"duplicate key {key}")
            order.append(key)
            (kind,) = struct.unpack_from("<I", buf, pos)
            kind, pos = GGUFValueType(kind), pos + 4
            if kind == GGUFValueType.STRING:
                values[key], pos = _string(buf, pos)
            elif kind == GGUFValueType.ARRAY:
                item, count = struct.unpack_from("<IQ", buf, pos)
                arrays[key] = (pos + 12, GGUFValueType(item), count)
                _, pos = _read_array(buf, pos + 12, GGUFValueType(item), count, read=False)
            else:
                values[key], pos = _scalar(buf, pos, kind)
        self.tensors = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            encoding, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            self.tensors.append((name, encoding, dims, offset))
            pos += 4 + 8 * n_dims + 12
        if len({t[0] for t in self.tensors}) != len(self.tensors):
            raise _Bad("duplicate tensor names")
        self.meta = Metadata(buf, order, values, arrays)
        alignment = GGUF_DEFAULT_ALIGNMENT
        if "general.alignment" in values:
            alignment = values["general.alignment"]
            if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
                    or alignment & (alignment - 1):
                raise _Bad("general.alignment is not a power of two")
        self.data_start = -(-pos // alignment) * alignment

    def check(self, path: Path) -> None:
        """Every tensor's encoding is one moectl reads and its bytes lie inside the file."""
        size = len(self.data)
        for name, encoding, dims, offset in self.tensors:
            shape = tuple(reversed(dims))
            where = f"{path}: tensor {name}"
            code = check_supported(encoding, where)
            end = self.data_start + offset + packed_nbytes(code, shape, where)
            if end > size:
                raise MoectlError(f"{path} is truncated: tensor {name} ends at byte {end:,} but the file has "
                                  f"{size:,} bytes (an incomplete download?)")


def _read(path: Path) -> _Header:
    try:
        header = _Header(path)
    except MoectlError:
        raise
    except OSError as e:
        raise MoectlError(f"cannot read {path}: {e}") from None
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, struct.error):
        raise MoectlError(f"{path} is not a readable GGUF file ({_header_problem(path)})") from None
    if header.big_endian:
        raise MoectlError(f"{path} is a big-endian GGUF; moectl reads little-endian files (llama.cpp's default)")
    header.check(path)
    return header


# The vocabulary-sized tensors (150k x 2048 weights: 1.2 GB in fp32, and K-quant dequantisation holds several fp32
# temporaries of it) are dequantised a block of rows at a time straight into the output (`dense.py`), so a load's
# working set beyond what it keeps is one block's (`facts.gguf_load_peak`). No family's tensor processor changes them
# (they permute attention's Q/K rows and reshape the shared expert's gate): the result is the whole tensor's, bit for bit.
ROW_CHUNKED = ("token_embd.weight", "output.weight")
CHUNK_WEIGHTS = 1 << 22                 # weights dequantised at a time: 16 MB of fp32

GGUF_HEADER_BYTES = 24                      # magic, version, tensor count, metadata count (gguf's own layout)


def _header_problem(path: Path) -> str:
    """What is wrong with a file the GGUF reader could not parse, in words (not numpy's words on the reader's
    internals): empty, not a GGUF, a header cut short, or metadata that runs past the end or does not parse."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if size == 0:
        return "the file is empty"
    if magic != b"GGUF":
        return f"not a GGUF file: it starts with {magic!r}, a GGUF with b'GGUF'"
    if size < GGUF_HEADER_BYTES:
        return (f"truncated GGUF header: the file has {size} bytes, the header alone takes {GGUF_HEADER_BYTES}; "
                "an incomplete download?")
    return (f"truncated or corrupt header: its metadata runs past the file's {size:,} bytes or does not parse; "
            "an incomplete download?")


def field_value(field):
    """A `gguf.GGUFReader` metadata field as Python (`Metadata`'s values are these; the tests compare them): str,
    int, float, bool, or a list of them. A float32 is its shortest decimal
    (1e-05, not 9.999999747378752e-06: what the converter was given, and the same float32 in the model)."""
    if field.types == [GGUFValueType.FLOAT32]:
        return float(str(np.float32(field.contents())))
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return [field.contents(i) for i in range(len(field.data))] if field.types[-1] == GGUFValueType.STRING \
            else list(field.contents())
    return field.contents()


def split_parts(path: Path) -> list[Path]:
    """All parts of the model `path` belongs to (just `path` when it is not split); a missing part is an error."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise MoectlError(f"{path.name} is part of a model split in {count} files; missing next to it in "
                          f"{path.parent}: {', '.join(missing)}")
    return parts


def source_key(paths, packages: dict[str, str | None]) -> dict:
    """What a thing saved in the workdir for a GGUF (its config, its tokenizer) is valid for: each of its files
    (`paths`: the file or split parts) as it is now ([path, size, mtime_ns]: a rewritten or moved file is another)
    and the versions of `packages` ({name: version}; None: the installed distribution's, read by importlib.metadata
    without importing the package; a package not installed: None)."""
    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    stats = [(Path(p), Path(p).stat()) for p in paths]
    return {"files": [[str(p), st.st_size, st.st_mtime_ns] for p, st in stats],
            **{name: given or installed(name) for name, given in packages.items()}}


class GgufFiles:
    """The metadata (`meta`: key -> value, part 1's) and the tensor table (`tensors`: name -> TensorEntry) of a
    GGUF model, its files memory-mapped (copy-on-write, never written)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise MoectlError(f"GGUF file {path} does not exist")
        self.paths = split_parts(path)
        headers = [_read(p) for p in self.paths]
        # only part 1's keys: the others repeat `general.architecture`-less `split.*` keys
        self.meta: Metadata = headers[0].meta
        self._part_meta = [h.meta for h in headers]
        self.tensors: dict[str, TensorEntry] = {}
        for p, h in zip(self.paths, headers):
            for name, encoding, dims, offset in h.tensors:
                if name in self.tensors:
                    raise MoectlError(f"tensor {name} is in both {self.tensors[name].file} and {p}")
                block, block_bytes = GGML_QUANT_SIZES[encoding]
                self.tensors[name] = TensorEntry(name, p, h.data_start + offset,
                                                 math.prod(dims) * block_bytes // block, encoding,
                                                 tuple(reversed(dims)))
        self._check_split()
        if "general.architecture" not in self.meta:
            raise MoectlError(f"{self.paths[0]} has no general.architecture in its metadata")
        self.arch: str = self.meta["general.architecture"]
        self._maps = {p: h.data for p, h in zip(self.paths, headers)}

    def _check_split(self) -> None:
        if len(self.paths) == 1:
            return
        for i, (p, meta) in enumerate(zip(self.paths, self._part_meta)):
            no, count = (meta.get(k) for k in ("split.no", "split.count"))
            if (no, count) != (i, len(self.paths)):
                said = f"part {no + 1} of {count}" if no is not None else "no split part (no split.no key)"
                raise MoectlError(f"{p} says it is split {said}, but its name says part {i + 1} of "
                                  f"{len(self.paths)}")
        want = self.meta.get("split.tensors.count")
        if want is not None and want != len(self.tensors):
            raise MoectlError(f"{self.paths[0]} says the split model has {want} tensors; its "
                              f"{len(self.paths)} parts hold {len(self.tensors)}")

    def get(self, key: str, default=None, required: bool = False):
        """Metadata `key` ('{arch}.' is replaced by the architecture), or a MoectlError naming it if required."""
        key = key.replace("{arch}", self.arch)
        if key not in self.meta:
            if required:
                raise MoectlError(f"{self.paths[0]} has no metadata key {key} (needed for a {self.arch} model)")
            return default
        return self.meta[key]

    def entry(self, name: str) -> TensorEntry:
        if name not in self.tensors:
            raise MoectlError(f"{self.paths[0]} ({self.arch}) has no tensor {name}")
        return self.tensors[name]

    def read(self, file: Path, offset: int, nbytes: int) -> np.ndarray:
        """uint8 [N], a copy read by positioned reads (the memory map's pages are not touched: they would stay in
        the process's RSS while the file is mapped)."""
        out = np.empty(nbytes, dtype=np.uint8)
        view, done = memoryview(out), 0
        with open(file, "rb", buffering=0) as f:
            while done < nbytes:
                n = os.preadv(f.fileno(), [view[done:]], offset + done)
                if n <= 0:
                    raise MoectlError(f"cannot read {file}: it ended at byte {offset + done} (truncated)")
                done += n
        return out

    def bytes_of(self, file: Path, offset: int, nbytes: int) -> np.ndarray:
        """uint8 [N] view of the memory map (no copy)."""
        return self._maps[file][offset:offset + nbytes]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def will_need(self) -> None:
        """Ask the kernel to read the mapped files into the page cache now, in the background (MADV_WILLNEED:
        readahead, nothing waits, nothing enters the process's RSS). A run that computes where the weights lie
        touches every expert within its first tokens; without this each first touch of a page not cached is a
        read from disk inside a token (llama.cpp reads the whole file at load: MAP_POPULATE)."""
        for m in self._maps.values():
            mm = getattr(m, "_mmap", None)
            if mm is not None and hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_WILLNEED)
