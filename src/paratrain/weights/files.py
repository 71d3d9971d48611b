"""Initial weights from a checkpoint on disk, read a slice at a time.

Accepted: a Hugging Face `save_pretrained` directory (`model.safetensors`, or shards listed by
`model.safetensors.index.json`), one `.safetensors` file, or a `torch.save`d state dict (opened memory-mapped, so
reading a tensor reads its pages only). Keys are the model's own state-dict names; a tied weight may be stored
under any of its names. Every file is opened and its header checked against its size before training, so a
truncated shard is refused by name on every rank rather than met half-way through loading.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ParatrainError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _refuse(path: Path, what: str) -> ParatrainError:
    return ParatrainError(f"init_from={str(path)!r}: {what}")


class Checkpoint:
    """The tensors of one checkpoint by name, opened lazily."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.files: dict[str, Path] = {}  # tensor name -> file
        self.shapes: dict[str, tuple[int, ...]] = {}  # tensor name -> shape, from the headers
        self._open: dict[Path, Any] = {}
        self._torch: dict[str, torch.Tensor] | None = None
        if self.path.is_dir():
            self._directory()
        elif not self.path.exists():
            raise _refuse(self.path, "no such file or directory; give a save_pretrained directory, a .safetensors "
                                     "file or a torch.save'd state dict")
        elif self.path.suffix == ".safetensors":
            self._safetensors(self.path)
        else:
            self._torch_file()

    def _directory(self) -> None:
        index, single = self.path / INDEX, self.path / SINGLE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise _refuse(index, f"is not a safetensors index ({exc}); write it again with save_pretrained "
                                     "or run.export") from None
            for name, file in weight_map.items():
                self.files[name] = self.path / file
            for file in sorted(set(self.files.values())):
                self._header(file)
        elif single.exists():
            self._safetensors(single)
        else:
            found = sorted(p.name for p in self.path.iterdir())[:8]
            raise _refuse(self.path, f"holds neither {SINGLE} nor {INDEX} (it holds {found}); give the directory "
                                     "save_pretrained or run.export wrote, or one weights file")

    def _safetensors(self, file: Path) -> None:
        for name in self._header(file):
            self.files[name] = file

    def _header(self, file: Path) -> list[str]:
        """The file's tensor names (their shapes kept), after checking its header and that its data is all there."""
        if not file.exists():
            raise _refuse(file, "is listed in the index but missing; copy the whole checkpoint directory")
        size = file.stat().st_size
        try:
            with open(file, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                if length <= 0 or 8 + length > size:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(length))
        except (ValueError, OSError) as exc:
            raise _refuse(file, f"is not a complete safetensors file ({exc}); copy or write it again") from None
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + length + end > size:
            raise _refuse(file, f"is truncated: its header describes {8 + length + end} bytes but it has {size}; "
                                "copy or write it again")
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        self.shapes.update({k: tuple(v["shape"]) for k, v in tensors.items()})
        return list(tensors)

    def _torch_file(self) -> None:
        try:
            state = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise _refuse(self.path, f"cannot be read as a torch.save'd state dict ({type(exc).__name__}: {exc}); "
                                     "give a save_pretrained directory, a .safetensors file or a state dict "
                                     "saved with torch.save") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise _refuse(self.path, "holds no state dict of tensors; save model.state_dict() with torch.save")
        self._torch = state
        self.files = dict.fromkeys(state, self.path)
        self.shapes = {k: tuple(v.shape) for k, v in state.items()}

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._open[file]

    def read(self, name: str, index: Sequence[slice] | None = None) -> torch.Tensor:
        """The tensor, or only `index` of it (a slice per dimension): a safetensors slice reads those bytes."""
        if self._torch is not None:
            whole = self._torch[name]
            return (whole[tuple(index)] if index is not None else whole).clone()
        handle = self._handle(name)
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[tuple(index)]
