"""Glue over torch.distributed.pipelining: this worker's stages of a pipeline and its schedule.

One process per pipeline rank; each holds `stages_per_worker` stages of the K = pp x stages_per_worker
stages, in torch's layouts (loop for interleaved schedules, V for the ZBV zero-bubble one):

    1f1b, 2 workers, 4 micro-batches        (F = forward, B = backward, . = bubble)
    rank 0   F0 F1 .  .  B0 F2 B1 F3 B2 .  B3
    rank 1   .  F0 B0 F1 B1 F2 B2 F3 B3

The model is split when the module is constructed (inside `run.prepare`); when balancing by time every
rank profiles the example batch and the timings are averaged over all ranks, so all ranks cut the
model identically. Parameters of the stages a rank does not hold are emptied, so the memory a
pipeline saves is really saved.

The loss of a step is the mean of the micro-batch losses (each is divided by M before its backward),
which equals the full-batch mean loss because micro-batches have equal size; uneven splits are refused.
Averaging over data-parallel replicas is not this module's business: `ddp+pp` does it after a step.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ..._tree import map_tensors
from ...collectives import max_over_world
from ...errors import ParatrainError
from ...weights.build import place
from .. import batchnorm
from ..batchnorm import check_microbatches
from ..microbatch import batch_size, check_even, divisors, split
from ..options import example_needed
from ..plan import Plan
from ..trial import step_time
from . import clip_guard, schedules
from .agreement import Agreement, agreed
from .balance import choose_balance, describe
from .memory import StageMemory, format_report, in_flight, param_bytes, watch_stages
from .partition import Stage, layers_of, merged, split_into_stages
from .sharded import shard_stages
from .tied import TiedGradients
from .tuning import tune_schedule

LossFn = Callable[[Any, Any], torch.Tensor]


@functools.cache
def _pipeline_stage_class() -> type:
    """torch's PipelineStage, whose shape-learning forward (metadata inference, before the first real
    micro-batch) leaves our stages' per-step state alone."""
    from torch.distributed.pipelining import PipelineStage

    class QuietStage(PipelineStage):  # type: ignore[misc]
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            stage: Stage = self.submod  # type: ignore[assignment]
            with stage.unobserved():
                return super()._forward_metadata_inference(*args, **kwargs)

        def _to_tensor(self, arg: Any) -> torch.Tensor:
            """A later stage learns its shapes by running on tensors made from the previous stage's metadata, which
            torch leaves uninitialised: token ids received there (an encoder-decoder's decoder inputs) would index an
            embedding with whatever the memory held, failing on that rank alone. Zeros are valid ids and masks."""
            out = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor):
                with torch.no_grad():
                    out.zero_()
            return out

    return QuietStage


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, list | tuple | dict):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return tuple((k, _signature(v)) for k, v in items)
    return type(value).__name__


