"""Discrete-event simulation of the real pipeline schedules, not a bubble formula: the bound each schedule
allows (`schedule_speedup`) and, with measured stage costs, the planner's pipeline step time.

The order of work on each pipeline rank is torch.distributed.pipelining's own: its schedule classes
compute `pipeline_order` (rank -> actions such as 0F1, 1B0, 2I3, 2W3) when constructed, from nothing
but the stage layout, so they are built here with stand-in stages and no process group. Each rank then
runs its actions in that order, each as soon as its inputs exist:

    F(s, m)  after F(s-1, m) and its send          B/I(s, m)  after B/I(s+1, m) and its send
    W(s, m)  after I(s, m)                         (a send is free between stages on one rank)

    gpipe, 2 ranks, 3 micro-batches, backward = 2 x forward
    rank 0  F0 F1 F2 .  .  .  .  B0 B0 B1 B1 B2 B2
    rank 1  .  F0 F1 F2 B0 B0 B1 B1 B2 B2 .  .  .       step = (M+K-1)(f+b) = 4 x 3 slots

So the bubble, the in-flight micro-batches (and their activation memory) and the exposed sends all
follow from the schedule torch will run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from ...errors import ParatrainError
from .memory import in_flight
from .schedules import row, stage_owners

Action = tuple[int, str, int]
"""(stage, kind, micro-batch); kind is F, B (full backward), I (input gradient) or W (weight gradient)."""


def _order_class(schedule: str, per_worker: int) -> type:
    """torch's schedule class, minus the lowering to send/receive actions that running it needs (quadratic
    in the actions, and not what is simulated here); the action lists are computed before that step."""
    cls = row(schedule).torch_class(per_worker)
    if not hasattr(cls, "_prepare_schedule_with_comms"):
        return cls

    def validate_only(self: object, actions: dict[int, list[object]], format: str = "compute_only") -> None:
        self._validate_and_set_stage_mapping(actions)  # type: ignore[attr-defined]

    return type(f"Order{cls.__name__}", (cls,), {"_prepare_schedule_with_comms": validate_only})


def stage_ranks(schedule: str, pp: int, per_worker: int) -> dict[int, int]:
    return stage_owners(schedule, pp, per_worker)


@lru_cache(maxsize=256)
def pipeline_order(schedule: str, pp: int, per_worker: int, microbatches: int) -> dict[int, tuple[Action, ...]]:
    """torch's action list per rank for this layout (compute actions only, idle slots dropped)."""
    stages = pp * per_worker
    where = stage_ranks(schedule, pp, per_worker)

    def stand_in(index: int) -> SimpleNamespace:
        return SimpleNamespace(num_stages=stages, group_size=pp, group_rank=where[index], stage_index=index,
                               is_first=index == 0, is_last=index == stages - 1, submod=None)

    cls = _order_class(schedule, per_worker)
    try:
        if not row(schedule).multi_stage:
            order = cls(stand_in(0), microbatches).pipeline_order
        else:
            mine = sorted(i for i, r in where.items() if r == 0)
            order = cls([stand_in(i) for i in mine], microbatches).pipeline_order
    except (ValueError, RuntimeError) as exc:
        raise ParatrainError(f"schedule {schedule!r} with {stages} stages on {pp} workers cannot run {microbatches} "
                             f"micro-batches: {exc}. Choose a multiple of {pp} micro-batches") from None
    return {rank: _renumber(actions) for rank, actions in order.items()}


def _renumber(actions: Sequence[object]) -> tuple[Action, ...]:
    """Compute actions as tuples. Every schedule runs a stage's forwards (and backwards) in micro-batch
    order, so the n-th F of a stage is micro-batch n; this also repairs torch's informational order for
    1F1B, which labels the last rank's forwards from 1 instead of 0."""
    seen: dict[tuple[int, str], int] = defaultdict(int)
    out = []
    for action in actions:
        if action is None:
            continue
        kind = action.computation_type.value  # type: ignore[attr-defined]
        if kind not in ("F", "B", "I", "W"):
            continue
        stage = int(action.stage_index)  # type: ignore[attr-defined]
        out.append((stage, kind, seen[(stage, kind)]))
        seen[(stage, kind)] += 1
    return tuple(out)


