"""`run.export`: the whole model's weights under their original names, as Hugging Face writes them, from any layout.

No rank gathers the model, and nothing is sent: every rank knows every tensor's name, shape and dtype (one small
gather), so all of them compute the same files (at most `max_shard_bytes` each, `model-0000i-of-0000n.safetensors`
with an index, or `model.safetensors`) and where each tensor's bytes lie in them; rank 0 writes the headers and
sizes the files, and each rank then writes the blocks it holds where they lie (a DTensor's local block, once per
replicated copy; a pipeline stage's tensors; an FSDP shard's rows; a strided split's several regions, such as a
fused projection's parts: `checkpoint.strided.regions`). So a rank's peak is its share: nothing is made whole.
Every name of the state dict is written, a tied weight under each of its names, so `load_state_dict` takes the
files as they are and `from_pretrained` ties them again; a Hugging Face model's config goes beside them. The ranks
must share the folder (one file system), as they share a checkpoint's.

A LoRA model (peft) is written as `PeftModel.save_pretrained` writes it, adapters only (`_export_adapters`):
`adapter_model.safetensors` in peft's names and `adapter_config.json`, which `PeftModel.from_pretrained(base, path)`
loads; `adapters_only=False` writes the whole model as above, in the wrapped model's names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives
from ..errors import ParatrainError
from . import lora, safetensors_format
from .files import INDEX, SINGLE
from .names import saved_names


def _writes(t: torch.Tensor) -> bool:
    """This rank may write the tensor: it holds it whole, or is the first of the ranks sharing it."""
    if not hasattr(t, "device_mesh"):
        return True
    coordinate = t.device_mesh.get_coordinate()
    return coordinate is not None and all(c == 0 for c in coordinate)


def _files(specs: list[tuple[str, tuple[torch.Size, torch.dtype]]],
           limit: int) -> list[list[tuple[str, torch.Size, torch.dtype]]]:
    """Tensors in order, cut into files of at most `limit` bytes (a bigger tensor alone): the same on every rank."""
    files: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    size = 0
    for name, (shape, dtype) in specs:
        nbytes = shape.numel() * dtype.itemsize
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append((name, shape, dtype))
        size += nbytes
    return [f for f in files if f]


def _offered(mine: list[tuple[str, torch.Tensor]], extra: Any = None) -> tuple[
        list[Any], dict[str, tuple[torch.Size, torch.dtype]], dict[str, int]]:
    """Collective: every rank's `extra`, every tensor's shape and dtype, and the rank that writes each tensor that
    one rank writes whole (the first offering it)."""
    offers = _gather((extra, [(n, tuple(t.shape), t.dtype, _writes(t)) for n, t in mine]))
    specs: dict[str, tuple[torch.Size, torch.dtype]] = {}
    writer: dict[str, int] = {}
    for r, (_, offered) in enumerate(offers):
        for name, shape, dtype, ok in offered:
            specs.setdefault(name, (torch.Size(shape), dtype))
            if ok:
                writer.setdefault(name, r)
    return [e for e, _ in offers], specs, writer


def _write_in_place(folder: Path, files: list[tuple[str, list[tuple[str, torch.Size, torch.dtype]]]],
                    mine: list[tuple[str, torch.Tensor]], writer: dict[str, int], rank: int) -> None:
    """Collective: rank 0 writes each file's header and sizes it, then every rank writes its blocks where they lie."""
    start: dict[str, tuple[str, int]] = {}
    for title, members in files:
        head, starts, size = safetensors_format.layout(members)
        start.update({n: (title, starts[n]) for n, _, _ in members})
        if rank == 0:
            with open(folder / title, "wb") as f:
                f.write(head)
                f.truncate(size)
    collectives.barrier()  # every file exists at its size: each rank writes its pieces into them
    handles: dict[str, int] = {}
    try:
        with torch.no_grad():
            for name, t in mine:
                title, offset = start[name]
                if title not in handles:
                    handles[title] = os.open(folder / title, os.O_WRONLY)
                _write(handles[title], offset, t, writer.get(name) == rank)
    finally:
        for fd in handles.values():
            os.close(fd)
    collectives.barrier()


def export(held: nn.Module, original: nn.Module, path: str | os.PathLike[str], rank: int,
           max_shard_bytes: int, adapters_only: bool | None = None) -> Path:
    """Write `held` (this rank's part of the model, in the original names) to `path`; collective. A LoRA model's
    adapters alone, as peft writes them, unless `adapters_only` is False (None: when the model has adapters)."""
    root = lora.peft_root(original)
    if adapters_only is None:
        adapters_only = root is not None
    if adapters_only:
        if root is None:
            raise ParatrainError(f"run.export(adapters_only=True): {type(original).__name__} has no peft adapters "
                                 "(no module with a peft_config); leave adapters_only unset to export the model")
        return _export_adapters(held, original, root, Path(path), rank)
    folder = Path(path)
    order = {name: i for i, name in enumerate(original.state_dict(keep_vars=True))}
    saved = saved_names(original)
    mine = [(n, t) for n, t in (*held.named_parameters(remove_duplicate=False),
                                *held.named_buffers(remove_duplicate=False)) if n in saved]
    mine.sort(key=lambda item: order.get(item[0], len(order)))
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("model*.safetensors"):
            old.unlink()
        (folder / INDEX).unlink(missing_ok=True)
    orders, specs, writer = _offered(mine, list(order))
    order = {name: i for i, name in enumerate(_merged(orders))}
    names = sorted(specs, key=lambda n: order.get(n, len(order)))
    files = _files([(n, specs[n]) for n in names], max_shard_bytes)
    titles = [SINGLE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                               for i in range(len(files))]
    _write_in_place(folder, list(zip(titles, files)), mine, writer, rank)
    if rank == 0:
        if len(files) > 1:
            _index(folder, titles, files, order)
        _config(original, folder)
    collectives.barrier()
    return folder