class PipelineModule(nn.Module):
    """This worker's stages; `module(inputs, targets, loss_fn)` runs one scheduled step and returns this
    rank's summed micro-batch losses (last stage) or None (other stages)."""

    def __init__(self, model: nn.Module, *, schedule: str, pp_rank: int, pp: int, per_worker: int,
                 device: torch.device, microbatches: int | str | None, balance: Sequence[int] | Sequence[str] | str,
                 example: Any, group: Any = None, strategy: str = "pp", batchnorm: str = "exact",
                 checkpointing: str = "none", compiling: bool = False, tp_plan: dict[str, str] | None = None,
                 shard_mesh: Any = None, precision: str = "32", share: Any = None,
                 own_blocks: bool = False, unsharded: set[nn.Parameter] | None = None) -> None:
        super().__init__()
        self._tp_plan = tp_plan
        self._share, self._own_blocks, self._unsharded = share, own_blocks, unsharded or set()
        self.experts: Any = None
        """Expert parallelism's gradient reducer inside the stages (`parallel.expert.apply.ExpertGrads`): the
        strategy reduces once per schedule."""
        self._shard_mesh, self._precision = shard_mesh, precision
        schedules.check(schedule, pp, per_worker, microbatches, checkpointing, compiling)
        self._checkpointing, self._compiling = checkpointing, compiling
        self.schedule_name, self.pp_rank, self.pp, self.per_worker = schedule, pp_rank, pp, per_worker
        self.num_stages = pp * per_worker
        self.ids = schedules.stage_indices(schedule, pp_rank, pp, per_worker)
        self.device, self.group = device, group
        self.microbatches: int | str | None = microbatches
        """None (unset): the first step's batch decides, as `schedules.ScheduleRow.fewest` says."""
        self.plan = Plan(strategy=strategy, stages=self.num_stages, microbatches=microbatches,
                         schedule=schedule, verbose=dist.get_rank() == 0)
        self._schedules: dict[Any, Any] = {}
        self._loss_fn: LossFn | None = None
        self._loss_scale = 1
        self._loss_saved = 0
        self._meter: Any = None
        self.sync = True
        """False inside an accumulation window (pp): tied gradients are summed only when it ends."""
        unset = schedules.row(schedule).min_microbatches(pp, per_worker) if schedule != "auto" else "auto"
        self._defer_batchnorm = check_microbatches(model, batchnorm, unset if microbatches is None else microbatches,
                                                   f"strategy {strategy!r}")
        self.local = self._split(model, balance, example)
        self._registered = nn.ModuleList(self.local)
        if pp > 1:
            clip_guard.register(self.parameters(), pp_rank)

    # -- splitting --------------------------------------------------------------------------------
    def _split(self, model: nn.Module, requested: Sequence[int] | Sequence[str] | str, example: Any) -> list[Stage]:
        measured = isinstance(requested, str) and requested in ("time", "memory")
        if example is None and (measured or not isinstance(model, nn.Sequential)):
            why = (f"balance={requested!r} measures the layers" if measured
                   else f"{type(model).__name__} is not an nn.Sequential and is traced to be split")
            raise example_needed(f"strategy {self.plan.strategy!r}", why)
        sample = None
        if example is not None:
            example = map_tensors(lambda t: t.to(self.device), example)
            count = self.microbatches if isinstance(self.microbatches, int) else self.num_stages
            if self.microbatches is None and self.schedule_name != "auto":  # measure what the first step will run
                count = self._default_count(batch_size(example))
            sample = split(example, min(count, batch_size(example)))[0]
        with agreed(Agreement(f"strategy {self.plan.strategy!r}")) as agreement:  # one rank's refusal is every rank's
            layers = layers_of(model, sample, defer_batchnorm=self._defer_batchnorm, tp_plan=self._tp_plan,
                               own_blocks=self._own_blocks, share=self._share)
            balance, costs = choose_balance(requested, layers, self.num_stages, sample=sample, agree=agreement.mean)
        stages = split_into_stages(layers, balance)
        owner = schedules.stage_owners(self.schedule_name, self.pp, self.per_worker)
        self.tied = TiedGradients(model, stages, owner.__getitem__, self.pp_rank, self.group)
        local = [place(stages[i], self.device) for i in self.ids]
        if self._shard_mesh is not None:
            shard_stages(local, self._shard_mesh, self._precision, self.tied, self._unsharded)
        for stage in local:
            if stage.index == self.num_stages - 1:
                stage.outputs_spec = True  # torch sends and merges tensors only; the structure is put back
            else:
                stage.sends = True
        mine = {id(p) for s in local for p in s.parameters()}
        for p in model.parameters():
            if id(p) not in mine:  # another worker's layer: keep the object (the optimizer holds it), drop the data
                # (a tensor-parallel shard keeps its local piece: a DTensor's data cannot be swapped through
                # `.data`, and only the user's unsplit model still refers to it)
                if not hasattr(p, "to_local"):
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None
        self.plan.balance = balance
        self.plan.layer_costs = costs
        self.plan.note(describe(balance, costs, requested, [name for name, _ in layers]))
        return local

    def reduce_tied_gradients(self) -> None:
        """At the end of an accumulation window: tied parameters' gradients summed over their holders."""
        if self.tied:
            self.tied.reduce(self.device)

    def replaced(self, now: dict[int, nn.Parameter]) -> None:
        """Some of this rank's parameters were replaced by new objects (made real: `weights.fill`)."""
        if self.tied:
            self.tied.replaced(now)

    def holds(self) -> nn.Module:
        """This worker's layers under their original names (what `unwrap` returns)."""
        return merged(self.local)

    # -- schedules --------------------------------------------------------------------------------
    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        meter, before = self._meter, self._meter.current if self._meter else 0
        loss = self._loss_fn(self._last().rebuild(output), target)
        if meter is not None:  # what the loss keeps for backward belongs to the last stage's micro-batch
            self._loss_saved = max(self._loss_saved, meter.current - before)
        return loss / self._loss_scale

    def _schedule(self, microbatches: int, inputs: Any, training: bool = True, loss: bool = True,
                  schedule: str | None = None) -> Any:
        # Forward-only passes run GPipe where one stage per worker allows: any micro-batch count works.
        name = (schedule or self.schedule_name) if training or self.per_worker > 1 else "gpipe"
        if name == "auto":  # a forward-only pass before the first step chose one
            name = schedules.auto_names(self.per_worker, self._checkpointing, self._compiling)[0]
        key = (microbatches, _signature(inputs), training, loss, name)
        if key not in self._schedules:
            stages = [_pipeline_stage_class()(stage, i, self.num_stages, self.device, group=self.group)
                      for stage, i in zip(self.local, self.ids)]
            rule = schedules.row(name)
            cls = rule.torch_class(self.per_worker)
            try:
                # The loss is scaled instead of the gradients (scale_grads=False): torch would divide all of
                # .grad, including what earlier micro-steps of an accumulation window left there.
                first = stages if rule.multi_stage else stages[0]
                sched = cls(first, microbatches, loss_fn=self._loss if loss else None, scale_grads=False)
            except ValueError as exc:
                raise ParatrainError(
                    f"schedule {name!r} with {self.num_stages} stages on {self.pp} workers "
                    f"cannot run {microbatches} micro-batches: {exc}. Choose another microbatches "
                    "(a multiple of the workers is always accepted) or microbatches='auto'"
                ) from None
            self._schedules = {k: v for k, v in self._schedules.items()
                               if k[0] != key[0] or k[2:] != key[2:]}  # one input shape per count and kind
            self._schedules[key] = (sched, stages)
        return self._schedules[key]

    def _flat_inputs(self, inputs: Any) -> tuple[torch.Tensor, ...]:
        """The first stage receives tensors only: the inputs' tensors, rebuilt into their structure there."""
        leaves, spec = pytree.tree_flatten(inputs)
        if any(not isinstance(x, torch.Tensor) or not x.dim() for x in leaves):
            raise ParatrainError(
                f"strategy {self.plan.strategy!r}: pipeline inputs must be tensors with a batch dimension (or "
                f"dicts, tuples and lists of them); got {[type(x).__name__ for x in leaves]}. Pass other values "
                "as constants inside the model"
            )
        for stage in self.local:
            if stage.index == 0:
                stage.inputs_spec = spec
        return tuple(leaves)

    def _run(self, inputs: Any, targets: Any, microbatches: int, loss_scale: int,
             schedule: str | None = None) -> torch.Tensor | None:
        sched, stages = self._schedule(microbatches, inputs, schedule=schedule)
        for stage in self.local:
            stage.row_cursor = 0  # each stage runs its micro-batches' forwards in order
            stage.micro_rows = batch_size(inputs) // microbatches
        first = any(s.is_first for s in stages)
        last = any(s.is_last for s in stages)
        kwargs: dict[str, Any] = {}
        losses: list[torch.Tensor] = []
        if last:
            kwargs.update(target=targets, losses=losses)
        if _takes_return_outputs(sched):
            kwargs["return_outputs"] = False
        self._loss_scale = microbatches * loss_scale  # mean over micro-batches and micro-steps
        sched.step(*(self._flat_inputs(inputs) if first else ()), **kwargs)
        if not last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).sum() * loss_scale

    # -- the step ---------------------------------------------------------------------------------
    def forward(self, inputs: Any, targets: Any = None, loss_fn: LossFn | None = None,
                loss_scale: int = 1) -> Any:
        """One scheduled training step, returning the last stage's summed micro-batch losses (None on other
        stages), with `loss_scale` dividing every micro-batch loss (the accumulation window). Without a
        loss function or under no_grad, a forward-only pass: the outputs, or the mean loss given `loss_fn`,
        on the last stage (None on the others); `model(x)` is that pass."""
        if loss_fn is None or not torch.is_grad_enabled():
            return self._evaluate(inputs, targets, loss_fn)
        self._loss_fn = loss_fn
        if self.tied:
            self.tied.window_starts()
        inputs, targets = (map_tensors(lambda t: t.to(self.device), v) for v in (inputs, targets))
        batch = batch_size(inputs)
        if self.microbatches is None and self.schedule_name != "auto":
            self.microbatches = self.plan.microbatches = self._default_count(batch)
            self.plan.note(f"microbatches {self.microbatches} (unset: the fewest equal micro-batches of the batch that "
                           f"{self.schedule_name} runs on {self.num_stages} stages; microbatches='auto' measures)")
        if isinstance(self.microbatches, int):
            check_even(batch, self.microbatches, f"strategy {self.plan.strategy!r}")
        if self.microbatches == "auto" or self.schedule_name == "auto":
            names = (schedules.auto_names(self.per_worker, self._checkpointing, self._compiling)
                     if self.schedule_name == "auto" else [self.schedule_name])
            fixed = self.microbatches if isinstance(self.microbatches, int) else None
            self.schedule_name, self.microbatches = tune_schedule(
                self.plan, names, lambda name, m: self.measure(inputs, targets, m, schedule=name),
                lambda name: [m for m in self.candidates(batch, name) if fixed is None or m == fixed],
                self.num_stages, self.local)
            self._schedules = {k: v for k, v in self._schedules.items()
                               if k[0] == self.microbatches and k[4] == self.schedule_name}
        assert isinstance(self.microbatches, int)
        local = (self._measure_memory(inputs, targets, loss_scale) if self.plan.memory is None
                 else self._run(inputs, targets, self.microbatches, loss_scale))
        batchnorm.commit()  # running statistics move once per step, from all micro-batches
        return local

    def _evaluate(self, inputs: Any, targets: Any, loss_fn: LossFn | None) -> Any:
        inputs, targets = (map_tensors(lambda t: t.to(self.device), v) for v in (inputs, targets))
        batch = batch_size(inputs)
        if self.schedule_name == "zero-bubble" and self.per_worker == 2:
            return self._evaluate_in_stage_order(inputs, targets, loss_fn)
        wanted = self.microbatches if isinstance(self.microbatches, int) else self.num_stages
        m = max(d for d in divisors(batch) if d <= wanted)
        sched, stages = self._schedule(m, inputs, training=False, loss=loss_fn is not None)
        for stage in self.local:
            stage.row_cursor = stage.micro_rows = None
        kwargs: dict[str, Any] = {}
        losses: list[torch.Tensor] = []
        last = any(s.is_last for s in stages)
        if last and loss_fn is not None:
            kwargs.update(target=targets, losses=losses)
        self._loss_fn, self._loss_scale = loss_fn, m
        first = any(s.is_first for s in stages)
        out = sched.eval(*(self._flat_inputs(inputs) if first else ()), **kwargs)
        if not last:
            return None
        if loss_fn is not None:
            return torch.stack([loss.detach().float() for loss in losses]).sum()
        return self._last().rebuild(out)

    def _evaluate_in_stage_order(self, inputs: Any, targets: Any, loss_fn: LossFn | None) -> Any:
        """The whole batch through the stages in order, handed from rank to rank: the forward-only pass of
        the V layout (torch 2.14's V schedules walk their backward actions in eval() and fail)."""
        owner = schedules.stage_owners(self.schedule_name, self.pp, self.per_worker)
        mine = {stage.index: stage for stage in self.local}
        value: Any = None
        for index in range(self.num_stages):
            if index not in mine:
                continue
            stage = mine[index]
            if index == 0:
                value = stage(*self._flat_inputs(inputs))
            else:
                if owner[index - 1] != self.pp_rank:
                    box: list[Any] = [None]
                    dist.recv_object_list(box, src=dist.get_global_rank(self.group, owner[index - 1])
                                          if self.group is not None else owner[index - 1], group=self.group)
                    value = map_tensors(lambda t: t.to(self.device), box[0])
                value = stage(*value) if isinstance(value, tuple) else stage(value)
            if index + 1 < self.num_stages and owner[index + 1] != self.pp_rank:
                dst = owner[index + 1]
                dist.send_object_list([map_tensors(lambda t: t.cpu(), value)], group=self.group,
                                      dst=dist.get_global_rank(self.group, dst) if self.group is not None else dst)
        if self.num_stages - 1 not in mine:
            return None
        out = self._last().rebuild(value)
        return loss_fn(out, targets).detach().float() if loss_fn is not None else out

    def _default_count(self, batch: int) -> int:
        return schedules.default_microbatches(self.schedule_name, self.pp, self.per_worker, batch,
                                              f"strategy {self.plan.strategy!r}")

    def _last(self) -> Stage:
        return next(s for s in self.local if s.index == self.num_stages - 1)

    def candidates(self, batch: int, schedule: str | None = None) -> list[int]:
        """Micro-batch counts a schedule (this module's by default) accepts for `batch` (equal micro-batches)."""
        name = schedule or self.schedule_name
        rule = schedules.row(name)
        return [m for m in divisors(batch) if rule.accepts(m, self.pp, self.per_worker)]

    def measure(self, inputs: Any, targets: Any, microbatches: int, repeats: int = 3,
                schedule: str | None = None) -> float:
        """Seconds per step with `microbatches` (and `schedule`, default this module's), the slowest rank's
        (collective; call inside `trial.no_trace` to keep the gradients a trial step makes out of training)."""
        inputs, targets = (map_tensors(lambda t: t.to(self.device), v) for v in (inputs, targets))
        seconds = step_time(lambda: self._run(inputs, targets, microbatches, 1, schedule), repeats=repeats, warmup=1,
                            devices=[self.device])
        return max_over_world(seconds, self.device)

    def _measure_memory(self, inputs: Any, targets: Any, loss_scale: int) -> torch.Tensor | None:
        """The first real step, watched: per-stage activations of one micro-batch and the step's peak."""
        assert isinstance(self.microbatches, int)
        with watch_stages(self.local, [s.index for s in self.local]) as (meter, first):
            self._meter = meter
            try:
                local = self._run(inputs, targets, self.microbatches, loss_scale)
            finally:
                self._meter = None
        if self.num_stages - 1 in first:
            first[self.num_stages - 1] += self._loss_saved
        sched, _ = self._schedule(self.microbatches, inputs)
        most, bound = in_flight(getattr(sched, "pipeline_order", None), self.pp_rank, first)
        row = StageMemory(stages=list(self.ids), params_bytes=sum(param_bytes(s) for s in self.local),
                          activation_per_microbatch_bytes=sum(first.values()), in_flight_bound=most,
                          activation_bound_bytes=bound, peak_activation_bytes=meter.peak)
        rows: list[Any] = [None] * dist.get_world_size()
        speaks = self.group is None or 0 in dist.get_process_group_ranks(self.group)  # rank 0's pipeline
        dist.all_gather_object(rows, (speaks, self.pp_rank, row))
        pipeline = sorted((r[1:] for r in rows if r[0]), key=lambda r: r[0])
        self.plan.memory = [r[1] for r in pipeline]
        if self.plan.verbose:
            print(format_report(self.plan.memory, self.schedule_name, self.microbatches), flush=True)
        return local