@dataclass(frozen=True)
class StageCost:
    """One stage's work on one micro-batch, and what it sends."""

    forward: float
    backward: float
    """Full backward (input and weight gradients)."""
    weight_share: float = 0.5
    activation_bytes: float = 0.0
    """Saved for backward per micro-batch (held from F until B, or until W when split)."""
    send: float = 0.0
    """Seconds to send this stage's output forward (its input gradient travels back the same size)."""


@dataclass
class PipelineRun:
    step: float
    busy: list[float]
    """Compute seconds per rank."""
    in_flight: list[int]
    """Most micro-batches whose activations a rank holds at once."""
    activation_peak: list[float]
    """Bytes of those activations at their peak, per rank."""
    comm_wait: float = 0.0
    """Time the busiest rank spends waiting only on sends (not on the schedule's fill and drain)."""

    @property
    def bubble(self) -> float:
        """Idle share of the step, averaged over ranks."""
        if self.step <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step)


def _duration(cost: StageCost, kind: str) -> float:
    if kind == "F":
        return cost.forward
    if kind == "B":
        return cost.backward
    return cost.backward * (cost.weight_share if kind == "W" else 1 - cost.weight_share)


def simulate(order: dict[int, tuple[Action, ...]], costs: Sequence[StageCost], where: dict[int, int],
             overhead: float = 0.0, overlap: float = 1.0) -> PipelineRun:
    """Run every rank's actions in order, each when its inputs have arrived; returns the step time.

    `overhead` is added to every action (runtime cost per action); with overlap < 1 a rank also spends
    (1 - overlap) of each of its sends itself (a CPU worker's core does gloo's copies).
    """
    last = len(costs) - 1
    finish: dict[Action, float] = {}
    clock = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    waited = dict.fromkeys(order, 0.0)
    pointer = dict.fromkeys(order, 0)

    def arrival(stage: int, kind: str, mb: int, to_stage: int) -> float | None:
        done = finish.get((stage, kind, mb))
        if done is None and kind == "B":
            done = finish.get((stage, "I", mb))
        if done is None:
            return None
        moved = where[stage] != where[to_stage]
        return done + (costs[min(stage, to_stage)].send if moved else 0.0)

    def ready(action: Action) -> float | None:
        stage, kind, mb = action
        if kind == "F":
            return 0.0 if stage == 0 else arrival(stage - 1, "F", mb, stage)
        if kind == "W":
            return finish.get((stage, "I", mb))
        if stage == last:
            return finish.get((stage, "F", mb))
        return arrival(stage + 1, "B", mb, stage)

    remaining = sum(len(actions) for actions in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while pointer[rank] < len(actions):
                action = actions[pointer[rank]]
                at = ready(action)
                if at is None:
                    break
                stage, kind, _ = action
                start = max(clock[rank], at)
                if at > clock[rank] and kind != "W":
                    data_ready = _produced(action, finish, last)
                    waited[rank] += max(0.0, at - max(clock[rank], data_ready))
                work = _duration(costs[stage], kind) + overhead
                end = start + work
                finish[action] = end
                clock[rank] = end + (1 - overlap) * _send_time(stage, kind, last, where, costs)
                busy[rank] += work
                pointer[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: order[r][pointer[r]] for r in order if pointer[r] < len(order[r])}
            raise ParatrainError(f"pipeline schedule deadlocks: ranks wait on {stuck}; the action lists are "
                                 "inconsistent (report this with the schedule and sizes)")
    ranks = sorted(order)
    held = [_held(r, order[r], costs) for r in ranks]
    busiest = max(ranks, key=lambda r: busy[r])
    return PipelineRun(step=max(clock.values()) if clock else 0.0, busy=[busy[r] for r in ranks],
                       in_flight=[h[0] for h in held], activation_peak=[h[1] for h in held],
                       comm_wait=waited[busiest])


EXACT_UP_TO = 64
"""Micro-batch counts up to this are simulated action by action; see `run_schedule` beyond."""


def run_schedule(schedule: str, pp: int, per_worker: int, microbatches: int, costs: Sequence[StageCost],
                 overhead: float = 0.0, overlap: float = 1.0) -> PipelineRun:
    """Simulate `schedule`. Past EXACT_UP_TO micro-batches every schedule is in its steady state, which
    repeats one period per micro-batch (per round of pp for the interleaved ones), so step, busy time and
    held micro-batches grow linearly in M: two exact runs at m and 2m (multiples of pp) give the line.
    Runs are cached by their inputs (the planner asks again for the same stages: copied and sharded replicas
    of one pipeline differ only after the schedule); callers read the result and must not change it."""
    return _run_schedule(schedule, pp, per_worker, microbatches, tuple(costs), overhead, overlap)


@lru_cache(maxsize=1024)
def _run_schedule(schedule: str, pp: int, per_worker: int, microbatches: int, costs: tuple[StageCost, ...],
                  overhead: float, overlap: float) -> PipelineRun:
    where = stage_ranks(schedule, pp, per_worker)
    if microbatches <= EXACT_UP_TO:
        return simulate(pipeline_order(schedule, pp, per_worker, microbatches), costs, where, overhead, overlap)
    m1 = -(-EXACT_UP_TO // 2 // pp) * pp
    m2 = 2 * m1
    r1, r2 = (simulate(pipeline_order(schedule, pp, per_worker, m), costs, where, overhead, overlap) for m in (m1, m2))

    def line(a: float, b: float) -> float:
        return b + (b - a) / (m2 - m1) * (microbatches - m2)

    return PipelineRun(step=line(r1.step, r2.step), busy=[line(a, b) for a, b in zip(r1.busy, r2.busy)],
                       in_flight=[round(line(a, b)) for a, b in zip(r1.in_flight, r2.in_flight)],
                       activation_peak=[line(a, b) for a, b in zip(r1.activation_peak, r2.activation_peak)],
                       comm_wait=line(r1.comm_wait, r2.comm_wait))


@lru_cache(maxsize=256)
def schedule_speedup(schedule: str, pp: int, per_worker: int, microbatches: int) -> float:
    """The best speedup `schedule` allows over one device: equal stages, backward twice the forward, free
    sends. For 1F1B and GPipe this is K*M/(M+K-1); zero-bubble and interleaved schedules fill part of that
    bubble, so their own bound is higher (2 workers, M=4: 1F1B 1.60, interleaved 1.78, ZBV 1.92)."""
    stages = pp * per_worker
    unit = StageCost(forward=1.0 / per_worker, backward=2.0 / per_worker)
    run = run_schedule(schedule, pp, per_worker, microbatches, [unit] * stages)
    return sum(run.busy) / run.step


def _produced(action: Action, finish: dict[Action, float], last: int) -> float:
    """When the producing action finished (its data could have arrived at once)."""
    stage, kind, mb = action
    if kind == "F":
        return finish.get((stage - 1, "F", mb), 0.0) if stage else 0.0
    if stage == last:
        return finish.get((stage, "F", mb), 0.0)
    return finish.get((stage + 1, "B", mb), finish.get((stage + 1, "I", mb), 0.0))


def _send_time(stage: int, kind: str, last: int, where: dict[int, int], costs: Sequence[StageCost]) -> float:
    """Seconds of the send that follows this action: its output forward, or its input gradient (the size of
    the previous stage's output) back; nothing between stages on one rank, nor after W."""
    if kind == "F" and stage < last and where[stage + 1] != where[stage]:
        return costs[stage].send
    if kind in ("B", "I") and stage > 0 and where[stage - 1] != where[stage]:
        return costs[stage - 1].send
    return 0.0


def _held(rank: int, actions: Sequence[Action], costs: Sequence[StageCost]) -> tuple[int, float]:
    """(most micro-batches held at once, their bytes), by the rule the pipelines report memory with."""
    text = {rank: [f"{stage}{kind}{mb}" for stage, kind, mb in actions]}
    most, most_bytes = in_flight(text, rank, {s: int(c.activation_bytes) for s, c in enumerate(costs)})
    return most, float(most_bytes)