def _merged(orders: list[list[str]]) -> list[str]:
    """One order of every rank's state-dict names, each rank's own order kept: a rank that holds only some of the
    model (its experts, its stages) lists a subsequence, and each name it alone holds goes after the one it follows
    there. The same on every rank, so all of them lay out the files alike."""
    merged = list(orders[0])
    at = {name: i for i, name in enumerate(merged)}
    for names in orders[1:]:
        previous = None
        for name in names:
            if name not in at:
                merged.insert(at[previous] + 1 if previous is not None else 0, name)
                at = {n: i for i, n in enumerate(merged)}
            previous = name
    return merged


def _write(fd: int, offset: int, t: torch.Tensor, writes_whole: bool) -> None:
    """This rank's part of one tensor into its file: a DTensor's blocks where they lie in the whole (a plain split's
    one block, a strided split's several; one copy of a replicated block); any other tensor whole, by its one
    writer. No collective."""
    placements = getattr(t, "placements", None)
    if placements is None:
        if writes_whole:
            safetensors_format.write_piece(fd, offset, t.shape, t, [0] * t.dim())
        return
    from torch.distributed.tensor import Replicate

    from ..checkpoint.strided import regions

    coordinate = t.device_mesh.get_coordinate()  # type: ignore[attr-defined]
    if coordinate is None or any(c and isinstance(p, Replicate) for c, p in zip(coordinate, placements)):
        return  # another rank writes this copy of the block
    local = t.to_local()  # type: ignore[attr-defined]
    for whole_at, local_at, sizes in regions(t):  # one block, or a strided split's several (a fused projection's)
        block = local[tuple(slice(o, o + n) for o, n in zip(local_at, sizes))]
        safetensors_format.write_piece(fd, offset, t.shape, block, whole_at)


def _gather(value: object) -> list:  # type: ignore[type-arg]
    if not collectives.active():
        return [value]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _index(folder: Path, titles: list[str], files: list[list[tuple[str, torch.Size, torch.dtype]]],
           order: dict[str, int]) -> None:
    weight_map = {name: title for title, members in zip(titles, files) for name, _, _ in members}
    total = sum(shape.numel() * dtype.itemsize for members in files for _, shape, dtype in members)
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


def _export_adapters(held: nn.Module, original: nn.Module, root: tuple[str, nn.Module], folder: Path,
                     rank: int) -> Path:
    """Each adapter of a LoRA model as `PeftModel.save_pretrained` writes it: `adapter_model.safetensors` under
    peft's keys (chosen and renamed by peft's `get_peft_model_state_dict`) and `adapter_config.json`, in `folder`
    for the adapter "default", in `folder/NAME` for any other."""
    prefix, module = root
    inside = f"{prefix}." if prefix else ""
    shapes = {n[len(inside):]: (t.shape, t.dtype) for n, t in original.state_dict(keep_vars=True).items()
              if n.startswith(inside)}
    tensors = dict((*held.named_parameters(remove_duplicate=False), *held.named_buffers(remove_duplicate=False)))
    peft_model: Any = module
    for adapter in peft_model.peft_config:  # the same order on every rank
        out = lora.adapter_folder(folder, adapter)
        keys = [(key, inside + name) for key, name in lora.adapter_keys(module, shapes, adapter)]
        _export_adapter(tensors, keys, out, rank, adapter)
        if rank == 0:
            lora.save_config(module, adapter, out)
        collectives.barrier()
    return folder


def _export_adapter(tensors: dict[str, torch.Tensor], keys: list[tuple[str, str]], out: Path, rank: int,
                    adapter: str) -> None:
    """One adapter's tensors (`keys`: peft's key, the tensor's name in `tensors`, this rank's part of the model)
    in the one file peft reads, in peft's order, each rank writing its blocks in place as for the whole model."""
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    mine = [(key, tensors[name]) for key, name in keys if name in tensors]
    _, specs, writer = _offered(mine)
    unheld = [key for key, _ in keys if key not in specs]
    if unheld:  # every rank sees the same gathered offers: all raise
        raise ParatrainError(f"run.export: no rank holds {unheld[:4]} of adapter {adapter!r}")
    members = [(key, *specs[key]) for key, _ in keys]
    _write_in_place(out, [(lora.ADAPTER_FILE, members)], mine, writer, rank)
