"""The collective save/load protocol all ranks follow.

    stage: every rank takes its state (rank 0 makes the .tmp dir) ──all agree it worked──▶
    write: every rank writes + fsyncs its files ──all agree it worked──▶
           rank 0: manifest + rename + `latest` + retention ──broadcast outcome──▶ every rank returns or raises

`stage` runs where the training loop runs; `write` may run in another thread (`background`) on a process group
of its own, from copies `stage` made, while training goes on; `save` is the two in a row.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import CheckpointError, is_comm_failure
from . import portable, rng, sharded, store, strided
from . import state as state_mod
from .state import Unwrap

T = TypeVar("T")


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _broadcast(obj: Any, group: Any = None) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _on_rank0(rank: int, fn: Callable[[], T], group: Any = None) -> T:
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
    kind, value = _broadcast(outcome, group)
    if kind == "error":
        raise CheckpointError(value)
    return value  # type: ignore[no-any-return]


def _torch_save(obj: Any, path: Path) -> None:
    store.write_file(path, lambda f: torch.save(obj, f))


def _everywhere(rank: int, fn: Callable[[], Any], group: Any = None) -> Any:
    """Run `fn` on every rank, then agree: if it failed anywhere, every rank raises naming where and why
    (instead of the healthy ranks waiting in their next collective for the one that raised). Returns rank 0's
    result (a small value: it travels with the agreement)."""
    error, result = None, None
    try:
        result = fn()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit) or is_comm_failure(exc):
            raise
        error = f"rank {rank}: {type(exc).__name__}: {str(exc).strip()[:1000]}"
    outcomes = [(error, result)]
    if _distributed():
        outcomes = [(None, None)] * dist.get_world_size()
        dist.all_gather_object(outcomes, (error, result if rank == 0 else None), group=group)
    bad = [e for e, _ in outcomes if e]
    if bad:
        raise CheckpointError("\n".join(bad))
    return outcomes[0][1]


def _same(value: T) -> T:
    return value


@dataclass
class Staged:
    """One rank's part of a checkpoint, taken from the state: what `write` puts on disk, from any thread."""

    root: Path
    step: int
    tmp: Path
    """The temporary directory rank 0 made; renamed to `final` when every rank's files are in it."""
    files: dict[str, Any]
    """File name -> what torch.save writes there."""
    shards: dict[str, Any] | None
    """Sharded strategies: the model and optimizer state dicts DCP writes into `model/`."""
    info: dict[str, object]

    @property
    def final(self) -> Path:
        return self.root / store.checkpoint_name(self.step)


def stage(
    root: str | Path, step: int, user_state: dict[str, Any], *, rank: int, world_size: int, unwrap: Unwrap,
    sharded_state: bool, extra: dict[str, Any], copy: Callable[[Any], Any] = _same,
) -> Staged:
    """Take what every rank writes from `user_state` now, through `copy` (a CPU copy for a checkpoint written in the
    background, so the next optimizer step cannot change it); collective: the ranks agree that every one of them
    could, and rank 0 makes the temporary directory."""
    root = Path(root)
    taken: dict[str, Any] = {"files": {}, "gathered": None}

    def take() -> str | None:
        files = taken["files"]
        if sharded_state:
            gathered = sharded.gather(user_state, unwrap)
            taken["gathered"] = copy(strided.for_save(gathered)) if strided.NATIVE else gathered
            rest = state_mod.collect(user_state, unwrap, skip=sharded.handled(user_state))
            files[f"rank-{rank}.pt"] = copy({"state": rest, "extra": extra})
        else:
            # built on every rank, though rank 0 alone writes it: a user's state_dict() may be collective
            payload = {"state": state_mod.collect(user_state, unwrap), "extra": extra}
            portable.record_names(payload["state"], user_state, unwrap)
            if rank == 0:
                files["shared.pt"] = copy(payload)
        files[f"rng-{rank}.pt"] = rng.capture()  # new objects already: nothing the next step changes
        return str(store.begin(root, step)) if rank == 0 else None

    # A rank whose state cannot be taken fails every rank here, naming it, before anyone enters DCP's collectives
    # (where the others would wait for it until the timeout).
    tmp = Path(_everywhere(rank, take))
    shards = taken["gathered"]
    if sharded_state and not strided.NATIVE:  # an older torch re-splits strided tensors: collective, so here
        shards = copy(strided.for_save(shards))
    info: dict[str, object] = {"world_size": world_size, "sharded": sharded_state,
                               "layout": "dcp" if sharded_state else "torch"}
    return Staged(root, step, tmp, taken["files"], shards, info)


def write(staged: Staged, *, rank: int, keep: int, group: Any = None) -> Path:
    """Put a staged checkpoint on disk and publish it; collective over `group` (the default one if None)."""

    def files() -> None:
        if staged.shards is not None:
            sharded.save(staged.tmp, staged.shards, group)
        for name, obj in staged.files.items():
            _torch_save(obj, staged.tmp / name)

    _everywhere(rank, files, group)  # doubles as the barrier: every file is on disk before rank 0 publishes

    def publish() -> str:
        final = store.publish(staged.root, staged.tmp, staged.step, staged.info)
        store.retain(staged.root, keep)
        return str(final)

    return Path(_on_rank0(rank, publish, group))


def save(
    root: str | Path, step: int, user_state: dict[str, Any], *, rank: int, world_size: int, unwrap: Unwrap,
    sharded_state: bool, keep: int, extra: dict[str, Any],
) -> Path:
    """Write a complete checkpoint of `user_state` at `step` under `root`, and return when it is published;
    collective."""
    staged = stage(root, step, user_state, rank=rank, world_size=world_size, unwrap=unwrap,
                   sharded_state=sharded_state, extra=extra)
    return write(staged, rank=rank, keep=keep)


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
