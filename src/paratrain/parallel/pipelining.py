"""Glue over torch.distributed.pipelining: this worker's stages of a pipeline and its schedule.

One process per pipeline rank; each holds `stages_per_worker` stages of the K = pp x stages_per_worker
stages, in torch's layouts (loop for interleaved schedules, V for the ZBV zero-bubble one):

    1f1b, 2 workers, 4 micro-batches        (F = forward, B = backward, . = bubble)
    rank 0   F0 F1 .  .  B0 F2 B1 F3 B2 .  B3
    rank 1   .  F0 B0 F1 B1 F2 B2 F3 B3

The model is split at the first step, when a batch exists to measure layers with; every rank profiles
and the timings are averaged over all ranks, so all ranks cut the model identically. Parameters of the
stages a rank does not hold are emptied, so the memory a pipeline saves is really saved.

The loss of a step is the mean of the micro-batch losses (each is divided by M before its backward),
which equals the full-batch mean loss because micro-batches have equal size; uneven splits are refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._tree import map_tensors
from ..collectives import max_over_world, mean_over_world
from ..errors import ParatrainError, unknown_name
from .balance import choose_balance, describe
from .memory import ActivationMeter, StageMemory, format_report, in_flight, param_bytes
from .microbatch import Search, batch_size, check_even, divisors, search, split
from .partition import Stage, layers_of, merged, split_into_stages
from .plan import Plan
from .trial import no_trace, step_time

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def _schedule_class(name: str, per_worker: int) -> type:
    from torch.distributed.pipelining import schedules as s

    if name == "zero-bubble":
        return s.ScheduleZBVZeroBubble if per_worker == 2 else s.ScheduleInterleavedZeroBubble
    return {"gpipe": s.ScheduleGPipe, "1f1b": s.Schedule1F1B,
            "interleaved-1f1b": s.ScheduleInterleaved1F1B}[name]


def check_layout(schedule: str, pp: int, per_worker: int, microbatches: int | str) -> None:
    """Reject schedule/stage/micro-batch combinations torch would refuse, before any process waits."""
    if schedule not in SCHEDULES:
        raise unknown_name("schedule", schedule, SCHEDULES)
    if per_worker < 1:
        raise ParatrainError(f"stages_per_worker must be >= 1, got {per_worker}")
    if schedule in ("gpipe", "1f1b") and per_worker != 1:
        raise ParatrainError(
            f"schedule {schedule!r} runs one stage per worker but stages_per_worker={per_worker}; use "
            "schedule='interleaved-1f1b' or 'zero-bubble' for several stages per worker, or stages_per_worker=1"
        )
    if microbatches == "auto":
        return
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ParatrainError(f"microbatches must be a positive int or 'auto', got {microbatches!r}")
    stages = pp * per_worker
    if schedule == "1f1b" and microbatches < stages:
        raise ParatrainError(
            f"schedule '1f1b' needs at least as many micro-batches as stages: microbatches={microbatches} < "
            f"{stages} stages (pp {pp} x stages_per_worker {per_worker}); use microbatches>={stages} "
            f"(e.g. {2 * stages}), microbatches='auto' or schedule='gpipe'"
        )


def stage_indices(schedule: str, pp_rank: int, pp: int, per_worker: int) -> list[int]:
    if schedule == "zero-bubble" and per_worker == 2:  # V: rank r holds stage r and its mirror
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(per_worker)]


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, list | tuple | dict):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return tuple((k, _signature(v)) for k, v in items)
    return type(value).__name__


class PipelineModule(nn.Module):
    """This worker's stages; `module(inputs, targets, loss_fn)` runs one scheduled step and returns the
    mean loss over the whole global batch (on every rank)."""

    def __init__(self, model: nn.Module, *, schedule: str, pp_rank: int, pp: int, per_worker: int,
                 device: torch.device, microbatches: int | str, balance: Sequence[int] | str,
                 group: Any = None, dp: int = 1, dp_group: Any = None, grad_accum: int = 1,
                 strategy: str = "pp") -> None:
        super().__init__()
        check_layout(schedule, pp, per_worker, microbatches)
        self.full = model
        self.schedule_name, self.pp_rank, self.pp, self.per_worker = schedule, pp_rank, pp, per_worker
        self.num_stages = pp * per_worker
        self.ids = stage_indices(schedule, pp_rank, pp, per_worker)
        self.device, self.group, self.dp, self.grad_accum = device, group, dp, grad_accum
        self.dp_group = dp_group
        self.sync_grads = True
        """False inside an accumulation window: replicas average gradients only when the optimizer steps."""
        self.microbatches: int | str = microbatches
        self.requested_balance = balance
        self.local: list[Stage] = []
        self.plan = Plan(strategy=strategy, stages=self.num_stages, microbatches=microbatches,
                         schedule=schedule, verbose=dist.get_rank() == 0)
        self._schedules: dict[Any, Any] = {}
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._measured = False
        self._meter: ActivationMeter | None = None
        self._loss_saved = 0
        self._loss_scale = 1

    # -- splitting --------------------------------------------------------------------------------
    @property
    def built(self) -> bool:
        return bool(self.local)

    def build(self, inputs: Any) -> None:
        sample_count = self.microbatches if isinstance(self.microbatches, int) else self.num_stages
        sample = (split(inputs, min(sample_count, batch_size(inputs)))[0],)
        layers = layers_of(self.full, sample)
        balance, costs = choose_balance(self.requested_balance, layers, self.num_stages, sample=sample,
                                        agree=lambda v: mean_over_world(v, self.device))
        stages = split_into_stages(layers, balance)
        self.local = [stages[i].to(self.device) for i in self.ids]
        mine = {id(p) for s in self.local for p in s.parameters()}
        for p in self.full.parameters():
            if id(p) not in mine:  # another worker's layer: keep the object (the optimizer holds it), drop the data
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None
        self._registered = nn.ModuleList(self.local)
        self.plan.balance = balance
        self.plan.layer_costs = costs
        self.plan.note(describe(balance, costs, self.requested_balance))
        del self.full  # only this worker's stages remain reachable through the wrapper

    def holds(self) -> nn.Module:
        """This worker's layers under their original names (what `unwrap` returns). Before the first step
        splits the model that is the whole model: a checkpoint loaded then restores every layer, and the
        split keeps this worker's share."""
        return merged(self.local) if self.built else self.full

    # -- schedules --------------------------------------------------------------------------------
    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        meter, before = self._meter, self._meter.current if self._meter else 0
        loss = self._loss_fn(output, target)
        if meter is not None:  # what the loss keeps for backward belongs to the last stage's micro-batch
            self._loss_saved = max(self._loss_saved, meter.current - before)
        return loss / self._loss_scale

    def _schedule(self, microbatches: int, inputs: Any) -> Any:
        key = (microbatches, _signature(inputs))
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            stages = [PipelineStage(stage, i, self.num_stages, self.device, group=self.group)
                      for stage, i in zip(self.local, self.ids)]
            cls = _schedule_class(self.schedule_name, self.per_worker)
            try:
                # The loss is scaled instead of the gradients (scale_grads=False): torch would divide all of
                # .grad, including what earlier micro-steps of an accumulation window left there.
                first = stages[0] if self.schedule_name in ("gpipe", "1f1b") else stages
                sched = cls(first, microbatches, loss_fn=self._loss, scale_grads=False)
            except ValueError as exc:
                raise ParatrainError(
                    f"schedule {self.schedule_name!r} with {self.num_stages} stages on {self.pp} workers "
                    f"cannot run {microbatches} micro-batches: {exc}. Choose another microbatches "
                    "(a multiple of the workers is always accepted) or microbatches='auto'"
                ) from None
            self._schedules = {k: v for k, v in self._schedules.items() if k[0] != microbatches}
            self._schedules[key] = (sched, stages)
        return self._schedules[key]

    def _run(self, inputs: Any, targets: Any, microbatches: int) -> torch.Tensor | None:
        sched, stages = self._schedule(microbatches, inputs)
        first = any(s.is_first for s in stages)
        last = any(s.is_last for s in stages)
        kwargs: dict[str, Any] = {}
        losses: list[torch.Tensor] = []
        if last:
            kwargs.update(target=targets, losses=losses)
        if _takes_return_outputs(sched):
            kwargs["return_outputs"] = False
        self._loss_scale = microbatches * self.grad_accum  # mean over micro-batches and micro-steps
        sched.step(*((inputs,) if first else ()), **kwargs)
        if not last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).sum() * self.grad_accum

    # -- the step ---------------------------------------------------------------------------------
    def forward(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        self._loss_fn = loss_fn
        inputs, targets = (map_tensors(lambda t: t.to(self.device), v) for v in (inputs, targets))
        batch = batch_size(inputs)
        if isinstance(self.microbatches, int):
            check_even(batch, self.microbatches, f"strategy {self.plan.strategy!r}")
        if not self.built:
            self.build(inputs)
        if self.microbatches == "auto":
            self._tune(inputs, targets, batch)
        assert isinstance(self.microbatches, int)
        if self._measured:
            local = self._run(inputs, targets, self.microbatches)
        else:
            local = self._measure_memory(inputs, targets)
        if self.dp > 1 and self.sync_grads:
            self._average_grads()
        value = local if local is not None else torch.zeros((), device=self.device)
        total = value.detach().float().clone()
        dist.all_reduce(total)  # only last-stage ranks contribute; one replica's loss each
        return total / self.dp

    def _average_grads(self) -> None:
        """Mean gradients over the replicas of this stage: one all-reduce per dtype, after the schedule.

        DDP itself cannot wrap a stage here: torch's pipeline stages drive DDP's reducer by hand, which
        fails its bucket rebuild after the first step once there is more than one micro-batch, and a
        zero-bubble weight backward bypasses DDP's hooks altogether.
        """
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for stage in self.local:
            for p in stage.parameters():
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.dp
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def candidates(self, batch: int) -> list[int]:
        """Micro-batch counts this schedule accepts for `batch` (equal micro-batches only)."""
        ok = []
        for m in divisors(batch):
            if self.schedule_name == "1f1b" and m < self.num_stages:
                continue
            if self.schedule_name not in ("gpipe", "1f1b") and m % max(1, m // self.pp):
                continue  # interleaved and zero-bubble schedules run whole rounds of pp micro-batches
            ok.append(m)
        return ok

    def measure(self, inputs: Any, targets: Any, microbatches: int, repeats: int = 3) -> float:
        """Seconds per step with `microbatches`, the slowest rank's median (collective; call inside
        `trial.no_trace` to keep the gradients a trial step makes out of training)."""
        inputs, targets = (map_tensors(lambda t: t.to(self.device), v) for v in (inputs, targets))
        seconds = step_time(lambda: self._run(inputs, targets, microbatches), repeats=repeats, warmup=1,
                              devices=[self.device])
        return max_over_world(seconds, self.device)

    def _tune(self, inputs: Any, targets: Any, batch: int) -> Search:
        candidates = self.candidates(batch)
        with no_trace(self.local):
            found = search(lambda m: self.measure(inputs, targets, m), candidates, self.num_stages)
        self.microbatches = found.best
        self.plan.microbatches = found.best
        self.plan.search = found
        self._schedules = {k: v for k, v in self._schedules.items() if k[0] == found.best}
        self.plan.note(f"microbatches auto -> {found.best} (measured {len(found.curve)} of "
                       f"{len(candidates)} counts in {found.seconds:.2f}s: "
                       + ", ".join(f"{m}: {t * 1e3:.1f}ms" for m, t in found.curve.items()) + ")")
        return found

    def _measure_memory(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        """The first real step, watched: per-stage activations of one micro-batch and the step's peak."""
        meter = ActivationMeter(exclude=self.local)
        starts: dict[int, int] = {}
        first: dict[int, int] = {}

        def pre(module: nn.Module, args: Any) -> None:
            starts[module.index] = meter.current  # type: ignore[index]

        def post(module: nn.Module, args: Any, out: Any) -> None:
            index: int = module.index  # type: ignore[assignment]
            first[index] = max(first.get(index, 0), meter.current - starts[index])

        hooks = [h for stage in self.local
                 for h in (stage.register_forward_pre_hook(pre), stage.register_forward_hook(post))]
        self._meter = meter
        try:
            with meter.measure():
                local = self._run(inputs, targets, int(self.microbatches))
        finally:
            self._meter = None
            for hook in hooks:
                hook.remove()
        if self.num_stages - 1 in first:
            first[self.num_stages - 1] += self._loss_saved
        self._measured = True
        sched, _ = self._schedule(int(self.microbatches), inputs)
        most, bound = in_flight(getattr(sched, "pipeline_order", None), self.pp_rank, first)
        row = StageMemory(stages=list(self.ids), params_bytes=sum(param_bytes(s) for s in self.local),
                          activation_per_microbatch_bytes=sum(first.values()), in_flight_bound=most,
                          activation_bound_bytes=bound, peak_activation_bytes=meter.peak)
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (dist.get_rank(), row))
        pipeline = sorted((r for r in rows if r[0] < self.pp), key=lambda r: r[0])  # replica 0 speaks for all
        self.plan.memory = [r[1] for r in pipeline]
        if self.plan.verbose:
            print(format_report(self.plan.memory, self.schedule_name, int(self.microbatches)), flush=True)
        return local


_RETURN_OUTPUTS: dict[str, bool] = {}


def _takes_return_outputs(schedule: Any) -> bool:
    """Newer torch can skip merging the last stage's outputs (we only need the losses)."""
    name = type(schedule).__name__
    if name not in _RETURN_OUTPUTS:
        _RETURN_OUTPUTS[name] = "return_outputs" in inspect.signature(schedule.step).parameters
    return _RETURN_OUTPUTS[name]
