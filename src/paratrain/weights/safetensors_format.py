"""The safetensors layout, read and written with plain file I/O a tensor at a time.

A file is 8 bytes of header length, a JSON header ({name: {dtype, shape, data_offsets}}, "__metadata__"), then
each tensor's bytes, C-contiguous. safetensors' own reader maps the file into memory: every page a rank touches
then counts in its resident set on top of the copy it keeps, so a rank reading its share of a 3 GB checkpoint
peaked 1.5 GB above the goal. Reading the rows asked for with `readinto`, and writing a file whose header is
known before its tensors are (their shapes are), keeps a rank at one tensor beyond what it holds.
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in its file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    """Byte offset of its data in the file (the header included)."""
    end: int


def read_header(file: Path) -> tuple[dict[str, Entry], dict[str, str], int]:
    """(entries, metadata, the file's size in bytes the header describes); ValueError when it is not one."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length <= 0 or 8 + length > size:
            raise ValueError("header longer than the file")
        header = json.loads(f.read(length))
    base = 8 + length
    entries = {k: Entry(v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0], base + v["data_offsets"][1])
               for k, v in header.items() if k != "__metadata__"}
    return entries, header.get("__metadata__") or {}, max((e.end for e in entries.values()), default=base)


def read(file: Path, entry: Entry, index: Sequence[slice] | None = None) -> torch.Tensor:
    """The tensor, or `index` of it (a slice per dimension): only the rows of dim 0 the slice spans are read."""
    dtype = DTYPES.get(entry.dtype)
    if dtype is None:
        raise ValueError(f"dtype {entry.dtype} is not one paratrain reads ({', '.join(DTYPES)})")
    shape = entry.shape
    rows, rest = range(shape[0] if shape else 1), index
    if shape and index is not None and range(shape[0])[index[0]].step == 1:
        rows, rest = range(shape[0])[index[0]], (slice(None), *index[1:])
    per_row = (entry.end - entry.start) // max(1, shape[0] if shape else 1)
    out = torch.empty(len(rows) * per_row, dtype=torch.uint8)
    with open(file, "rb") as f:
        f.seek(entry.start + rows.start * per_row)
        f.readinto(_bytes_of(out))
    tensor = out.view(dtype).reshape((len(rows), *shape[1:]) if shape else ())
    return tensor if rest is None else tensor[tuple(rest)].contiguous()


def _bytes_of(t: torch.Tensor) -> Any:
    """A contiguous CPU tensor's bytes as a writable buffer, shared (no copy, and no numpy)."""
    size = t.numel() * t.element_size()
    return (ctypes.c_ubyte * size).from_address(t.data_ptr()) if size else bytearray()


def layout(specs: Iterable[tuple[str, torch.Size, torch.dtype]],
           metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int], int]:
    """A file's first bytes (length and header), where each tensor's data starts in it, and its whole size."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    starts = {k: len(head) + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    return head, starts, len(head) + offset


def write_piece(fd: int, start: int, shape: Sequence[int], piece: torch.Tensor, offset: Sequence[int]) -> None:
    """Write `piece`, the block of a tensor of `shape` whose first element is at index `offset`, into the open file
    `fd` whose copy of that tensor starts at byte `start`: one write per contiguous run of the whole's bytes (the
    piece's rows, or its whole when it spans every dimension but the first)."""
    data = piece.detach().to("cpu").contiguous()
    if not data.numel():
        return
    item = data.element_size()
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    inner = len(shape)  # the runs are contiguous over dimensions inner.. (the piece spans them whole)
    while inner > 1 and data.shape[inner - 1] == shape[inner - 1]:
        inner -= 1
    run = data[(0,) * max(0, inner - 1)].numel() if inner > 0 else data.numel()
    flat = data.reshape(-1)
    for i, index in enumerate(_indices(data.shape[: max(0, inner - 1)])):
        element = sum((o + j) * st for o, j, st in zip(offset, (*index, 0), strides))
        chunk = flat[i * run : (i + 1) * run]
        os.pwrite(fd, memoryview(_bytes_of(chunk)).cast("B"), start + element * item)


def _indices(shape: Sequence[int]) -> Iterable[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for first in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (first, *rest)


def write(file: Path, specs: Iterable[tuple[str, torch.Size, torch.dtype]],
          values: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write a file whose tensors are `specs` (name, shape, dtype), asking `values(name)` for each in that order,
    after the header, one at a time. Returns the bytes of tensor data written."""
    specs = list(specs)
    head, starts, size = layout(specs, metadata)
    with open(file, "wb") as f:
        f.write(head)
        f.truncate(size)
    fd = os.open(file, os.O_WRONLY)
    try:
        for name, shape, _ in specs:
            write_piece(fd, starts[name], shape, values(name), [0] * len(shape))
    finally:
        os.close(fd)
    return size - len(head)
