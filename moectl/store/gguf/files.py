"""Open a GGUF file (or the parts of a split one) in place: metadata, and where every tensor's bytes are.

Legend: N = bytes of one tensor.

`gguf.GGUFReader` parses the header and memory-maps each file; nothing is read until a tensor's bytes are used
(its per-element walk of metadata arrays is replaced by whole-array reads: a large vocabulary opens in ~1 s).
A split model (`name-00001-of-00003.gguf`, as `llama-gguf-split` and llama.cpp's converter write it) is every
part: the metadata comes from part 1 (the others hold only `split.*`), the tensors from all. Each part is
checked (`split.no`, `split.count`, `split.tensors.count`), each tensor's encoding is one moectl reads and its
bytes lie inside its file, so a truncated download, a missing part or an unknown encoding is one MoectlError
naming the file (and tensor) before anything runs. The module imports no torch (sizing uses it).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

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


class _CheckedReader(GGUFReader):
    """GGUFReader that checks every tensor's encoding and extent before it makes its views (a tensor past the
    end of a truncated file would otherwise be a bare numpy reshape error)."""

    def __init__(self, path: Path):
        self.path = path
        # copy-on-write: views are writable numpy arrays (torch.from_numpy takes them without a warning); the
        # file is never written, pages stay the page cache's until something writes one
        super().__init__(path, "c")

    def _get_field_parts(self, orig_offs, raw_type):
        """Arrays whole: gguf's reader walks them one element at a time (a 152k-token vocabulary with its
        merges took 17 s to open on the shared test machine); same parts for strings, one part for numbers."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        sub, n, offs = GGUFValueType(int(item_type[0])), int(count[0]), orig_offs + 12
        numbers = self.gguf_scalar_to_np.get(sub)
        if numbers is not None:
            values = self._get(offs, numbers, n)
            return 12 + int(values.nbytes), [item_type, count, values], [2], [GGUFValueType.ARRAY, sub]
        if sub != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        parts = [item_type, count]
        for _ in range(n):
            (length,) = struct.unpack_from("<Q", self.data, offs)
            parts.append(self.data[offs + 8:offs + 8 + length])
            offs += 8 + length
        return offs - orig_offs, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, sub]

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode("utf-8", "replace")
            shape = tuple(int(d) for d in reversed(dims.tolist()))
            where = f"{self.path}: tensor {name}"
            code = check_supported(int(raw_type[0]), where)
            end = int(start_offs) + int(offset[0]) + packed_nbytes(code, shape, where)
            if end > size:
                raise MoectlError(f"{self.path} is truncated: tensor {name} ends at byte {end:,} but the file has "
                                  f"{size:,} bytes (an incomplete download?)")
        super()._build_tensors(start_offs, fields)


def _read(path: Path) -> GGUFReader:
    try:
        reader = _CheckedReader(path)
    except MoectlError:
        raise
    except OSError as e:
        raise MoectlError(f"cannot read {path}: {e}") from None
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError):
        raise MoectlError(f"{path} is not a readable GGUF file ({_header_problem(path)})") from None
    if reader.byte_order == "S":
        raise MoectlError(f"{path} is a big-endian GGUF; moectl reads little-endian files (llama.cpp's default)")
    return reader


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
    """A metadata field as Python: str, int, float, bool, or a list of them. A float32 is its shortest decimal
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


class GgufFiles:
    """The metadata (`meta`: key -> value, part 1's) and the tensor table (`tensors`: name -> TensorEntry) of a
    GGUF model, its files memory-mapped (copy-on-write, never written)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise MoectlError(f"GGUF file {path} does not exist")
        self.paths = split_parts(path)
        self.readers = [_read(p) for p in self.paths]
        # only part 1's keys: the others repeat `general.architecture`-less `split.*` keys
        self.meta = {k: field_value(f) for k, f in self.readers[0].fields.items() if not k.startswith("GGUF.")}
        self.tensors: dict[str, TensorEntry] = {}
        for p, r in zip(self.paths, self.readers):
            for t in r.tensors:
                if t.name in self.tensors:
                    raise MoectlError(f"tensor {t.name} is in both {self.tensors[t.name].file} and {p}")
                self.tensors[t.name] = TensorEntry(t.name, p, int(t.data_offset), int(t.n_bytes), int(t.tensor_type),
                                                   tuple(int(d) for d in reversed(t.shape.tolist())))
        self._check_split()
        if "general.architecture" not in self.meta:
            raise MoectlError(f"{self.paths[0]} has no general.architecture in its metadata")
        self.arch: str = self.meta["general.architecture"]
        self._maps = {p: r.data for p, r in zip(self.paths, self.readers)}

    def _check_split(self) -> None:
        if len(self.paths) == 1:
            return
        for i, (p, r) in enumerate(zip(self.paths, self.readers)):
            no, count = (field_value(r.fields[k]) if k in r.fields else None for k in ("split.no", "split.count"))
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
