"""Crash-safe checkpoint directories.

A checkpoint is a directory `step-000000042/` holding payload files and a `meta.json` that lists
every file with its size and SHA-256. It is written under a temporary name, fsynced, and published
with an atomic rename; `latest` is then replaced atomically. A crash at any instant therefore leaves
either the previous checkpoint or the new one complete, and `latest` never names a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import CheckpointError

META = "meta.json"
LATEST = "latest"
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory inside `root` to write a checkpoint's files into."""
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-{checkpoint_name(step)}-", dir=root))


def publish(root: Path, tmp: Path, step: int, info: dict[str, object]) -> Path:
    """Seal `tmp` with its manifest, rename it into place and point `latest` at it."""
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "sha256": sha256(path)}
    meta = {"format": 1, "step": step, "files": files, **info}
    write_atomic(tmp / META, json.dumps(meta, indent=1).encode())
    _fsync_dir(tmp)
    final = root / checkpoint_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    write_atomic(root / LATEST, final.name.encode())
    _fsync_dir(root)
    return final


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def verify(path: Path, deep: bool = True) -> dict[str, object]:
    """The manifest of a complete checkpoint; CheckpointError naming what is wrong otherwise."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} has no readable {META} (incomplete write?): {exc}") from None
    for name, expect in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is missing {name}")
        if file.stat().st_size != expect["size"]:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {name} is {file.stat().st_size} bytes, expected {expect['size']} (truncated)"
            )
        if deep and sha256(file) != expect["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} does not match its checksum (corrupt)")
    return meta  # type: ignore[no-any-return]


def candidates(root: Path) -> list[Path]:
    """Published checkpoints, newest first (`latest` first when it names one)."""
    if not root.is_dir():
        return []
    found = sorted((p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()), reverse=True)
    try:
        named = root / (root / LATEST).read_text().strip()
    except OSError:
        return found
    return [named] + [p for p in found if p != named] if named in found else found


def newest_complete(root: Path, on_skip: object = None) -> tuple[Path, dict[str, object]] | None:
    """The newest checkpoint that verifies; broken newer ones are reported through `on_skip(path, error)`."""
    for path in candidates(root):
        try:
            return path, verify(path)
        except CheckpointError as exc:
            if callable(on_skip):
                on_skip(path, exc)
    return None


def retain(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` published checkpoints and any stale temporary directories."""
    for path in sorted((p for p in root.iterdir() if _NAME.match(p.name)), reverse=True)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".tmp-step-*"):
        shutil.rmtree(path, ignore_errors=True)
