"""Per-stage memory: parameters, activations autograd keeps for backward, and the schedule's bound.

Activation memory is measured, not estimated: a saved-tensor hook sees every tensor autograd keeps
for the backward pass, counts each storage once (a ReLU output saved by the next Linear too is one
tensor), skips parameters, and notices when a storage is released because its graph was freed. That
gives the peak for one micro-batch through a stage and the peak over a whole scheduled step.

The schedule bounds how many micro-batches a stage holds at once: GPipe runs every forward before any
backward, so it holds all M; 1F1B starts backwards as soon as the last stage can, so stage s of K
holds at most K - s. The bound is read off the schedule's own action list, so interleaved and
zero-bubble schedules are covered by the same rule.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ... import _forwards
from ..tensor import local_part

_ACTION = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")


def param_bytes(module: nn.Module) -> int:
    return sum(local_part(p).numel() * p.element_size() for p in module.parameters())


class _Held:
    """What autograd stores instead of the tensor; its death means the graph let the tensor go."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _held_data(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds the data: a DTensor's local piece, or the result inside torch's
    AsyncCollectiveTensor (a tensor-parallel layer's all-reduced output, which has no storage of its own)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    local = local_part(tensor)
    return local.elem if isinstance(local, AsyncCollectiveTensor) else local


class ActivationMeter:
    """Live and peak bytes of distinct storages saved for backward while active.

    `owner` names who is running (a stage index); each storage is charged to the owner that first
    saved it, so one meter over a whole scheduled step also gives every stage's own live and peak bytes.
    """

    def __init__(self, exclude: Iterable[nn.Module] = ()) -> None:
        self._skip = {local_part(p).untyped_storage().data_ptr() for m in exclude for p in m.parameters()}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references, owner]
        self.current = 0
        self.peak = 0
        self.owner = -1
        self.owned: dict[int, int] = {}
        """Live bytes per owner."""
        self.owned_peak: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter) or tensor.device.type == "meta":
            return tensor
        storage = _held_data(tensor).untyped_storage()
        key = storage.data_ptr()
        if key in self._skip or key == 0:
            return tensor
        entry = self._live.setdefault(key, [storage.nbytes(), 0, self.owner])
        if entry[1] == 0:
            self._charge(entry[2], entry[0])
        entry[1] += 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, key)
        return held

    def _charge(self, owner: int, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self.owned[owner] = self.owned.get(owner, 0) + nbytes
        self.owned_peak[owner] = max(self.owned_peak.get(owner, 0), self.owned[owner])

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            self.owned[entry[2]] -= entry[0]
            del self._live[key]

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    @contextmanager
    def measure(self) -> Iterator[ActivationMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


@contextmanager
def watch_stages(stages: Sequence[nn.Module],
                 indices: Sequence[int]) -> Iterator[tuple[ActivationMeter, dict[int, int]]]:
    """Measure a training step of pipeline stages: yields the meter (its peak, and each stage's own peak
    under `owned_peak`) and a dict filled with the bytes one micro-batch's forward saves, per stage index
    (the largest over the micro-batches seen). Storages saved outside any stage (the loss) are charged to
    the stage that ran last, as they belong to its micro-batch. The stages' forwards are wrapped for the
    duration only; no module hooks are left behind."""
    meter = ActivationMeter(exclude=stages)
    first: dict[int, int] = {}

    def watched(forward: Any, index: int) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            meter.owner = index
            start = meter.owned.get(index, 0)
            out = forward(*args, **kwargs)
            first[index] = max(first.get(index, 0), meter.owned.get(index, 0) - start)
            return out
        return run

    for stage, index in zip(stages, indices):
        _forwards.replace(stage, watched(stage.forward, index), "activation meter")
    try:
        with meter.measure():
            yield meter, first
    finally:
        for stage in stages:
            _forwards.restore(stage)


def in_flight(pipeline_order: dict[int, list[Any]] | None, rank: int, stage_bytes: dict[int, int]) -> tuple[int, int]:
    """(most micro-batch activations held at once, their bytes) for `rank`, by walking its actions.

    A forward adds the stage's per-micro-batch activations; a full backward (B) or a weight
    backward (W, zero-bubble schedules) releases them.
    """
    if not pipeline_order or rank not in pipeline_order:
        return 0, 0
    held: dict[tuple[int, int], int] = {}
    most = most_bytes = 0
    for action in pipeline_order[rank]:
        match = _ACTION.match(str(action)) if action is not None else None
        if not match:
            continue
        stage, kind, mb = int(match.group(1)), match.group(2), int(match.group(3))
        if kind == "F":
            held[(stage, mb)] = stage_bytes.get(stage, 0)
        elif kind in ("B", "W"):
            held.pop((stage, mb), None)
        most = max(most, len(held))
        most_bytes = max(most_bytes, sum(held.values()))
    return most, most_bytes


@dataclass
class StageMemory:
    """Memory of the stage(s) one worker (or device) holds."""

    stages: list[int]
    params_bytes: int
    activation_per_microbatch_bytes: int
    """Measured: one micro-batch's saved activations, summed over the stages listed."""
    in_flight_bound: int
    """Most micro-batches the schedule keeps at once on these stages."""
    activation_bound_bytes: int
    """What the schedule allows: the in-flight micro-batches times their measured activations."""
    peak_activation_bytes: int
    """Measured peak over one real training step."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_report(rows: list[StageMemory], schedule: str, microbatches: int) -> str:
    lines = [f"paratrain: memory ({schedule}, {microbatches} micro-batches)",
             f"  {'stages':<8} {'params':>10} {'act/micro-batch':>16} {'in flight':>9} {'bound':>10} "
             f"{'measured peak':>14}"]
    for row in rows:
        lines.append(
            f"  {','.join(map(str, row.stages)):<8} {_size(row.params_bytes):>10} "
            f"{_size(row.activation_per_microbatch_bytes):>16} {row.in_flight_bound:>9} "
            f"{_size(row.activation_bound_bytes):>10} {_size(row.peak_activation_bytes):>14}"
        )
    return "\n".join(lines)
