"""The collective save/load protocol all ranks follow.

    rank 0: make .tmp dir ──broadcast──▶ every rank writes + fsyncs its files ──all agree it worked──▶
    rank 0: manifest + rename + `latest` + retention ──broadcast outcome──▶ every rank returns or raises

Replicated strategies write one `shared.pt` from rank 0; sharded ones (`strategy.sharded_state`)
write their models and optimizers with torch.distributed.checkpoint into `model/` and the rest of
the state into `rank-R.pt`. Every rank writes `rng-R.pt` (its Python, torch, CUDA and numpy
generators), so a resumed rank draws the same dropout masks it would have drawn. Decisions that
one rank makes (which checkpoint to load, whether it verified) are broadcast as an outcome, so a
rank-0 error is raised on every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import CheckpointError, is_comm_failure
from . import portable, rng, sharded, store
from . import state as state_mod
from .state import Unwrap

T = TypeVar("T")


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_rank0(rank: int, fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 and give every rank its result, or raise its CheckpointError on every rank."""
    outcome: tuple[str, Any] | None = None
    if rank == 0:
        try:
            outcome = ("ok", fn())
        except CheckpointError as exc:
            outcome = ("error", str(exc))
        except Exception as exc:
            if is_comm_failure(exc):
                raise
            outcome = ("error", f"checkpoint step failed on rank 0: {type(exc).__name__}: {exc}")
    kind, value = _broadcast(outcome)
    if kind == "error":
        raise CheckpointError(value)
    return value  # type: ignore[no-any-return]


def _torch_save(obj: Any, path: Path) -> None:
    store.write_file(path, lambda f: torch.save(obj, f))


def _everywhere(rank: int, fn: Callable[[], None]) -> None:
    """Run `fn` on every rank, then agree: if it failed anywhere, every rank raises naming where and why
    (instead of the healthy ranks waiting in their next collective for the one that raised)."""
    error = None
    try:
        fn()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit) or is_comm_failure(exc):
            raise
        error = f"rank {rank}: {type(exc).__name__}: {str(exc).strip()[:1000]}"
    errors = [error]
    if _distributed():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    bad = [e for e in errors if e]
    if bad:
        raise CheckpointError("\n".join(bad))


def save(
    root: str | Path, step: int, user_state: dict[str, Any], *, rank: int, world_size: int, unwrap: Unwrap,
    sharded_state: bool, keep: int, extra: dict[str, Any],
) -> Path:
    """Write a complete checkpoint of `user_state` at `step` under `root`; collective."""
    root = Path(root)
    tmp = Path(_on_rank0(rank, lambda: str(store.begin(root, step))))

    gathered: dict[str, Any] = {}

    def gather() -> None:
        if sharded_state:
            gathered.update(sharded.gather(user_state, unwrap))

    # A rank whose state cannot be gathered fails every rank here, naming it, before anyone enters DCP's
    # collectives (where the others would wait for it until the timeout).
    _everywhere(rank, gather)

    def write() -> None:
        if sharded_state:
            sharded.save(tmp, gathered)
            rest = state_mod.collect(user_state, unwrap, skip=sharded.handled(user_state))
            _torch_save({"state": rest, "extra": extra}, tmp / f"rank-{rank}.pt")
        else:
            # built on every rank, though rank 0 alone writes it: a user's state_dict() may be collective
            payload = {"state": state_mod.collect(user_state, unwrap), "extra": extra}
            portable.record_names(payload["state"], user_state, unwrap)
            if rank == 0:
                _torch_save(payload, tmp / "shared.pt")
        _torch_save(rng.capture(), tmp / f"rng-{rank}.pt")

    _everywhere(rank, write)  # doubles as the barrier: every file is on disk before rank 0 publishes
    info: dict[str, object] = {"world_size": world_size, "sharded": sharded_state,
                               "layout": "dcp" if sharded_state else "torch"}

    def publish() -> str:
        final = store.publish(root, tmp, step, info)
        store.retain(root, keep)
        return str(final)

    return Path(_on_rank0(rank, publish))


def find(root: str | Path, rank: int) -> Path | None:
    """The checkpoint to resume from: `latest` if it verifies, else the newest one that does (with a
    warning naming what was skipped). Rank 0 verifies checksums; all ranks get its answer."""

    def pick() -> str | None:
        def skip(path: Path, exc: CheckpointError) -> None:
            warnings.warn(f"paratrain: skipping broken checkpoint {path.name}: {exc}; falling back to an older one",
                          stacklevel=2)

        found = store.newest_complete(Path(root), on_skip=skip)
        return str(found[0]) if found else None

    chosen = _on_rank0(rank, pick)
    return Path(chosen) if chosen else None


def check(path: str | Path, rank: int) -> None:
    """CheckpointError on every rank unless `path` is one complete checkpoint (rank 0 checks checksums)."""
    _on_rank0(rank, lambda: store.verify(Path(path), deep=True) and None)


def load(
    path: str | Path, user_state: dict[str, Any], *, rank: int, world_size: int, unwrap: Unwrap,
    map_location: Any, sharded_state: bool = False, verified: bool = False,
) -> dict[str, Any]:
    """Restore checkpoint `path` into `user_state` in place; returns the `extra` dict saved with it.

    Any checkpoint loads under any layout: a sharded one through DCP (each rank reads its slices), a
    replicated one directly where every rank keeps the whole model, else through `portable`."""
    path = Path(path)
    if not verified:
        check(path, rank)
    meta = store.verify(path, deep=False)
    saved_world = int(meta.get("world_size", 1))
    extra: dict[str, Any] = {}
    if meta.get("sharded"):
        sharded.load(path, user_state, unwrap)
        own = path / f"rank-{rank}.pt"
        file = own if own.exists() else path / "rank-0.pt"  # a rank the saving run did not have
        skip = sharded.handled(user_state)
    else:
        file, skip = path / "shared.pt", set()
    payload: dict[str, Any] = {}
    portable_load = not meta.get("sharded") and sharded_state

    def read() -> None:
        payload.update(_torch_load(file, map_location))
        if portable_load:
            portable.check_whole(payload["state"], user_state, unwrap, path.name)

    _everywhere(rank, read)
    if portable_load:  # collective, so after the ranks agreed the checkpoint fits
        portable.load_whole(payload["state"], user_state, unwrap)
        skip = sharded.handled(user_state)

    def restore() -> None:
        try:
            missing = state_mod.apply(user_state, payload["state"], unwrap, skip=skip)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {path.name} does not fit this state: {exc}") from None
        if missing and rank == 0:
            warnings.warn(f"paratrain: checkpoint {path.name} has no entry for {missing}; they keep their "
                          "current values", stacklevel=4)
        rng_file = path / f"rng-{rank}.pt"
        if rng_file.exists():
            rng.restore(_torch_load(rng_file, None))
        elif rank < saved_world:
            raise CheckpointError(f"checkpoint {str(path)!r} is missing {rng_file.name}")
        extra.update(payload["extra"])

    _everywhere(rank, restore)
    return extra


def _torch_load(file: Path, map_location: Any) -> Any:
    try:
        return torch.load(file, map_location=map_location, weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {str(file)!r} cannot be read: {exc}") from None
