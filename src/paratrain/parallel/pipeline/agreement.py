"""A refusal on one rank of a pipeline becomes the same refusal on every rank.

Every rank splits the model itself (traces it, measures its layers) before the ranks next talk to each other.
Where one rank fails there (a layer that fails on its data, a trace that differs), the others would go on into the
next collective and wait for it until the process group's timeout: one rank dead, the rest timing out. So the
local work of a split ends in one collective every rank reaches whether it failed or not; it carries each rank's
measurements and, in place of them, a failing rank's message, and when any rank failed every rank raises the same
`ParatrainError` (a `RefusedOnRank`, which `run.prepare`'s own agreement, `paratrain.agreement`, passes on as
it is):

    rank 0   trace  measure  -- gather --> all ranks ok: the mean of the measurements
    rank 1   trace  FAILS    -- gather --> "rank 1: ..." raised on ranks 0 and 1 alike
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from ...errors import ParatrainError, RefusedOnRank


class Agreement:
    """The one collective that ends a local phase on every rank of the world (within its timeout)."""

    def __init__(self, what: str) -> None:
        self.what = what
        """Who splits the model, for the message: "strategy 'pp'"."""
        self.done = False

    def mean(self, values: list[float]) -> list[float]:
        """Element-wise mean of every rank's `values`, in rank order (so every rank gets the same floats);
        raises on every rank when any rank failed instead."""
        rows = self._gather(None, values)
        if len({len(row) for row in rows}) > 1:  # the ranks found different layers: they would cut differently
            raise RefusedOnRank(
                f"{self.what}: the ranks measured different layers ({[len(row) for row in rows]} measurements by "
                "rank), so they would cut the model differently; build the same model on every rank (the same "
                "config and seed) and give each rank an example batch of the same structure")
        return [sum(column) / len(rows) for column in zip(*rows)]

    def _gather(self, failure: str | None, values: list[float]) -> list[list[float]]:
        self.done = True
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [values]
        box: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(box, (failure, values))
        failed = [(rank, message) for rank, (message, _) in enumerate(box) if message is not None]
        if failed:
            ranks = [rank for rank, _ in failed]
            raise RefusedOnRank(failed[0][1] if len(failed) == len(box) else
                                 f"{failed[0][1]} (on rank(s) {ranks}; the other ranks stopped with them)")
        return [list(v) for _, v in box]

    def fail(self, exc: BaseException) -> None:
        """This rank failed before the collective: tell every rank, and raise what they all raise."""
        if isinstance(exc, ParatrainError):
            message = str(exc)
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            message = (f"{self.what}: splitting the model into pipeline stages failed with {type(exc).__name__}: "
                       f"{first[:300]} (the traceback is on the failing rank)")
        self._gather(message, [])


@contextmanager
def agreed(agreement: Agreement) -> Iterator[Agreement]:
    """Run a phase of local work; it ends in `agreement`'s collective on every rank, failed or not."""
    try:
        yield agreement
    except Exception as exc:
        if agreement.done:  # the ranks already agreed: every rank fails alike from here (or raised the refusal)
            raise
        try:
            agreement.fail(exc)
        except ParatrainError as refusal:
            raise refusal.with_traceback(None) from exc
        raise
    if not agreement.done:
        agreement._gather(None, [])


__all__ = ["Agreement", "agreed"]
