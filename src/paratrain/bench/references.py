"""Hand-written PyTorch, the way the tutorials write it, timed beside paratrain on the same workers.

- `torch-ddp`: `DistributedDataParallel(model)`, each rank slicing its share of the global batch, and
  the plain `zero_grad / loss.backward() / step` loop.
- `torch-pipeline`: the tutorials' `PipelineParallelResNet50` forward (`split_size` loop, stage 1's
  next chunk overlapping stage 2's current one), for any model cut in two, in one process.
- `torch-pipelining`: `torch.distributed.pipelining` used directly: one `PipelineStage` per rank and
  `ScheduleGPipe` / `Schedule1F1B`.
- `no-comm`: not a strategy but the machine's ceiling: the torch-ddp loop without DDP, so each worker
  computes its share and nothing is exchanged.

Nothing here imports paratrain's training API: it is the code a user would write without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import ParatrainError
from .jobs import Settings, Spec
from .workloads import Batch, Workload

Step = Callable[[], None]
SEED = 0
_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision not in _DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[precision])


def _model(workload: Workload, settings: Settings) -> nn.Module:
    torch.manual_seed(SEED)
    model = workload.model()
    return model.to(memory_format=torch.channels_last) if settings.channels_last else model


def _inputs(x: torch.Tensor, device: torch.device, settings: Settings) -> torch.Tensor:
    x = x.to(device)
    return x.contiguous(memory_format=torch.channels_last) if settings.channels_last and x.dim() == 4 else x


def cut(model: nn.Module, stages: int, split: int | None) -> list[nn.Sequential]:
    """The model's children in `stages` consecutive groups: at the workload's hand split for two stages,
    else equal numbers of children (the split a user writes by hand)."""
    if not isinstance(model, nn.Sequential):
        raise ParatrainError(f"the hand-written pipeline references cut an nn.Sequential by its children; "
                             f"{type(model).__name__} is not one")
    children = list(model.children())
    if len(children) < stages:
        raise ParatrainError(f"{len(children)} layers cannot make {stages} pipeline stages; use fewer workers")
    bounds = [0, split, len(children)] if stages == 2 and split else \
        [round(i * len(children) / stages) for i in range(stages + 1)]
    return [nn.Sequential(*children[a:b]) for a, b in zip(bounds, bounds[1:])]


def _loop(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: nn.Module,
          optimizer: optim.Optimizer, device: torch.device, precision: str) -> Step:
    scaler = torch.amp.GradScaler(device.type) if precision == "16" else None

    def step() -> None:
        optimizer.zero_grad()
        with _autocast(device, precision):
            outputs = model(inputs)
            loss = loss_fn(outputs, labels.to(outputs.device))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    return step


def torch_ddp(spec: Spec, workload: Workload, data: Batch, settings: Settings, device: torch.device) -> Step:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(workload, settings).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    share = settings.batch // world
    inputs = _inputs(data[0][rank * share:(rank + 1) * share], device, settings)
    labels = data[1][rank * share:(rank + 1) * share].to(device)
    optimizer = optim.SGD(ddp_model.parameters(), lr=workload.lr)
    return _loop(ddp_model, inputs, labels, workload.loss(), optimizer, device, settings.precision)


def no_comm(spec: Spec, workload: Workload, data: Batch, settings: Settings, device: torch.device) -> Step:
    """torch-ddp without DDP: each rank's share of the work and none of the communication."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(workload, settings).to(device)
    share = settings.batch // world
    inputs = _inputs(data[0][rank * share:(rank + 1) * share], device, settings)
    labels = data[1][rank * share:(rank + 1) * share].to(device)
    optimizer = optim.SGD(model.parameters(), lr=workload.lr)
    return _loop(model, inputs, labels, workload.loss(), optimizer, device, settings.precision)


class PipelineParallel(nn.Module):
    """The tutorials' `PipelineParallelResNet50.forward`, with their `seq1`/`seq2` given."""

    def __init__(self, seq1: nn.Module, seq2: nn.Module, dev1: str, dev2: str, split_size: int) -> None:
        super().__init__()
        self.seq1, self.seq2 = seq1.to(dev1), seq2.to(dev2)
        self.dev1, self.dev2 = dev1, dev2
        self.split_size = split_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        splits = iter(x.split(self.split_size, dim=0))
        s_next = next(splits)
        s_prev = self.seq1(s_next).to(self.dev2)
        ret = []
        for s_next in splits:
            # A. s_prev runs on dev2
            s_prev = self.seq2(s_prev)
            ret.append(s_prev)
            # B. s_next runs on dev1, which can run concurrently with A
            s_prev = self.seq1(s_next).to(self.dev2)
        ret.append(self.seq2(s_prev))
        return torch.cat(ret)


def torch_pipeline(spec: Spec, workload: Workload, data: Batch, settings: Settings, device: torch.device) -> Step:
    assert spec.devices is not None and spec.microbatches is not None
    dev1, dev2 = spec.devices[0], spec.devices[-1]
    seq1, seq2 = cut(_model(workload, settings), 2, workload.split)
    model = PipelineParallel(seq1, seq2, dev1, dev2, split_size=settings.batch // spec.microbatches)
    optimizer = optim.SGD(model.parameters(), lr=workload.lr)
    inputs = _inputs(data[0], torch.device(dev1), settings)
    labels = data[1].to(dev2)
    return _loop(model, inputs, labels, workload.loss(), optimizer, torch.device(dev2), settings.precision)


class _Autocast(nn.Module):
    """A stage under autocast, sending float32 on (what AMP does around a whole model's forward)."""

    def __init__(self, module: nn.Module, device: torch.device, precision: str) -> None:
        super().__init__()
        self.module, self.device, self.precision = module, device, precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _autocast(self.device, self.precision):
            return self.module(x).float()


def torch_pipelining(spec: Spec, workload: Workload, data: Batch, settings: Settings,
                     device: torch.device) -> Step:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    assert spec.microbatches is not None
    rank, stages = dist.get_rank(), dist.get_world_size()
    part: nn.Module = cut(_model(workload, settings), stages, workload.split)[rank].to(device)
    if settings.precision in _DTYPES:
        part = _Autocast(part, device, settings.precision)
    stage = PipelineStage(part, rank, stages, device)
    schedule_cls = Schedule1F1B if spec.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, spec.microbatches, loss_fn=workload.loss())
    params = list(part.parameters())
    optimizer = optim.SGD(params, lr=workload.lr) if params else None  # a stage may be a lone ReLU
    inputs = _inputs(data[0], device, settings)
    labels = data[1].to(device)

    def step() -> None:
        if optimizer is not None:
            optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)
        elif rank == stages - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=labels, losses=losses)
        else:
            schedule.step()
        if optimizer is not None:
            optimizer.step()

    return step


BUILDERS: dict[str, Callable[[Spec, Workload, Batch, Settings, torch.device], Step]] = {
    "torch-ddp": torch_ddp, "torch-pipeline": torch_pipeline, "torch-pipelining": torch_pipelining,
    "no-comm": no_comm,
}
