"""Micro-batches: splitting a batch, and choosing how many by measuring.

The tutorials end with "the best split_size depends on the environment and the model". A full sweep
over every micro-batch count finds it but costs a step per candidate, and the large counts are the
slow ones. The search here uses the shape of a pipeline's step time instead: with K stages, M
micro-batches, t the stage time of the whole batch and o a fixed cost per micro-batch,

    T(M) = (M + K - 1) * (t / M + o)          (the bubble shrinks with M, the overhead grows)

Two measurements fix t and o, the model's minimum sqrt(t (K-1) / o) says where to look, and a short
walk over the measured neighbours of the best point corrects for where the model is wrong. The result
keeps every measured point (the curve), so a benchmark can plot it next to the full sweep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import ParatrainError


def batch_size(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0])
    if isinstance(value, list | tuple) and value:
        return batch_size(value[0])
    if isinstance(value, dict) and value:
        return batch_size(next(iter(value.values())))
    raise ParatrainError(f"cannot find the batch dimension of a {type(value).__name__}; pass tensors")


def split(value: Any, chunks: int) -> list[Any]:
    """`chunks` pieces along dim 0 of every tensor in `value` (any nesting torch's pytree knows: tuples,
    lists, dicts, Hugging Face ModelOutputs); sizes differ by at most one; other leaves are repeated."""
    leaves, spec = pytree.tree_flatten(value)
    parts = [list(torch.tensor_split(x, chunks)) if isinstance(x, torch.Tensor) and x.dim() else [x] * chunks
             for x in leaves]
    return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(chunks)]


def merge(values: Sequence[Any]) -> Any:
    """Inverse of `split`: tensors concatenated along dim 0, in the structure (and type) of the first value;
    a 0-d tensor or another leaf is taken from the first."""
    flats = [pytree.tree_flatten(v)[0] for v in values]
    spec = pytree.tree_flatten(values[0])[1]
    leaves = [torch.cat(list(group)) if isinstance(group[0], torch.Tensor) and group[0].dim() else group[0]
              for group in zip(*flats)]
    return pytree.tree_unflatten(leaves, spec)


def check_even(batch: int, microbatches: int, where: str) -> None:
    """Pipelines across processes need equal micro-batches (fixed buffer shapes, mean of equal means)."""
    if batch < microbatches or batch % microbatches:
        fits = max(d for d in range(1, min(batch, microbatches) + 1) if batch % d == 0)
        raise ParatrainError(
            f"{where}: batch {batch} cannot be split into {microbatches} micro-batches of equal size "
            f"({batch} % {microbatches} = {batch % microbatches}); use a batch divisible by {microbatches} "
            f"(e.g. {max(microbatches, batch // microbatches * microbatches)}; DataLoader(drop_last=True) "
            f"drops a short last batch) or microbatches={fits}"
        )


def divisors(n: int, low: int = 1, high: int | None = None) -> list[int]:
    high = n if high is None else min(n, high)
    return [d for d in range(max(1, low), high + 1) if n % d == 0]


@dataclass
class Search:
    """What a micro-batch search measured."""

    best: int
    curve: dict[int, float] = field(default_factory=dict)
    """Micro-batch count -> measured seconds per step, in the order measured."""
    seconds: float = 0.0
    """Wall time the search took."""
    method: str = "search"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "curve": {str(k): v for k, v in self.curve.items()}}


def _fit(points: dict[int, float], stages: int) -> tuple[float, float]:
    """Least-squares t, o >= 0 of T(M) = t (M+K-1)/M + o (M+K-1) over the measured points."""
    rows = [((m + stages - 1) / m, float(m + stages - 1), y) for m, y in points.items()]
    saa = sum(a * a for a, _, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    say = sum(a * y for a, _, y in rows)
    sby = sum(b * y for _, b, y in rows)
    det = saa * sbb - sab * sab
    if abs(det) < 1e-18:
        return max(say / saa, 0.0), 0.0
    t = (say * sbb - sby * sab) / det
    o = (saa * sby - sab * say) / det
    if t < 0 or o < 0:  # clamp to the better one-parameter fit
        t1, o1 = max(say / saa, 0.0), max(sby / sbb, 0.0)
        err_t = sum((y - t1 * a) ** 2 for a, _, y in rows)
        err_o = sum((y - o1 * b) ** 2 for _, b, y in rows)
        return (t1, 0.0) if err_t <= err_o else (0.0, o1)
    return t, o


def _model(m: int, t: float, o: float, stages: int) -> float:
    return (m + stages - 1) * (t / m + o)


def search(measure: Callable[[int], float], candidates: Sequence[int], stages: int,
           budget: int | None = None) -> Search:
    """Pick a fast micro-batch count from `candidates` measuring only a few of them (at most `budget`).

    `measure(m)` returns seconds per step; it must be deterministic in which `m` it is given, so that
    every process of a pipeline runs the same trials (timings are agreed on before they are returned).
    """
    cands = sorted(set(candidates))
    if not cands:
        raise ParatrainError("no micro-batch count fits this batch and schedule; pass microbatches=N")
    start = time.perf_counter()
    budget = budget or len(cands)
    curve: dict[int, float] = {}

    def at(i: int) -> float:
        m = cands[i]
        if m not in curve:
            curve[m] = measure(m)
        return curve[m]

    def nearest(m: float) -> int:
        return min(range(len(cands)), key=lambda i: abs(math.log(cands[i] / m)))

    # Two probes where pipelines usually do best (2K and 8K micro-batches) fix t and o ...
    first = nearest(2 * stages)
    second = nearest(8 * stages)
    if second == first:
        second = first + 1 if first + 1 < len(cands) else first - 1
    for i in (first, second):
        if 0 <= i < len(cands):
            at(i)
    # ... and the model's minimum is measured next.
    if len(curve) >= 2:
        t, o = _fit(curve, stages)
        at(min(range(len(cands)), key=lambda i: _model(cands[i], t, o, stages)))
    # Walk downhill over unmeasured neighbours of the best point while the time spent stays within a
    # third of what the fitted model says a full sweep would cost.
    while len(curve) < min(budget, len(cands)):
        t, o = _fit(curve, stages)
        best = cands.index(min(curve, key=lambda m: curve[m]))
        options = [i for i in (best - 1, best + 1) if 0 <= i < len(cands) and cands[i] not in curve]
        if not options:
            break
        options.sort(key=lambda i: _model(cands[i], t, o, stages))
        full = sum(curve.get(m, _model(m, t, o, stages)) for m in cands)
        if sum(curve.values()) + _model(cands[options[0]], t, o, stages) > full / 3:
            break
        before = min(curve.values())
        at(options[0])
        if curve[cands[options[0]]] >= before and len(options) == 1:
            break
    best_m = min(curve, key=lambda m: curve[m])
    return Search(best=best_m, curve=curve, seconds=time.perf_counter() - start, method="search")


def sweep(measure: Callable[[int], float], candidates: Sequence[int]) -> Search:
    """Measure every candidate (the reference the search is judged against)."""
    start = time.perf_counter()
    curve = {m: measure(m) for m in sorted(set(candidates))}
    return Search(best=min(curve, key=lambda m: curve[m]), curve=curve,
                  seconds=time.perf_counter() - start, method="sweep")


def pipeline_bound(stages: int, microbatches: int | str | None) -> float:
    """The best speedup of a K-stage pipeline of M micro-batches over one device: K*M/(M+K-1), the bubble
    being K-1 of its M+K-1 slots ("auto": the limit K that many micro-batches approach; None: one)."""
    if microbatches is None:
        microbatches = 1
    if not isinstance(microbatches, int):
        return float(stages)
    return stages * microbatches / (microbatches + stages - 1)