def _takes_return_outputs(schedule: Any) -> bool:
    """Newer torch can skip merging the last stage's outputs (we only need the losses)."""
    return _step_takes_return_outputs(type(schedule).step)


@functools.cache
def _step_takes_return_outputs(step: Callable[..., Any]) -> bool:
    return "return_outputs" in inspect.signature(step).parameters


def global_loss(local: torch.Tensor | None, replicas: int, device: torch.device) -> torch.Tensor:
    """The global-batch mean loss on every rank: only last-stage ranks hold one (one per replica)."""
    from ...collectives import mean_later

    value = local if local is not None else torch.zeros((), device=device)
    return mean_later(value, divide_by=replicas)


def evaluate(model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, device: torch.device) -> Any:
    """A forward-only pass of a pipeline (under no_grad): the outputs on the last stage (None elsewhere), or
    the mean loss over every replica's rows, weighted by rows, on every rank."""
    from ...collectives import all_reduce

    local = model(inputs, targets, loss_fn)
    if loss_fn is None:
        return local
    rows = float(batch_size(inputs)) if local is not None else 0.0
    value = float(local) * rows if local is not None else 0.0
    total = all_reduce(torch.tensor([value, rows], dtype=torch.float64), op="sum", device=device)
    return (total[0] / total[1]).float()
