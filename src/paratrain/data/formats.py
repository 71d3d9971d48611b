"""One reader per file format, each able to do two things with a shard file:

    read(path)   its samples in file order, once through   (the plain stream: DataLoader without paratrain)
    open(path)   its samples by position                  (the prepared loader: any row, in any order)
    count(path)  its number of samples, from metadata where the format has it (parquet, arrow), else from a
                 cheap scan (a jsonl file's newlines, a tar file's headers) that decodes nothing

Reading by position is what lets a replica (and each DataLoader worker) decode only the rows of its own
share, in the global order, instead of reading the whole stream to find them. A jsonl file is indexed by
its line offsets (16 bytes a line), a tar file by its members' offsets; parquet and arrow shards are held
as one Arrow table per open shard (arrow memory-mapped, parquet decoded once) and rows are taken from it
a batch at a time. pyarrow and numpy are imported only when a format that needs them is used.
"""

from __future__ import annotations

import json
import mmap
import os
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ParatrainError


class Rows(Protocol):
    """An open shard: its samples by position."""

    def __len__(self) -> int: ...

    def take(self, positions: Sequence[int]) -> list[Any]:
        """The samples at `positions`, in that order."""
        ...


class Format(Protocol):
    @property
    def name(self) -> str: ...

    def count(self, path: str) -> int: ...

    def read(self, path: str) -> Iterator[Any]: ...

    def open(self, path: str) -> Rows: ...


def _need(module: str) -> Any:
    """An optional dependency, or the error that names the extra installing it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ParatrainError(
            f"reading this format needs {module}; install it with pip install 'paratrain[data]'"
        ) from None


# -- jsonl -----------------------------------------------------------------------------------------------
def _line_spans(path: str) -> tuple[Any, Any]:
    """(starts, ends) byte offsets of the non-empty lines, found 64 MiB at a time (no decoding)."""
    np = _need("numpy")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = np.frombuffer(mm, dtype=np.uint8)
            step = 64 << 20
            ends = np.concatenate([np.flatnonzero(buf[i : i + step] == 10) + i for i in range(0, size, step)])
            last = int(buf[-1])
            del buf  # the mmap cannot close while a view of it lives
    if last != 10:
        ends = np.append(ends, size)
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1] + 1]).astype(np.int64)
    keep = ends > starts
    return starts[keep], ends[keep].astype(np.int64)


class _JsonlRows:
    def __init__(self, path: str) -> None:
        self.path = path
        self.starts, self.ends = _line_spans(path)
        self._file = open(path, "rb")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if len(self.starts) else None

    def __len__(self) -> int:
        return len(self.starts)

    def take(self, positions: Sequence[int]) -> list[Any]:
        mm, starts, ends = self._mm, self.starts, self.ends
        out = []
        for p in positions:
            try:
                out.append(json.loads(mm[starts[p] : ends[p]]))  # type: ignore[index]
            except ValueError as e:
                raise ParatrainError(f"{self.path}: line {p + 1} is not JSON ({e}); fix or remove that line") from e
        return out

    def __del__(self) -> None:
        if getattr(self, "_mm", None) is not None:
            self._mm.close()  # type: ignore[union-attr]
        if getattr(self, "_file", None) is not None:
            self._file.close()


@dataclass(frozen=True)
class Jsonl:
    """One JSON object per line; blank lines are skipped."""

    name: str = "jsonl"

    def count(self, path: str) -> int:
        return len(_line_spans(path)[0])

    def read(self, path: str) -> Iterator[Any]:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError as e:
                        raise ParatrainError(f"{path}: line {number} is not JSON ({e}); fix or remove that line") from e

    def open(self, path: str) -> Rows:
        return _JsonlRows(path)


# -- parquet and arrow: one Arrow table per open shard ---------------------------------------------------
class _TableRows:
    def __init__(self, table: Any) -> None:
        self.table = table
        self._pa = _need("pyarrow")

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def take(self, positions: Sequence[int]) -> list[Any]:
        return self.table.take(self._pa.array(positions, type=self._pa.int64())).to_pylist()  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Parquet:
    """Row groups decoded with pyarrow; `columns` limits what is read."""

    columns: tuple[str, ...] | None = None
    name: str = "parquet"

    def _cols(self) -> list[str] | None:
        return list(self.columns) if self.columns else None

    def count(self, path: str) -> int:
        return int(_need("pyarrow.parquet").ParquetFile(path).metadata.num_rows)

    def read(self, path: str) -> Iterator[Any]:
        file = _need("pyarrow.parquet").ParquetFile(path)
        for batch in file.iter_batches(batch_size=4096, columns=self._cols()):
            yield from batch.to_pylist()

    def open(self, path: str) -> Rows:
        return _TableRows(_need("pyarrow.parquet").read_table(path, columns=self._cols(), memory_map=True))


def _arrow_table(path: str) -> Any:
    """An Arrow IPC file, or stream (what `datasets` save_to_disk writes), memory-mapped: no copy."""
    pa = _need("pyarrow")
    source = pa.memory_map(path)
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


@dataclass(frozen=True)
class Arrow:
    """Arrow IPC files or streams (`.arrow`, `.feather` v2)."""

    name: str = "arrow"

    def count(self, path: str) -> int:
        return int(_arrow_table(path).num_rows)

    def read(self, path: str) -> Iterator[Any]:
        for batch in _arrow_table(path).to_batches(max_chunksize=4096):
            yield from batch.to_pylist()

    def open(self, path: str) -> Rows:
        return _TableRows(_arrow_table(path))


# -- WebDataset tar --------------------------------------------------------------------------------------
def _split_key(name: str) -> tuple[str, str]:
    """WebDataset's convention: `dir/key.ext1.ext2` is field `ext1.ext2` of sample `dir/key`."""
    folder, base = os.path.split(name)
    key, _, ext = base.partition(".")
    return os.path.join(folder, key), ext


