"""The collective save/load protocol all ranks follow.

    rank 0: make tmp dir ──broadcast path──▶ every rank writes its files ──barrier──▶
    rank 0: seal + rename + update `latest` + retention ──barrier──▶ done

Replicated strategies write one `shared.pt` from rank 0; strategies whose ranks hold different
parts of the model write `rank-R.pt` from every rank. Each rank always writes its RNG state.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from . import rng, store
from . import state as state_mod
from .state import Unwrap


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(
    root: str | Path, step: int, user_state: dict[str, Any], *, rank: int, world_size: int, unwrap: Unwrap,
    sharded: bool, keep: int, extra: dict[str, Any],
) -> Path:
    root = Path(root)
    tmp = _broadcast(str(store.begin(root, step)) if rank == 0 else None)
    payload = {"state": state_mod.collect(user_state, unwrap), "extra": extra}
    if sharded:
        torch.save(payload, Path(tmp) / f"rank-{rank}.pt")
    elif rank == 0:
        torch.save(payload, Path(tmp) / "shared.pt")
    torch.save(rng.capture(), Path(tmp) / f"rng-{rank}.pt")
    _barrier()
    final = root / store.checkpoint_name(step)
    if rank == 0:
        store.publish(root, Path(tmp), step, {"world_size": world_size, "sharded": sharded})
        store.retain(root, keep)
    _barrier()
    return final


def find(root: str | Path, rank: int) -> Path | None:
    """Rank 0 picks the newest complete checkpoint (reporting broken newer ones); all ranks agree on it."""
    chosen = None
    if rank == 0:
        def skip(path: Path, exc: Exception) -> None:
            warnings.warn(f"skipping broken checkpoint {path.name}: {exc}; falling back to an older one", stacklevel=3)

        found = store.newest_complete(Path(root), on_skip=skip)
        chosen = str(found[0]) if found else None
    chosen = _broadcast(chosen)
    return Path(chosen) if chosen else None


def load(
    path: str | Path, user_state: dict[str, Any], *, rank: int, world_size: int, unwrap: Unwrap,
    map_location: Any, verify: bool = True,
) -> dict[str, Any]:
    path = Path(path)
    meta = store.verify(path, deep=verify and rank == 0)
    sharded = bool(meta.get("sharded"))
    saved_world = int(meta.get("world_size", 1))  # type: ignore[call-overload]
    if sharded and saved_world != world_size:
        raise CheckpointError(
            f"checkpoint {path.name} holds {saved_world} model shards but this run has {world_size} ranks; "
            f"resume with {saved_world} workers"
        )
    file = path / (f"rank-{rank}.pt" if sharded else "shared.pt")
    try:
        payload = torch.load(file, map_location=map_location, weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {str(file)!r} cannot be read: {exc}") from None
    state_mod.apply(user_state, payload["state"], unwrap)
    rng_file = path / f"rng-{rank}.pt"
    if rng_file.exists():
        rng.restore(torch.load(rng_file, weights_only=False))
    return payload["extra"]  # type: ignore[no-any-return]
