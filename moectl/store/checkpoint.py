"""Read a Hugging Face checkpoint directory's safetensors shards, one tensor at a time.

Nothing here loads a whole shard: `safe_open` memory-maps the file and `get_tensor` / `get_slice`
copy out only what is asked for, so peak host memory stays near what the caller keeps.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import MoectlError


class Checkpoint:
    """Key -> shard index over a checkpoint directory (`model.safetensors[.index.json]`)."""

    @staticmethod
    def check_dir(path: str | Path) -> Path:
        """The directory, if it looks like a checkpoint (exists, has config.json); else a clear error."""
        path = Path(path).expanduser()
        if not path.exists():
            raise MoectlError(f"model path {path} does not exist")
        if not path.is_dir():
            raise MoectlError(f"{path} is not a directory; --model takes a checkpoint directory or a recipe name")
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
        self._handles: dict[Path, object] = {}
        self.key_to_file: dict[str, Path] = {}
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise MoectlError(f"{index} is not a valid safetensors index ({e})") from None
            for key, fname in weight_map.items():
                f = self.path / fname
                if not f.exists():
                    raise MoectlError(f"shard {f.name} named in {index.name} is missing from {self.path}")
                self.key_to_file[key] = f
        else:
            for f in shards:
                for key in self._open(f).keys():
                    self.key_to_file[key] = f

    def _open(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises SafetensorError / OSError on a corrupt header
                raise MoectlError(f"cannot read shard {f}: {e} (the file is corrupt or truncated)") from None
            self._handles[f] = h
        return h

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self.key_to_file

    def _file(self, key: str) -> Path:
        try:
            return self.key_to_file[key]
        except KeyError:
            raise MoectlError(f"checkpoint {self.path} has no tensor {key!r}") from None

    def get(self, key: str) -> torch.Tensor:
        f = self._file(key)
        try:
            return self._open(f).get_tensor(key)
        except MoectlError:
            raise
        except Exception as e:
            raise MoectlError(f"cannot read {key} from shard {f}: {e} (the file is corrupt or truncated)") from None

    def get_row(self, key: str, index: int) -> torch.Tensor:
        """`tensor[index]` of a fused [E, ...] tensor, reading only that expert's bytes."""
        f = self._file(key)
        try:
            return self._open(f).get_slice(key)[index]
        except MoectlError:
            raise
        except Exception as e:
            raise MoectlError(f"cannot read {key}[{index}] from shard {f}: {e} (corrupt or truncated?)") from None

    def shape(self, key: str) -> list[int]:
        return list(self._open(self._file(key)).get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        return self._open(self._file(key)).get_slice(key).get_dtype()

    def nbytes_by_file(self) -> dict[Path, int]:
        return {f: f.stat().st_size for f in set(self.key_to_file.values())}
