"""The pipeline schedules, as one table: torch's class for each, where its stages sit, how many stages a
worker holds, which micro-batch counts it runs and which ones `schedule="auto"` tries. The pipeline engine,
config validation, the bench and the planner all read these rows, so a schedule is added here once.

    name               torch class                          stages/worker  micro-batches M (K = stages)
    gpipe              ScheduleGPipe                        1              any
    1f1b               Schedule1F1B                         1              M >= K
    interleaved-1f1b   ScheduleInterleaved1F1B   (loop)     2+             whole rounds of pp
    zero-bubble        ScheduleZBVZeroBubble     (V, 2)     2+ (or 1)      whole rounds of pp
                       ScheduleInterleavedZeroBubble (loop, otherwise)

The best speedup a schedule allows (its bound) is `simulate.schedule_speedup`: torch's own action order run
with equal stages, since interleaved and zero-bubble schedules beat the K*M/(M+K-1) of GPipe and 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ParatrainError, unknown_name


@dataclass(frozen=True)
class ScheduleRow:
    name: str
    torch_name: str
    """The class in torch.distributed.pipelining.schedules."""
    multi_stage: bool
    """Drives a list of stages per worker (torch's PipelineScheduleMulti); single-stage ones hold one."""
    v_torch_name: str | None = None
    """The class for the V layout (2 stages per worker: rank r holds stage r and its mirror), if it has one."""
    needs_microbatches_per_stage: bool = False
    """M >= K: 1F1B's steady state needs a micro-batch in flight per stage."""
    splits_backward: bool = False
    """Runs each micro-batch's backward as two passes (input, then weight gradients); torch's selective
    activation checkpointing allows one backward through what it recomputes, so the two do not combine."""

    @property
    def default_per_worker(self) -> int:
        """Stages per worker the bench, the planner's validation and the search run it with."""
        return 2 if self.multi_stage else 1

    def v_layout(self, per_worker: int) -> bool:
        return self.v_torch_name is not None and per_worker == 2

    def torch_class(self, per_worker: int) -> type:
        from torch.distributed.pipelining import schedules

        name = self.v_torch_name if self.v_torch_name is not None and per_worker == 2 else self.torch_name
        cls: type = getattr(schedules, name)
        return cls

    def stage_indices(self, pp_rank: int, pp: int, per_worker: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds: loop (r, r+pp, ...) or V (r and 2pp-1-r)."""
        if self.v_layout(per_worker):
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + v * pp for v in range(per_worker)]

    def accepts(self, microbatches: int, pp: int, per_worker: int) -> bool:
        """Whether this schedule runs `microbatches` on pp x per_worker stages."""
        if self.needs_microbatches_per_stage and microbatches < pp * per_worker:
            return False
        return not self.multi_stage or microbatches % max(1, microbatches // pp) == 0

    def min_microbatches(self, pp: int, per_worker: int) -> int:
        return pp * per_worker if self.needs_microbatches_per_stage else 1

    def fewest(self, pp: int, per_worker: int, batch: int) -> int | None:
        """The fewest equal micro-batches of `batch` this schedule runs (None: no count divides `batch`)."""
        return next((m for m in range(1, batch + 1) if batch % m == 0 and self.accepts(m, pp, per_worker)), None)

    def check_stages(self, per_worker: int) -> None:
        if not self.multi_stage and per_worker != 1:
            raise ParatrainError(
                f"schedule {self.name!r} runs one stage per worker but stages_per_worker={per_worker}; use "
                f"schedule={' or '.join(repr(r.name) for r in ROWS if r.multi_stage)} for several stages per "
                "worker, or stages_per_worker=1")

    def check_microbatches(self, pp: int, per_worker: int, microbatches: int) -> None:
        stages = pp * per_worker
        if self.needs_microbatches_per_stage and microbatches < stages:
            raise ParatrainError(
                f"schedule {self.name!r} needs at least as many micro-batches as stages: microbatches={microbatches} "
                f"< {stages} stages (pp {pp} x stages_per_worker {per_worker}); use microbatches>={stages} "
                f"(e.g. {2 * stages}), microbatches='auto' or schedule='gpipe'")
        if not self.accepts(microbatches, pp, per_worker):
            raise ParatrainError(
                f"schedule {self.name!r} runs whole rounds of micro-batches (one per pipeline rank): "
                f"microbatches={microbatches} is not a multiple of {max(1, microbatches // pp)}; use a multiple of "
                f"{pp} or microbatches='auto'")


ROWS = (
    ScheduleRow("gpipe", "ScheduleGPipe", multi_stage=False),
    ScheduleRow("1f1b", "Schedule1F1B", multi_stage=False, needs_microbatches_per_stage=True),
    ScheduleRow("interleaved-1f1b", "ScheduleInterleaved1F1B", multi_stage=True),
    ScheduleRow("zero-bubble", "ScheduleInterleavedZeroBubble", multi_stage=True, v_torch_name="ScheduleZBVZeroBubble",
                splits_backward=True),
)
NAMES = tuple(row.name for row in ROWS)
_BY_NAME = {row.name: row for row in ROWS}


def row(name: str) -> ScheduleRow:
    if name not in _BY_NAME:
        raise unknown_name("schedule", name, NAMES)
    return _BY_NAME[name]


def _one_backward(checkpointing: str, compiling: bool) -> str | None:
    """What allows a single backward pass through a micro-batch's graph, if anything does."""
    if checkpointing == "selective":
        return ("torch's selective activation checkpointing allows one backward through what it recomputes; use "
                "activation_checkpointing='full' (which zero-bubble runs) or another schedule")
    if compiling:
        return ("a torch.compile'd block allows one backward (its compiled backward frees the saved tensors it "
                "is given); use compile=False with this schedule, or another schedule (1f1b, interleaved-1f1b)")
    return None


def auto_names(per_worker: int, checkpointing: str = "none", compiling: bool = False) -> list[str]:
    """What schedule="auto" chooses among for `per_worker` stages per worker, the first tried first: the
    schedules that run that many stages per worker in the loop layout, 1F1B first for one stage per worker
    (none that splits the backward where only one backward may run: selective checkpointing, compile)."""
    order = ("1f1b", "zero-bubble", "gpipe") if per_worker == 1 else ("interleaved-1f1b", "zero-bubble")
    single = _one_backward(checkpointing, compiling) is not None
    return [name for name in order
            if (per_worker == 1 or _BY_NAME[name].multi_stage) and not _BY_NAME[name].v_layout(per_worker)
            and not (single and _BY_NAME[name].splits_backward)]


def check(schedule: str, pp: int, per_worker: int, microbatches: int | str | None, checkpointing: str = "none",
          compiling: bool = False) -> None:
    """Refuse a layout the schedule cannot run, before any process waits on a peer ("auto" chooses among
    what runs, and an unset count is chosen to fit, so only a named schedule and a given count are checked)."""
    if schedule == "auto":
        return
    rule = row(schedule)
    why = _one_backward(checkpointing, compiling)
    if why and rule.splits_backward:
        raise ParatrainError(f"schedule {schedule!r} runs each micro-batch's backward in two passes, and {why}")
    rule.check_stages(per_worker)
    if isinstance(microbatches, int):
        rule.check_microbatches(pp, per_worker, microbatches)


def default_microbatches(schedule: str, pp: int, per_worker: int, batch: int, where: str) -> int:
    """The micro-batch count when none is given: the fewest equal micro-batches of `batch` the schedule runs, so a
    step is split no finer than the schedule needs (1F1B: one per stage; GPipe: the whole batch)."""
    rule = row(schedule)
    count = rule.fewest(pp, per_worker, batch)
    if count is None:
        least = rule.min_microbatches(pp, per_worker)
        raise ParatrainError(
            f"{where}: schedule {schedule!r} on {pp * per_worker} stages runs at least {least} equal micro-batches, "
            f"which a batch of {batch} rows cannot give; use a batch divisible by {least} (e.g. {2 * least}), or "
            "schedule='gpipe', which runs any count")
    return count


def stage_indices(schedule: str, pp_rank: int, pp: int, per_worker: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds under `schedule` ("auto" never picks a V layout: loop)."""
    return row("gpipe" if schedule == "auto" else schedule).stage_indices(pp_rank, pp, per_worker)


def stage_owners(schedule: str, pp: int, per_worker: int) -> dict[int, int]:
    """Stage -> the pipeline rank that holds it."""
    return {s: r for r in range(pp) for s in stage_indices(schedule, r, pp, per_worker)}
