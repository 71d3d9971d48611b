"""`run.export`: the whole model's weights under their original names, as Hugging Face writes them, from any layout.

No rank gathers the model: each tensor is made whole on its own (`full_tensor()`, one collective over the ranks that
share it) and written by one rank that holds it straight into its file (the header, known from the shapes, goes
first), files of at most `max_shard_bytes`; rank 0 then names the files `model-0000i-of-0000n.safetensors` with
their index (one file: `model.safetensors`) and writes a Hugging Face model's config beside them. Every name of the
state dict is written, a tied weight under each of its names, so `load_state_dict` takes the files as they are and
`from_pretrained` ties them again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives
from . import safetensors_format
from .files import INDEX, SINGLE
from .names import saved_names

PREFIX = ".export-part-"


def _writes(t: torch.Tensor) -> bool:
    """This rank may write the tensor: it holds it whole, or is the first of the ranks sharing it."""
    if not hasattr(t, "device_mesh"):
        return True
    coordinate = t.device_mesh.get_coordinate()
    return coordinate is not None and all(c == 0 for c in coordinate)


def _files(mine: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Size, torch.dtype]]]:
    """The tensors this rank writes, in order, cut into files of at most `limit` bytes (a bigger tensor alone)."""
    files: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    size = 0
    for name, t in mine:
        nbytes = t.numel() * t.element_size()
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append((name, t.shape, t.dtype))
        size += nbytes
    return [f for f in files if f]


class _Walk:
    """Every tensor this rank holds made whole in turn (a collective among the ranks sharing it, so all of them walk
    the same order), kept only while the file being written takes it."""

    def __init__(self, mine: list[tuple[str, torch.Tensor]]) -> None:
        self._rest = iter(mine)

    def until(self, name: str) -> torch.Tensor:
        for held, t in self._rest:
            whole = t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[operator]
            if held == name:
                return whole  # type: ignore[no-any-return]
        raise KeyError(name)

    def finish(self) -> None:
        for _, t in self._rest:
            if hasattr(t, "full_tensor"):
                t.full_tensor()  # type: ignore[operator]


def export(held: nn.Module, original: nn.Module, path: str | os.PathLike[str], rank: int,
           max_shard_bytes: int) -> Path:
    """Write `held` (this rank's part of the model, in the original names) to `path`; collective."""
    folder = Path(path)
    order = {name: i for i, name in enumerate(original.state_dict(keep_vars=True))}
    saved = saved_names(original)
    mine = [(n, t) for n, t in (*held.named_parameters(remove_duplicate=False),
                                *held.named_buffers(remove_duplicate=False)) if n in saved]
    mine.sort(key=lambda item: order.get(item[0], len(order)))
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.safetensors"):
            if old.name.startswith(("model", PREFIX)):
                old.unlink()
        (folder / INDEX).unlink(missing_ok=True)
    collectives.barrier()
    offers = _gather([(n, _writes(t)) for n, t in mine])
    writer: dict[str, int] = {}
    for r, offered in enumerate(offers):
        for name, ok in offered:
            if ok:
                writer.setdefault(name, r)
    walk = _Walk(mine)
    written: list[tuple[str, list[str], int]] = []
    with torch.no_grad():
        for specs in _files([(n, t) for n, t in mine if writer.get(n) == rank], max_shard_bytes):
            file = f"{PREFIX}{rank:05d}-{len(written):05d}.safetensors"
            size = safetensors_format.write(folder / file, specs, walk.until)
            written.append((file, [name for name, _, _ in specs], size))
        walk.finish()
    parts = _gather(written)
    if rank == 0:
        _name_files(folder, [part for per_rank in parts for part in per_rank], order)
        _config(original, folder)
    collectives.barrier()
    return folder


def _gather(value: object) -> list:  # type: ignore[type-arg]
    if not collectives.active():
        return [value]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _name_files(folder: Path, parts: list[tuple[str, list[str], int]], order: dict[str, int]) -> None:
    parts.sort(key=lambda part: min(order.get(n, len(order)) for n in part[1]))
    if len(parts) == 1:
        os.replace(folder / parts[0][0], folder / SINGLE)
        return
    weight_map, total = {}, 0
    for i, (file, names, size) in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(folder / file, folder / final)
        weight_map.update(dict.fromkeys(names, final))
        total += size
    ordered = dict(sorted(weight_map.items(), key=lambda item: order.get(item[0], len(order))))
    index = {"metadata": {"total_size": total}, "weight_map": ordered}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _config(original: nn.Module, folder: Path) -> None:
    """A Hugging Face model's config (and generation config) beside its weights, so from_pretrained loads them."""
    config = getattr(original, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config.save_pretrained(folder)
    generation = getattr(original, "generation_config", None)
    if generation is not None and callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(folder)
