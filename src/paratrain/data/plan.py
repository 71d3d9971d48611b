"""An epoch's global batches cut into one share per replica, and how much each share's loss counts.

A global batch of N rows is split into contiguous shares of n_r rows (sizes differ by at most one). Each
rank's loss is the mean over its own rows, and gradients are averaged over the R replicas, so a rank's
mean must be scaled by n_r * R / N for the average to be the mean over the global batch:

    global batch of 4 rows, 3 replicas:   shares 2 | 1 | 1     weights 1.5 | 0.75 | 0.75
    (1.5 * mean(a, b) + 0.75 * c + 0.75 * d) / 3  =  (a + b + c + d) / 4

With grad_accum = A an optimizer step averages A micro-steps, so the weight becomes n_r * R * A / W, W the
rows of the whole window. Full batches weigh exactly 1.0 (the same integers divided), so only a short
batch changes the arithmetic. The plan is a pure function of the order: no collective is needed.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ParatrainError


@dataclass(frozen=True)
class Weight:
    """How one micro-step's loss counts: multiply it by `loss` before backward; the global mean the step
    reports is then `window` times the batch's own mean (1.0 unless its window holds a short batch)."""

    loss: float = 1.0
    window: float = 1.0

    def scale(self, loss_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """`loss_fn` with its result multiplied by `loss` (itself when that is 1.0, so full batches are untouched)."""
        if self.loss == 1.0:
            return loss_fn
        return lambda output, target: loss_fn(output, target) * self.loss


ONE = Weight()


@dataclass(frozen=True)
class Batch:
    indices: list[Any]
    """This replica's share."""
    end: int
    """Position in the epoch's order after this global batch (what a checkpoint records as consumed)."""
    weight: Weight = ONE
    rows_before: int = 0
    """Rows of the global batch in the shares of replicas before this one (dropout masks follow rows)."""


@dataclass(frozen=True)
class Layout:
    """What the plan needs to know about the run."""

    replica: int
    replicas: int
    grad_accum: int = 1
    equal_shares: bool = False
    """Every replica must get the same rows (pipelines: equal micro-batches across replicas)."""


def split_evenly(items: list[Any], parts: int) -> list[list[Any]]:
    """Contiguous shares whose sizes differ by at most one, larger ones first."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out


def batch_ends(n: int, global_batch: int, drop_last: bool, grad_accum: int, start: int = 0) -> list[int]:
    """End positions of the global batches of `global_batch` rows from position `start` to `n`.

    drop_last drops the short last batch, and with accumulation every incomplete last window: the
    optimizer's batch is the window, so that is what a short batch is with grad_accum > 1."""
    ends = list(range(start + global_batch, n + 1, global_batch))
    if drop_last:
        return ends[: len(ends) // grad_accum * grad_accum] if start == 0 else ends
    if start < n and (not ends or ends[-1] != n):
        ends.append(n)
    return ends


def check_epoch(ends: list[int], layout: Layout, *, per_worker: int | None, start: int = 0) -> None:
    """Refuse an epoch whose batches cannot be shared exactly, naming the fix.

    `per_worker` is the DataLoader's batch size (None when a batch sampler makes the global batches)."""
    r, accum = layout.replicas, layout.grad_accum
    sizes = [e - s for s, e in zip([start, *ends], ends)]
    n = ends[-1] if ends else start
    for i, size in enumerate(sizes):
        what = (f"the last global batch of the epoch holds {size} sample(s) ({n} samples = {len(sizes) - 1} x "
                f"{per_worker * r} + {size})" if per_worker is not None
                else f"batch {i} of the batch_sampler holds {size} sample(s)")
        fix = ("use DataLoader(drop_last=True) to drop it, or a dataset size whose last global batch fits"
               if per_worker is not None else "make the batch_sampler's batches larger, or multiples of the replicas")
        if size < r:
            raise ParatrainError(
                f"{what}, fewer than the {r} data-parallel replicas, so some replica would get none; {fix} "
                f"(or use at most {size} worker(s))"
            )
        if layout.equal_shares and size % r:
            raise ParatrainError(
                f"{what}, which {r} pipeline replicas cannot share equally ({size} % {r} = {size % r}) and pipeline "
                f"replicas need equal micro-batches; {fix}"
            )
    if accum > 1 and start == 0 and len(sizes) % accum:
        keep = len(sizes) // accum * accum
        fix = (f"use DataLoader(drop_last=True) (drops the last {n - (ends[keep - 1] if keep else 0)} samples of "
               f"each epoch) or a dataset of a multiple of {per_worker * r * accum} samples"
               if per_worker is not None else f"make the batch_sampler yield a multiple of {accum} batches per epoch")
        raise ParatrainError(
            f"grad_accum={accum}: an epoch of {len(sizes)} batches is not a whole number of accumulation windows "
            f"({len(sizes)} % {accum} = {len(sizes) % accum}), so its last optimizer step would mix two epochs; {fix}"
        )


def replica_batches(order: list[Any], ends: list[int], consumed: int, layout: Layout, start: int = 0,
                    limit: int | None = None) -> list[Batch]:
    """This replica's share of every global batch that ends after `consumed` (the first `limit` of them), with its
    weight."""
    r, accum = layout.replicas, layout.grad_accum
    starts = [start, *ends[:-1]]
    sizes = [e - s for s, e in zip(starts, ends)]
    out: list[Batch] = []
    for i in range(bisect.bisect_right(ends, consumed), len(ends)):  # ends grow: the first batch ending after it
        if limit is not None and len(out) == limit:
            break
        lo, hi = starts[i], ends[i]
        shares = split_evenly(order[lo:hi], r)
        share = shares[layout.replica]
        first = i // accum * accum
        window = sum(sizes[first : first + accum])
        weight = Weight(len(share) * r * accum / window, sizes[i] * accum / window)
        before = sum(len(s) for s in shares[: layout.replica])
        out.append(Batch(share, hi, ONE if weight == ONE else weight, before))
    return out


def evaluation_batches(order: list[Any], ends: list[int] | None, layout: Layout,
                       batch_size: int | None) -> list[list[Any]]:
    """Each sample to exactly one replica, none repeated: a contiguous share of the whole order cut into
    batches, or (for a batch sampler) this replica's share of each of its batches."""
    if ends is None:
        assert batch_size is not None
        share = split_evenly(order, layout.replicas)[layout.replica]
        return [share[i : i + batch_size] for i in range(0, len(share), batch_size)]
    shares = (split_evenly(order[lo:hi], layout.replicas)[layout.replica] for lo, hi in zip([0, *ends], ends))
    return [s for s in shares if s]
