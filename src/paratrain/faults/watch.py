"""Heartbeats and the collective guard: why a hung job names the missing rank and its line.

A collective that waits for a rank that never comes fails after the process group's timeout (gloo
raises, NCCL's watchdog aborts) with a message about sockets. To say *who* is missing and *where*,
every rank runs one daemon thread that, every `interval` seconds, publishes to the job's store:

    paratrain/beat/<rank> = {t, seq, op, where, pid, host}

where `op`/`seq` is the paratrain collective the rank is in (the n-th it entered) and `where` the
file and line its main thread is at (read from `sys._current_frames`, so a rank sleeping or busy in
user code is located too). `Watch.op_scope(name)` wraps every collective `Run` performs; when one
fails with a communication error it reads all heartbeats and raises `CollectiveTimeout` with the
report from `diagnose.report`. The thread only reads a frame and writes one small key: no
collectives, no locks shared with training.

The store usually lives in rank 0's process. Each rank remembers rank 0's host and pid (read once),
so when rank 0 has exited on this host nobody touches the dead store (which would only add socket
errors to the output) and the report says so instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..errors import CollectiveTimeout, is_comm_failure
from . import diagnose

_KEY = "paratrain/beat/"


def interval_for(timeout_s: float) -> float:
    """Heartbeats often enough that a report is at most a tenth of the timeout old, at most every 2 s."""
    return min(2.0, max(0.05, timeout_s / 10))


class Watch:
    """One rank's heartbeat publisher and collective guard (inactive on a single process)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.interval = interval_for(timeout_s)
        self.silent_after = max(3 * self.interval, 1.0)
        self.op = ""
        self.seq = 0
        self._since = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._rank0: diagnose.Beat | None = None
        """Rank 0's first heartbeat: where the store's host process runs."""

    @classmethod
    def start(cls, rank: int, world_size: int, timeout_s: float) -> Watch:
        """A running watch on the default process group's store; an inactive one without peers."""
        import torch.distributed as dist

        store = None
        if world_size > 1 and dist.is_initialized():
            try:
                store = dist.distributed_c10d._get_default_store()
            except (RuntimeError, ValueError):
                store = None
        watch = cls(store, rank, world_size, timeout_s)
        if store is not None:
            watch.publish()
            watch._thread = threading.Thread(target=watch._loop, name="paratrain-heartbeat", daemon=True)
            watch._thread.start()
        return watch

    # -- publishing -----------------------------------------------------------------------------
    def _beat(self) -> dict[str, Any]:
        return {"t": time.time(), "seq": self.seq, "op": self.op, "where": diagnose.main_thread_where(),
                "pid": self._pid, "host": self._host}

    def publish(self) -> None:
        if self.store is not None:
            self.store.set(f"{_KEY}{self.rank}", json.dumps(self._beat()))

    def _loop(self) -> None:
        due = time.monotonic() + self.interval
        # Until rank 0's beat is known, look for it every 50 ms (never with a blocking get: that would hold
        # the store client meanwhile); then just publish every `interval`.
        while not self._stop.wait(0.05 if self._rank0 is None else max(0.0, due - time.monotonic())):
            if self.store_gone():
                return
            try:
                if self._rank0 is None:
                    self._rank0 = self._read_one(0)
                if time.monotonic() >= due:
                    self.publish()
                    due = time.monotonic() + self.interval
            except Exception:  # the store went away with its host: nothing left to report to
                return

    def store_gone(self) -> bool:
        """True when rank 0 (the store's host) ran on this host and has exited."""
        return self.rank != 0 and self._rank0 is not None and diagnose.exited(self._rank0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        self._thread = None

    # -- the guard ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def op_scope(self, name: str) -> Iterator[None]:
        """Mark this rank as inside collective `name`; turn a communication failure into a named report."""
        if self.store is None or self.op:  # nested (save -> broadcast): the outer call names it
            yield
            return
        self.seq += 1
        self.op, self._since = name, time.time()
        try:
            yield
        except Exception as exc:
            if isinstance(exc, CollectiveTimeout) or not is_comm_failure(exc):
                raise
            raise CollectiveTimeout(self.diagnose(exc)) from exc
        finally:
            self.op = ""

    def _read_one(self, peer: int) -> diagnose.Beat | None:
        key = f"{_KEY}{peer}"
        if not self.store.check([key]):
            return None
        return diagnose.Beat.from_dict(peer, json.loads(self.store.get(key)))

    def read(self) -> dict[int, diagnose.Beat | None]:
        """Every rank's last heartbeat (only rank 0's remembered one when the store has gone with it)."""
        if self.store_gone():
            return {p: self._rank0 if p == 0 else None for p in range(self.world_size)}
        beats: dict[int, diagnose.Beat | None] = {}
        for peer in range(self.world_size):
            try:
                beats[peer] = self._read_one(peer)
            except Exception:
                beats[peer] = None
        return beats

    def diagnose(self, exc: BaseException) -> str:
        """Read every heartbeat (waiting briefly for peers whose last one predates this collective)."""
        waited = time.time() - self._since
        deadline = time.monotonic() + min(2 * self.interval, 1.0)
        beats = self.read()
        while time.monotonic() < deadline and any(
            b is not None and b.time < self._since and time.time() - b.time < self.silent_after
            and not diagnose.exited(b) for p, b in beats.items() if p != self.rank
        ):
            time.sleep(self.interval / 4)
            beats = self.read()
        here = diagnose.where(sys._getframe())
        return diagnose.report(self.rank, self.op, self.seq, beats, exc, waited, self.silent_after, here,
                               store_gone=self.store_gone())[1]


INACTIVE = Watch(None, 0, 1, 600.0)
"""The watch of a run without peers: `op_scope` is a plain pass-through."""
