"""GgufModel: everything moectl reads from one GGUF model, opened once (what `--model x.gguf` will hold).

    g = GgufModel(path)                 # parse the header(s), memory-map the file(s); checks (files.py, config.py)
    g.family, g.config, g.index         # moectl family, transformers config, ExpertIndex
    g.tokenizer()                       # transformers' GGUF tokenizer converter
    g.tokenizer(cache_dir)              # the same, saved there once and read back by later runs
    g.saved_tokenizer(cache_dir)        # that saved one read without transformers (tokenizer.py), or None
    g.sizes(2)                          # header-only figures for inspect / sizing (dense at 2 bytes/weight)
    g.dense_state_dict(skeleton, dtype) # dense tensors dequantised once, under the skeleton's names
    g.dense_in_place(skeleton)          # or, on the CPU with ggml, the matrices where they lie in the mapped file
    g.expert_formats(dtype)             # {layer: GgufExpertFormat}: the packed experts' "full" precision
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...core.recipes import is_gguf_path, model_name
from ...errors import MoectlError
from ...formats.gguf import GgufExpertFormat, layer_formats
from ...formats.gguf_encodings import encoding_name
from .config import family_of, gguf_config, gguf_tokenizer
from .dense import dense_in_place, dense_state_dict, dense_tensors
from .experts import ExpertIndex, held_dense_bytes
from .files import GgufFiles
from .tokenizer import SavedTokenizer, saved_tokenizer, tokenizer_key

is_gguf = is_gguf_path          # whether `--model` names a GGUF file (a directory is a safetensors checkpoint)
_OPEN: dict[tuple, "GgufModel"] = {}


def open_gguf(path: str | Path) -> "GgufModel":
    """The GgufModel of `path`, parsed once per process (inspect, sizing and load each ask for it; parsing a
    152k-token vocabulary takes seconds). Keyed by the file's path, size and mtime: a rewritten file is re-read."""
    p = Path(path).expanduser().resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise MoectlError(f"cannot read GGUF file {p}: {e}") from None
    key = (p, st.st_size, st.st_mtime_ns)
    if key not in _OPEN:
        _OPEN.clear()                             # one model at a time: drop the previous file's maps
        _OPEN[key] = GgufModel(p)
    return _OPEN[key]


class GgufModel:
    def __init__(self, path: str | Path):
        self.files = GgufFiles(path)
        self.family = family_of(self.files)
        self.config = gguf_config(self.files)
        self.index = ExpertIndex(self.files)
        # the experts' encodings, layer by layer, in the config: the fingerprint every artifact records sees them,
        # so a plan or trace made on a Q4_K_M file is not silently used with its Q8_0 (same config otherwise)
        self.config.gguf_expert_encodings = ",".join(
            "+".join(encoding_name(t.encoding) for _, t in self.index.parts(l, 0)) for l in self.index.layers)
        self.config.gguf_expert_nbytes = self.index.slot_nbytes()    # the simulator's expert size (sim/cost.py)
        self.config._name_or_path = model_name(self.path)               # shapes and messages name the model

    @property
    def path(self) -> Path:
        return self.files.paths[0]

    def tokenizer(self, cache: Path | None = None):
        """The tokenizer the metadata describes. With `cache` (a directory: the model's workdir keeps one), the
        first call also saves it there (transformers' `save_pretrained`: tokenizer.json and its config) and later
        processes read that instead: ~0.25 s, not the ~0.8 s of converting a 152k-token vocabulary from the
        metadata (the shared 2-core machine). The cache is used only for this very file (its path, size and
        mtime) and these transformers and tokenizers versions, recorded in `source.json`, written last (an
        interrupted save is rebuilt); one that cannot be written or read is rebuilt, never an error."""
        if cache is None:
            return gguf_tokenizer(self.files)
        key = self._tokenizer_key()
        cache = Path(cache)
        source = cache / "source.json"
        try:
            if json.loads(source.read_text()) == key:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(cache)
        except Exception:                       # none yet, another file's, or unreadable: built again
            pass
        tok = gguf_tokenizer(self.files)
        try:
            source.unlink(missing_ok=True)
            tok.save_pretrained(cache)
            source.write_text(json.dumps(key))
        except OSError:                         # a read-only workdir: this run is as before
            pass
        return tok

    def saved_tokenizer(self, cache: Path) -> SavedTokenizer | None:
        """The tokenizer `tokenizer(cache)` saved for this file, read with the tokenizers library alone (no
        transformers import: moectl/store/gguf/tokenizer.py); None when there is none valid for this file and these
        versions, or it holds what that reader does not reproduce: then call `tokenizer(cache)`."""
        return saved_tokenizer(Path(cache), self.files.paths)

    def _tokenizer_key(self) -> dict:
        import tokenizers
        import transformers

        return tokenizer_key(self.files.paths, transformers.__version__, tokenizers.__version__)

    def sizes(self, dense_bytes_per_weight: int = 2, mapped: frozenset = frozenset()) -> dict:
        """`ExpertIndex.sizes()` (experts packed, as stored) plus what a run holds in host RAM with the experts in
        RAM: the packed experts and the dense tensors dequantised once (`dense_bytes_per_weight`: 2 for bf16), but
        the `mapped` ones (GGUF names, `dense_in_place`) at their bytes in the file."""
        s = self.index.sizes(frozenset(mapped))
        dense = held_dense_bytes(s, dense_bytes_per_weight)
        return s | {"family": self.family, "architecture": self.files.arch, "files": [str(p) for p in self.files.paths],
                    "file_bytes": sum(p.stat().st_size for p in self.files.paths), "dense_bytes": dense,
                    "host_bytes_ram_tier": s["expert_bytes"] + dense}

    def dense_state_dict(self, model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return dense_state_dict(self.files, model, dtype)

    def dense_tensors(self, model, dtype_of, skip=()):
        """(name, tensor) one at a time, each in `dtype_of(name)`, but those in `skip` (moectl/store/gguf/dense.py)."""
        return dense_tensors(self.files, model, dtype_of, skip)

    def dense_in_place(self, model) -> dict[str, tuple]:
        """The dense matrices ggml can compute where they lie in the mapped file (moectl/store/gguf/dense.py)."""
        return dense_in_place(self.files, model)

    def expert_formats(self, dtype: torch.dtype) -> dict[int, GgufExpertFormat]:
        return layer_formats(self.index, self.family, dtype)
