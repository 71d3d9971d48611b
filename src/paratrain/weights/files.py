"""Initial weights from a checkpoint on disk, read a slice at a time.

Accepted: a Hugging Face `save_pretrained` directory (`model.safetensors`, or shards listed by
`model.safetensors.index.json`), one `.safetensors` file (a tensor's rows read with plain file reads:
`safetensors_format`), or a `torch.save`d state dict (opened memory-mapped, so reading a tensor reads its pages
only, though those pages then count in the rank's resident set). Keys are the model's own state-dict names; a tied
weight may be stored under any of its names. Every file is opened and its header checked against its size before
training, so a truncated shard is refused by name on every rank rather than met half-way through loading.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import ParatrainError
from . import safetensors_format

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
        self.entries: dict[str, safetensors_format.Entry] = {}  # tensor name -> where it lies in its file
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
        """The file's tensor names (where each lies kept), after checking its header and that its data is all there."""
        if not file.exists():
            raise _refuse(file, "is listed in the index but missing; copy the whole checkpoint directory")
        try:
            entries, _, end = safetensors_format.read_header(file)
        except (ValueError, KeyError, OSError) as exc:
            raise _refuse(file, f"is not a complete safetensors file ({exc}); copy or write it again") from None
        size = file.stat().st_size
        if end > size:
            raise _refuse(file, f"is truncated: its header describes {end} bytes but it has {size}; "
                                "copy or write it again")
        self.entries.update(entries)
        self.shapes.update({k: e.shape for k, e in entries.items()})
        return list(entries)

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

    def read(self, name: str, index: Sequence[slice] | None = None) -> torch.Tensor:
        """The tensor, or only `index` of it (a slice per dimension): from a safetensors file, only its rows."""
        if self._torch is not None:
            whole = self._torch[name]
            return (whole[tuple(index)] if index is not None else whole).clone()
        return safetensors_format.read(self.files[name], self.entries[name], index)
