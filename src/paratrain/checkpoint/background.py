"""Checkpoints written while training goes on (`setup(async_save=True)`, the default).

    main thread   run.save: wait for the previous write ── stage: copy to CPU, ranks agree ──▶ training goes on
    background                                                 write + fsync ── ranks agree ── rank 0 publishes

The training loop blocks only for the copy: `manager.stage` takes every rank's state dicts and passes them through
torch's `DefaultStager` (DCP's own staging for `async_save`: a CPU copy of every tensor, its attributes kept, into
buffers reused from one save to the next; a DTensor on a CPU mesh is copied as its local tensor and rebuilt
around the copy), so the next optimizer step cannot change what is written. `manager.write` then runs in a
thread, from the copy. It is DCP's `async_save` taken apart: DCP's write,
the files torch.save writes and the publication are one sequence that must end in an agreement between the ranks,
and a rank that cannot stage has to fail every rank before any of them starts writing.

The thread's collectives (DCP's plans, the agreement that every file is on disk, rank 0's outcome) run on a gloo
process group of their own, made at the first save: collectives of two threads on one group would interleave in an
order the ranks do not share. Publication is the same as a blocking save's, so a rank killed mid-write leaves
the previous checkpoint complete and `latest` on it.

Every wait is bounded by the run's timeout. The next `run.save`, `run.load`, `run.wait_for_save()`,
`run.close()` and the end of the process (before its process group goes: `finish_all`) wait for the write in
flight; all but the last raise its error.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..memstats import give_back_freed

_WRITERS: weakref.WeakSet[Writer] = weakref.WeakSet()
"""Every writer of this process, so the process group outlives their writes (`finish_all`)."""
_AT_EXIT: list[bool] = []


class Writer:
    """One run's checkpoints written in the background, one at a time."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._stager: Any = None
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._name = ""
        self._outcome: Path | BaseException | None = None
        _WRITERS.add(self)

    def copy(self, value: Any) -> Any:
        """`value` with every tensor copied to CPU memory and every other object deep-copied (main thread only: the
        stager keeps the buffers). Containers are walked here and numbers, strings and the like kept as they are:
        torch's stager deep-copies each of them under a no_grad context of its own, and a flattened optimizer
        state holds thousands (every option of its group, once per parameter)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pin = torch.cuda.is_available() and torch.cuda.is_initialized()  # faster copies from the GPU
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
        leaves: list[Any] = []
        with torch.no_grad():
            skeleton = _split(value, leaves)
            return _join(skeleton, self._stager.stage(leaves))  # one call: a storage shared by tensors copied once

    def group(self) -> Any:
        """The process group the writes' collectives use (None without a process group). Made on first use:
        collective, so every rank asks at the same point (the first `run.save`)."""
        if self._group is None and dist.is_initialized():
            from datetime import timedelta

            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return self._group

    def start(self, name: str, write: Callable[[], Path]) -> None:
        """Run `write` in the background; `wait` first (one write at a time)."""
        if self.busy:
            raise RuntimeError("a checkpoint is still being written; wait() for it first")
        self._name, self._outcome = name, None

        def run() -> None:
            try:
                self._outcome = write()
                give_back_freed()  # here, not in the loop: the C allocator's trim takes milliseconds
            except BaseException as exc:  # kept for the main thread, which raises it
                self._outcome = exc

        self._thread = threading.Thread(target=run, name=f"paratrain-save-{name}", daemon=True)
        if not _AT_EXIT:  # after setup's: runs before the process group goes at exit
            _AT_EXIT.append(True)
            atexit.register(finish_all)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Path | None:
        """Block until the write in flight is published and return its path (None if there was none); raise
        CheckpointError naming the checkpoint if it failed, or is still being written after the run's timeout."""
        thread = self._thread
        if thread is None:
            return None
        start = time.monotonic()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise CheckpointError(
                f"checkpoint {self._name} is still being written after {time.monotonic() - start:.0f} s; a rank is "
                "stuck writing it or never started (the limit is setup(timeout_s=...))")
        self._thread = None
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, BaseException):
            raise CheckpointError(f"checkpoint {self._name} could not be written in the background: "
                                  f"{str(outcome).strip()}") from outcome
        return outcome

    def close(self) -> None:
        """Wait for the write in flight (raising its error), then let go of the staging buffers."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def finish(self) -> None:
        """At the end of the process: the write in flight completes or fails before the process group goes; a
        failure is said on stderr (nobody is left to raise it to)."""
        try:
            self.close()
        except CheckpointError as exc:
            print(f"paratrain: {exc}", file=sys.stderr, flush=True)


_KEPT = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)
"""Immutable: a staged copy may hold the object itself."""


class _Leaf:
    """Where the staged copy of `leaves[index]` goes."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Shard(_Leaf):
    """A DTensor on a CPU mesh, staged as its local tensor and rebuilt around the copy (torch's stager deep-copies
    each DTensor's spec and mesh: most of the staging time of an FSDP model's many small tensors)."""

    __slots__ = ("mesh", "placements", "shape", "stride")

    def __init__(self, index: int, value: Any) -> None:
        super().__init__(index)
        self.mesh, self.placements, self.shape, self.stride = (value.device_mesh, value.placements, value.shape,
                                                               value.stride())

    def rebuild(self, local: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)


def _split(value: Any, leaves: list[Any]) -> Any:
    """`value` with dicts, lists and tuples rebuilt and every object but immutable ones moved to `leaves`."""
    if isinstance(value, _KEPT):
        return value
    kind = type(value)
    if kind is dict:
        return {k: _split(v, leaves) for k, v in value.items()}
    if kind in (list, tuple):
        return kind(_split(v, leaves) for v in value)
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(value, dtensor.DTensor) and value.device_mesh.device_type == "cpu":
        leaves.append(value.to_local())  # (on another device, from_local would move the copy back there)
        return _Shard(len(leaves) - 1, value)
    leaves.append(value)
    return _Leaf(len(leaves) - 1)


def _join(skeleton: Any, staged: list[Any]) -> Any:
    if isinstance(skeleton, _Shard):
        return skeleton.rebuild(staged[skeleton.index])
    if isinstance(skeleton, _Leaf):
        return staged[skeleton.index]
    kind = type(skeleton)
    if kind is dict:
        return {k: _join(v, staged) for k, v in skeleton.items()}
    if kind in (list, tuple):
        return kind(_join(v, staged) for v in skeleton)
    return skeleton


def finish_all() -> None:
    """Every write in flight in this process, completed or failed (called before the process group goes)."""
    for writer in list(_WRITERS):
        writer.finish()


__all__ = ["Writer", "finish_all"]
