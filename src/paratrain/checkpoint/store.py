"""Crash-safe checkpoint directories.

A checkpoint is a directory `step-000000042/` holding payload files and a `meta.json` that lists
every file with its size and SHA-256. It is written under a temporary name (`.tmp-step-...`), every
file is fsynced, the manifest is written last, and the directory is published with one atomic
rename; only then is `latest` replaced (write to a temporary file, fsync, rename). A crash at any
instant therefore leaves one of:

    before rename : .tmp-step-N/ (ignored, removed by the next save)   latest -> step-M (complete)
    after rename  : step-N/ complete                                     latest -> step-M (complete)
    after latest  : step-N/ complete                                     latest -> step-N

so `latest` never names a torn checkpoint. Resuming tries `latest` first, then the other published
checkpoints newest first, skipping (and reporting) any that fail verification.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

META = "meta.json"
LATEST = "latest"
FORMAT = 2
_NAME = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-step-"


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def is_checkpoint_dir(path: Path) -> bool:
    """True for a path that is (or was meant to be) one checkpoint rather than a directory of them."""
    return bool(_NAME.match(path.name) or path.name.startswith(_TMP_PREFIX) or (path / META).exists())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory inside `root` to write a checkpoint's files into."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step:09d}-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a published checkpoint should read like any directory
    return tmp


def write_file(path: Path, write: Callable[[Any], None]) -> None:
    """Write one payload file with `write(fileobj)` and fsync it, so it is on disk before the barrier."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def manifest(tmp: Path) -> dict[str, dict[str, Any]]:
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        fsync_file(path)  # cheap if the writer already did; covers files written by other libraries
        files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "sha256": sha256(path)}
    for sub in sorted(p for p in tmp.rglob("*") if p.is_dir()):
        _fsync_dir(sub)
    return files


def publish(root: Path, tmp: Path, step: int, info: dict[str, object]) -> Path:
    """Seal `tmp` with its manifest, rename it into place and point `latest` at it."""
    meta = {"format": FORMAT, "step": step, "files": manifest(tmp), **info}
    write_atomic(tmp / META, json.dumps(meta, indent=1).encode())
    _fsync_dir(tmp)
    final = root / checkpoint_name(step)
    trash = None
    if final.exists():  # the same step saved again: move the old one aside, never delete it first
        trash = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step:09d}-old-", dir=root))
        os.rename(final, trash / final.name)
    os.rename(tmp, final)
    _fsync_dir(root)
    write_atomic(root / LATEST, final.name.encode())
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_meta(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file; pass the checkpoint's directory (step-N/)")
    try:
        meta = json.loads((path / META).read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
            raise ValueError("not a paratrain manifest")
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no readable {META}: it was never completed (a crash during save?): {exc}"
        ) from None
    return meta


def verify(path: Path, deep: bool = True) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError naming what is wrong otherwise.

    Shallow verification checks presence and sizes (catches truncation); deep adds checksums (catches
    corruption) and is done by one rank only.
    """
    meta = read_meta(path)
    for name, expect in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is missing {name}")
        size = file.stat().st_size
        if size != expect["size"]:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {name} is {size} bytes, expected {expect['size']} (truncated)"
            )
        if deep and sha256(file) != expect["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} does not match its checksum (corrupt)")
    return meta


def _published(root: Path) -> list[Path]:
    """Published checkpoint directories, highest step first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()), reverse=True)


def latest(root: Path) -> Path | None:
    """The checkpoint `latest` names, if the pointer exists."""
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        return None
    return root / name if _NAME.match(name) else None


def candidates(root: Path) -> list[Path]:
    """Published checkpoints in the order resuming tries them: `latest` first, then highest step first."""
    found = _published(root)
    named = latest(root)
    return [named] + [p for p in found if p != named] if named in found else found


def newest_complete(
    root: Path, on_skip: Callable[[Path, CheckpointError], None] | None = None, deep: bool = True
) -> tuple[Path, dict[str, Any]] | None:
    """The first checkpoint of `candidates` that verifies; broken ones are reported through `on_skip`.

    None when nothing was ever published; CheckpointError when checkpoints exist but none is complete
    (starting over silently would throw the run away).
    """
    tried = candidates(root)
    problems = []
    for path in tried:
        try:
            return path, verify(path, deep=deep)
        except CheckpointError as exc:
            problems.append(str(exc))
            if on_skip is not None:
                on_skip(path, exc)
    if tried:
        raise CheckpointError(
            f"no complete checkpoint in {str(root)!r}; every one failed verification:\n  " + "\n  ".join(problems)
            + "\nrestore them from a backup, or move the directory away to start from scratch"
        )
    return None


def retain(root: Path, keep: int) -> list[Path]:
    """Remove all but `keep` published checkpoints (always keeping the one `latest` names) and stale
    temporary directories; returns what was removed."""
    named = latest(root)
    kept = [named] if named is not None and named.is_dir() else []
    for path in _published(root):
        if len(kept) >= keep:
            break
        if path not in kept:
            kept.append(path)
    removed = [p for p in _published(root) if p not in kept]
    removed += [p for p in root.iterdir() if p.name.startswith(_TMP_PREFIX)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