def _decode(ext: str, data: bytes) -> Any:
    """The common extensions decoded (json, text, integer labels); every other field stays bytes."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last == "json":
        return json.loads(data)
    if last in ("txt", "text"):
        return data.decode("utf-8")
    if last in ("cls", "cls2", "index", "id"):
        return int(data.decode("ascii").strip())
    return data


def _tar_index(path: str) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """The samples of a tar file: (key, [(field, data offset, size), ...]), in file order, headers only."""
    samples: list[tuple[str, list[tuple[str, int, int]]]] = []
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, ext = _split_key(member.name)
            if not samples or samples[-1][0] != key:
                samples.append((key, []))
            samples[-1][1].append((ext, member.offset_data, member.size))
    return samples


class _TarRows:
    def __init__(self, path: str, decode: bool) -> None:
        self.path, self.decode = path, decode
        self.index = _tar_index(path)
        self._file = open(path, "rb")

    def __len__(self) -> int:
        return len(self.index)

    def take(self, positions: Sequence[int]) -> list[Any]:
        out = []
        for p in positions:
            key, fields = self.index[p]
            sample: dict[str, Any] = {"__key__": key}
            for ext, offset, size in fields:
                self._file.seek(offset)
                data = self._file.read(size)
                sample[ext] = _decode(ext, data) if self.decode else data
            out.append(sample)
        return out

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()


@dataclass(frozen=True)
class WebDataset:
    """Uncompressed tar shards in WebDataset's layout: files sharing a key (`000123.jpg`, `000123.json`) are
    one sample {"__key__": "000123", "jpg": bytes, "json": {...}}. Compressed tars cannot be read by
    position and are refused (recompress to plain .tar)."""

    decode: bool = True
    name: str = "webdataset"

    def _check(self, path: str) -> None:
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic[:2] == b"\x1f\x8b" or magic[:3] == b"BZh" or magic == b"\xfd7zXZ\x00":
            raise ParatrainError(
                f"{path} is a compressed tar, which cannot be read by position (every sample would decompress the "
                "file up to it); store WebDataset shards as plain .tar (images and token arrays are compressed "
                "already)"
            )

    def count(self, path: str) -> int:
        self._check(path)
        return len(_tar_index(path))

    def read(self, path: str) -> Iterator[Any]:
        rows = self.open(path)
        for start in range(0, len(rows), 256):
            yield from rows.take(range(start, min(start + 256, len(rows))))

    def open(self, path: str) -> Rows:
        self._check(path)
        return _TarRows(path, self.decode)


def transformed(rows: Rows, transform: Callable[[Any], Any] | None) -> Rows:
    return rows if transform is None else _Mapped(rows, transform)


class _Mapped:
    def __init__(self, rows: Rows, transform: Callable[[Any], Any]) -> None:
        self.rows, self.transform = rows, transform

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, positions: Sequence[int]) -> list[Any]:
        return [self.transform(x) for x in self.rows.take(positions)]
