"""A refusal on one rank is the same refusal on every rank, within moments rather than a timeout.

A `ParatrainError` raised on one rank while it sets up, prepares a model or takes its first step would leave
its peers going on into their next collective, where they wait for it until the process group's timeout: the
message that names the fix on one rank, "rank 1 did not arrive" on the others. So each of these phases ends
in an agreement kept in the job's rendezvous store (the c10d store every rank already holds, beside the
collectives, so it never takes a collective's place in the sequence the backend matches):

    rank 0   ... phase ...  arrive -- wait: every rank arrived, or one refused --> go on, or raise "rank 1: ..."
    rank 1   ... REFUSES -- post "rank 1: ..." --------------------------------> raise "rank 1: ..." at once

The refusing rank never waits: its peers may be blocked in a collective that needs it (DDP's gradient
all-reduce after the forward it refused in, DDP's first broadcast while it refused in prepare). A peer waiting
at the agreement reads the refusal at once; a peer blocked in a collective is released when the refusing
rank's process group goes (its process ends, or `run.close()`), and the phase's error path reads the store and
raises the same refusal instead of the broken collective's error. The first refusal posted in a phase is the
one every rank raises, word for word. Only setup, each `prepare` and the first step agree: later steps write
nothing to the store.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .errors import CollectiveTimeout, ParatrainError, RefusedOnRank, is_comm_failure

if TYPE_CHECKING:
    from .runtime import Placement

_ROOT = "paratrain/agree/"
_RUNS = [0]
"""`setup` calls in this process so far: each run agrees under keys of its own, since a store can outlive a run
(torchrun's agent store under env://), and every rank calls `setup` as often as the others."""


class Refusals:
    """The phases one rank agrees on with its peers, through their store (none: one process, nothing to agree)."""

    def __init__(self, store: Any, rank: int = 0, world_size: int = 1, timeout_s: float = 600.0) -> None:
        self.store: Any = store if world_size > 1 else None
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        _RUNS[0] += 1
        self.run = _RUNS[0]
        self.phases = 0
        """Phases this rank has ended, agreed or refused: every rank goes through the same ones in the same order."""

    @classmethod
    def at_rendezvous(cls, placement: Placement, init: str | None, timeout_s: float) -> Refusals:
        """The store the process group will start on (the group's own when it already exists), opened now so
        that the ranks agree on their setup before any of them waits for the others in the group's rendezvous."""
        if placement.world_size == 1:
            return cls(None)
        import torch.distributed as dist

        from . import runtime

        store = (dist.distributed_c10d._get_default_store() if dist.is_initialized()
                 else runtime.open_store(placement, init, timeout_s))
        return cls(store, placement.rank, placement.world_size, timeout_s)

    def _key(self, phase: int, what: str) -> str:
        return f"{_ROOT}{self.run}/{phase}/{what}"

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run `name`'s local work; a refusal in it is raised on every rank alike, and it ends in an agreement."""
        if self.store is None:
            yield
            return
        number = self.phases + 1
        try:
            yield
        except Exception as exc:
            self.phases = number
            if isinstance(exc, RefusedOnRank):
                raise  # agreed already (a pipeline split's own agreement)
            if isinstance(exc, CollectiveTimeout) or is_comm_failure(exc):  # released by a refusing peer, perhaps
                refusal = self._posted(number)
                if refusal is None:
                    raise
                raise refusal from exc
            if isinstance(exc, ParatrainError):
                raise self._post(number, exc) from exc
            raise
        self.phases = number
        self._agree(name, number)

    def _post(self, phase: int, exc: ParatrainError) -> RefusedOnRank:
        """This rank refuses: leave the message where its peers read it; what every rank raises (the first posted)."""
        mine = f"rank {self.rank}: {exc}"
        try:
            first = self.store.compare_set(self._key(phase, "refused"), "", mine)
            self.store.set(self._key(phase, "over"), "")  # wakes the peers waiting at this phase's end
        except Exception:  # the store went with its host: say it here at least
            return RefusedOnRank(mine)
        return RefusedOnRank(first.decode() if isinstance(first, bytes) else str(first))

    def _posted(self, phase: int) -> RefusedOnRank | None:
        try:
            key = self._key(phase, "refused")
            return RefusedOnRank(self.store.get(key).decode()) if self.store.check([key]) else None
        except Exception:
            return None

    def _agree(self, name: str, phase: int) -> None:
        """Arrive at the end of `phase`; wait until every rank has, or one refused (then raise its refusal here)."""
        over = self._key(phase, "over")
        if int(self.store.add(self._key(phase, "arrived"), 1)) == self.world_size:
            self.store.set(over, "")
        deadline, pause = time.monotonic() + self.timeout_s, 0.001
        # Polled, not a blocking wait: that would hold the store client the heartbeat thread shares.
        while not self.store.check([over]):
            if time.monotonic() > deadline:
                arrived = int(self.store.add(self._key(phase, "arrived"), 0))
                raise CollectiveTimeout(
                    f"{name}: {arrived} of {self.world_size} ranks finished it within {self.timeout_s:g} s and none "
                    "refused; a rank is stuck in it or never reached it (the limit is setup(timeout_s=...))")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        refusal = self._posted(phase)
        if refusal is not None:
            raise refusal


NONE = Refusals(None)
"""The refusals of a run without peers: every phase is its own local work."""


__all__ = ["NONE", "Refusals"]
