"""Hand-written PyTorch, the way the tutorials write it, timed beside paratrain on the same workers.

- `torch-ddp`: `DistributedDataParallel(model)`, each rank slicing its share of the global batch, and
  the plain `zero_grad / loss.backward() / step` loop.
- `torch-pipeline`: the tutorials' `PipelineParallelResNet50` forward (`split_size` loop, stage 1's
  next chunk overlapping stage 2's current one), for any model cut in two, in one process.
- `torch-pipelining`: `torch.distributed.pipelining` used directly: one `PipelineStage` per rank and
  `ScheduleGPipe` / `Schedule1F1B`.
- `torch-fsdp`, `torch-tp`, `torch-fsdp-tp`: FSDP2 and DTensor tensor parallelism as torchtitan writes them
  (`parallelize_module` with the workload's plan; `fully_shard` per block and at the root over the data-parallel
  mesh dimension).
- `torch-tp-pp`, `torch-ddp-pp`, `torch-fsdp-pp`: a pipeline with a tensor or data axis, torchtitan's order:
  `parallelize_module` on the model, then the chain cut by hand into two pieces, each a `PipelineStage` over the
  "pp" dimension of a ("pp", "dp", "tp") mesh and, over "dp", one `fully_shard` unit or a replica averaging its
  gradients after the schedule.
- `torch-ep`, `torch-cp`: expert parallelism of the gpt-moe workload (its experts shared out, rows sent to them
  and back by all-to-all once per MoE block) and context parallelism of gpt-long (a share of every sequence per
  rank, keys and values gathered in every attention), in `references_ep_cp`.
- `no-comm`: not a strategy but the machine's ceiling: the torch-ddp loop without DDP, so each worker
  computes its share and nothing is exchanged.
- `one_worker`: not a reference but the yardstick of speedups: the plain loop on the whole batch on rank 0
  while the other ranks wait, timed in every job beside its runs.

A tied weight cut apart (GPT's token embedding, which is also its output projection, on the first and
the last stage) is handled as a careful hand-written script does (Megatron-LM's embedding group): each
stage keeps its own copy, the copies' gradients are summed after backward (`all_reduce` over the stages
that hold it; in one process, added across the two devices), and the same optimizer step keeps the
copies equal. Where both stages share one device the tie is simply kept.

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
from ..measure.workloads import Batch, Workload
from .jobs import Settings, Spec

Step = Callable[[], None]
SEED = 0
_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision not in _DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[precision])


def build_model(workload: Workload, settings: Settings) -> nn.Module:
    """The workload's model with the bench's seed: every reference starts from paratrain's initial weights."""
    torch.manual_seed(SEED)
    model = workload.model()
    return model.to(memory_format=torch.channels_last) if settings.channels_last else model


def _inputs(x: torch.Tensor, device: torch.device, settings: Settings) -> torch.Tensor:
    x = x.to(device)
    return x.contiguous(memory_format=torch.channels_last) if settings.channels_last and x.dim() == 4 else x


def cut(model: nn.Module, stages: int, split: int | None,
        layers: Callable[[nn.Module], list[nn.Module]] | None = None) -> list[nn.Sequential]:
    """The model's layer chain (the workload's `layers`, else an nn.Sequential's children) in `stages`
    consecutive groups: at the workload's hand split for two stages, else equal numbers of layers (the
    split a user writes by hand)."""
    if layers is not None:
        children = layers(model)
    elif isinstance(model, nn.Sequential):
        children = list(model.children())
    else:
        raise ParatrainError(f"the hand-written pipeline references cut an nn.Sequential by its children, or the "
                             f"chain a workload's `layers` names; {type(model).__name__} is neither")
    if len(children) < stages:
        raise ParatrainError(f"{len(children)} layers cannot make {stages} pipeline stages; use fewer workers")
    bounds = [0, split, len(children)] if stages == 2 and split else \
        [round(i * len(children) / stages) for i in range(stages + 1)]
    return [nn.Sequential(*children[a:b]) for a, b in zip(bounds, bounds[1:])]


def shared_across(pieces: list[nn.Sequential]) -> list[tuple[tuple[int, ...], list[nn.Parameter]]]:
    """Parameters held by more than one piece (a tied weight cut apart), grouped by the pieces holding
    them. The order depends only on the model, so every rank finds the same groups in the same order."""
    owners: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for i, piece in enumerate(pieces):
        for p in piece.parameters():
            owners.setdefault(id(p), []).append(i)
            params[id(p)] = p
    groups: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for key, who in owners.items():
        if len(who) > 1:
            groups.setdefault(tuple(who), []).append(params[key])
    return list(groups.items())


def untie(first: nn.Module, second: nn.Module) -> list[tuple[str, str]]:
    """Give `second` its own copy of every parameter it shares with `first`; returns the (name in first,
    name in second) pairs whose gradients `sum_tied_grads` must add after each backward."""
    names = {id(p): name for name, p in first.named_parameters()}
    pairs = []
    for module_name, module in second.named_modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in names:
                setattr(module, name, nn.Parameter(p.detach().clone()))
                pairs.append((names[id(p)], f"{module_name}.{name}" if module_name else name))
    return pairs


def sum_tied_grads(first: nn.Module, second: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """Both copies of each untied weight get the sum of their gradients (what the tie would have given)."""
    for a_name, b_name in pairs:
        a, b = first.get_parameter(a_name), second.get_parameter(b_name)
        if a.grad is None or b.grad is None:
            raise RuntimeError(f"tied weight {a_name} / {b_name} has no gradient on one side after backward")
        total = a.grad + b.grad.to(a.device)
        a.grad.copy_(total)
        b.grad.copy_(total.to(b.device))


def train_loop(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: nn.Module,
               optimizer: optim.Optimizer, device: torch.device, precision: str,
               after_backward: Callable[[], None] | None = None) -> Step:
    scaler = torch.amp.GradScaler(device.type) if precision == "16" else None

    def step() -> None:
        optimizer.zero_grad()
        with _autocast(device, precision):
            outputs = model(inputs)
            loss = loss_fn(outputs, labels.to(outputs.device))
        if scaler is None:
            loss.backward()
            if after_backward is not None:
                after_backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if after_backward is not None:
                after_backward()
            scaler.step(optimizer)
            scaler.update()

    return step


def _compiled(model: nn.Module, settings: Settings) -> nn.Module:
    """The whole model compiled, as nanoGPT's loop does (`--compile`); DDP wraps the compiled module, as torch's
    DDP + compile guide writes it."""
    return torch.compile(model, backend=settings.compile) if settings.compile else model  # type: ignore[return-value]


def torch_ddp(spec: Spec, workload: Workload, data: Batch, settings: Settings, device: torch.device) -> Step:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(workload, settings).to(device)
    ddp_model = DDP(_compiled(model, settings), device_ids=[device.index] if device.type == "cuda" else None)
    share = settings.batch // world
    inputs = _inputs(data[0][rank * share:(rank + 1) * share], device, settings)
    labels = data[1][rank * share:(rank + 1) * share].to(device)
    optimizer = optim.SGD(ddp_model.parameters(), lr=workload.lr)
    return train_loop(ddp_model, inputs, labels, workload.loss(), optimizer, device, settings.precision)


def no_comm(spec: Spec, workload: Workload, data: Batch, settings: Settings, device: torch.device) -> Step:
    """torch-ddp without DDP: each rank's share of the work and none of the communication."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(workload, settings).to(device)
    share = settings.batch // world
    inputs = _inputs(data[0][rank * share:(rank + 1) * share], device, settings)
    labels = data[1][rank * share:(rank + 1) * share].to(device)
    optimizer = optim.SGD(model.parameters(), lr=workload.lr)
    return train_loop(_compiled(model, settings), inputs, labels, workload.loss(), optimizer, device,
                      settings.precision)


def one_worker(workload: Workload, data: Batch, settings: Settings, device: torch.device) -> Step:
    """`single`'s step, written plainly, as the baseline of a job's speedups: the whole model and the whole batch
    on rank 0, the plain loop. The other ranks' step does nothing, so rank 0 computes alone, as one worker."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return lambda: None
    model = build_model(workload, settings).to(device)
    inputs, labels = share_rows(data, 0, 1, device, settings)
    optimizer = optim.SGD(model.parameters(), lr=workload.lr)
    return train_loop(_compiled(model, settings), inputs, labels, workload.loss(), optimizer, device,
                      settings.precision)


def _tensor_parallel(model: nn.Module, workload: Workload, tp_mesh: Any) -> None:
    """`parallelize_module` with the workload's plan (its Linears colwise/rowwise, Megatron's pairs)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not workload.tp_plan:
        raise ParatrainError(f"workload {workload.name!r} names no tensor-parallel plan")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {name: styles[style]() for name, style in workload.tp_plan.items()})


def _fully_shard(model: nn.Module, dp_mesh: Any) -> None:
    """`fully_shard` on each block (the model's `blocks`, or an nn.Sequential's layers that hold weights), then on
    the root, as torchtitan shards a transformer."""
    from torch.distributed.fsdp import fully_shard

    blocks = list(getattr(model, "blocks", [])) or [
        m for m in (model.children() if isinstance(model, nn.Sequential) else []) if any(True for _ in m.parameters())]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def share_rows(data: Batch, index: int, count: int, device: torch.device, settings: Settings) -> Batch:
    """Data-parallel replica `index` of `count`: its rows of the global batch."""
    share = settings.batch // count
    rows = slice(index * share, (index + 1) * share)
    return _inputs(data[0][rows], device, settings), data[1][rows].to(device)


TENSOR_DEGREE = 2
"""The tensor degree of the hand-written layouts that have a data or pipeline axis beside it (paratrain's default
for `fsdp+tp`, `tp+pp`); `torch-tp` alone spans every worker."""
PIPELINE_DEGREE = 2


def torch_data_tensor(spec: Spec, workload: Workload, data: Batch, settings: Settings,
                      device: torch.device) -> Step:
    """torchtitan's way, written out: a (dp, tp) DeviceMesh, `parallelize_module` with the workload's plan over
    "tp" (torch-tp, torch-fsdp-tp), then `fully_shard` on each block and the root over "dp" (torch-fsdp,
    torch-fsdp-tp)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    tp = {"torch-fsdp": 1, "torch-tp": world}.get(spec.strategy, TENSOR_DEGREE)
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(workload, settings).to(device)
    if tp > 1:
        _tensor_parallel(model, workload, mesh["tp"])
    if world // tp > 1:
        _fully_shard(model, mesh["dp"])
    inputs, labels = share_rows(data, mesh.get_local_rank("dp"), world // tp, device, settings)
    optimizer = optim.SGD(model.parameters(), lr=workload.lr)
    return train_loop(model, inputs, labels, workload.loss(), optimizer, device, settings.precision)


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
    seq1, seq2 = cut(build_model(workload, settings), 2, workload.split, workload.layers)
    tied = untie(seq1, seq2) if torch.device(dev1) != torch.device(dev2) else []  # one device: the tie stays
    model = PipelineParallel(seq1, seq2, dev1, dev2, split_size=settings.batch // spec.microbatches)
    optimizer = optim.SGD(model.parameters(), lr=workload.lr)
    inputs = _inputs(data[0], torch.device(dev1), settings)
    labels = data[1].to(dev2)
    return train_loop(model, inputs, labels, workload.loss(), optimizer, torch.device(dev2), settings.precision,
                      after_backward=(lambda: sum_tied_grads(model.seq1, model.seq2, tied)) if tied else None)


class _Autocast(nn.Module):
    """A stage under autocast, sending float32 on (what AMP does around a whole model's forward)."""

    def __init__(self, module: nn.Module, device: torch.device, precision: str) -> None:
        super().__init__()
        self.module, self.device, self.precision = module, device, precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _autocast(self.device, self.precision):
            return self.module(x).float()


def _scheduled(spec: Spec, workload: Workload, batch: Batch, settings: Settings, device: torch.device,
               part: nn.Module, stage_index: int, stages: int, group: dist.ProcessGroup | None,
               tied: list[tuple[dist.ProcessGroup, list[nn.Parameter]]],
               replicas: dist.ProcessGroup | None = None) -> Step:
    """One rank's piece (already sharded by `fully_shard` where a data axis shards it) as a `PipelineStage` under
    torch's GPipe or 1F1B, and the plain step around it: the first stage feeds the batch, the last one the
    targets; copies of a tied weight sum their gradients (their local shards, under FSDP); `replicas` of the
    stage average their gradients in one flat all-reduce after the schedule (Megatron's contiguous buffer)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    assert spec.microbatches is not None
    stage = PipelineStage(part, stage_index, stages, device, group=group)
    schedule_cls = Schedule1F1B if spec.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, spec.microbatches, loss_fn=workload.loss())
    params = list(part.parameters())
    optimizer = optim.SGD(params, lr=workload.lr) if params else None  # a stage may be a lone ReLU
    inputs, labels = batch

    def step() -> None:
        if optimizer is not None:
            optimizer.zero_grad()
        if stage_index == 0:
            schedule.step(inputs)
        elif stage_index == stages - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=labels, losses=losses)
        else:
            schedule.step()
        for tie_group, shared in tied:  # the copies of a tied weight on different stages: sum their gradients
            for p in shared:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(grad, group=tie_group)
        if replicas is not None and params:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=replicas)
            flat /= dist.get_world_size(replicas)
            for p, g in zip(params, flat.split([g.numel() for g in grads])):
                p.grad = g.view_as(p)
        if optimizer is not None:
            optimizer.step()

    return step


def _tied_names(pieces: list[nn.Sequential], mine: int) -> list[str]:
    """Names, in piece `mine`, of the weights it shares with another piece (found before any wrapper replaces
    the Parameters)."""
    shared = {id(p) for owners, params in shared_across(pieces) if mine in owners for p in params}
    return [name for name, p in pieces[mine].named_parameters() if id(p) in shared]


def torch_pipelining(spec: Spec, workload: Workload, data: Batch, settings: Settings,
                     device: torch.device) -> Step:
    rank, stages = dist.get_rank(), dist.get_world_size()
    pieces = cut(build_model(workload, settings), stages, workload.split, workload.layers)
    tied: list[tuple[dist.ProcessGroup, list[nn.Parameter]]] = []
    for owners, shared in shared_across(pieces):
        group = dist.new_group(list(owners))  # every rank creates every group, in the same order
        if rank in owners:
            assert isinstance(group, dist.ProcessGroup)
            tied.append((group, shared))
    part: nn.Module = pieces[rank].to(device)
    if settings.precision in _DTYPES:
        part = _Autocast(part, device, settings.precision)
    batch = share_rows(data, 0, 1, device, settings)
    return _scheduled(spec, workload, batch, settings, device, part, rank, stages, None, tied)


def torch_nd_pipelining(spec: Spec, workload: Workload, data: Batch, settings: Settings,
                        device: torch.device) -> Step:
    """torchtitan's order, written out, for a pipeline with a tensor or data axis beside it (torch-tp-pp,
    torch-ddp-pp, torch-fsdp-pp): a ("pp", "dp", "tp") DeviceMesh of 2 pipeline stages, `parallelize_module` with
    the workload's plan on the whole model over "tp", the chain cut by hand into the pipeline's pieces, each rank's
    piece made a `PipelineStage` over its "pp" group, and torch's schedule. Over "dp", the piece is one `fully_shard`
    unit (torch's stage drives its gradient reduction over the micro-batches) or a replica that averages its
    gradients after the schedule (`DistributedDataParallel` inside a stage fails torch's reducer under 1F1B:
    "rebuilt parameter indices size is not same as original model parameters size"). A weight tied across the
    stages (GPT's embedding and head) sums its gradients over the "pp" group."""
    from torch.distributed.device_mesh import init_device_mesh

    world, pp = dist.get_world_size(), PIPELINE_DEGREE
    tp = TENSOR_DEGREE if spec.strategy == "torch-tp-pp" else 1
    mesh = init_device_mesh(device.type, (pp, world // (pp * tp), tp), mesh_dim_names=("pp", "dp", "tp"))
    model = build_model(workload, settings).to(device)
    if tp > 1:
        _tensor_parallel(model, workload, mesh["tp"])
    pieces = cut(model, pp, workload.split, workload.layers)
    pp_rank, dp_rank, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), world // (pp * tp)
    piece = pieces[pp_rank]
    tied_names = _tied_names(pieces, pp_rank)
    part: nn.Module = _Autocast(piece, device, settings.precision) if settings.precision in _DTYPES else piece
    if spec.strategy == "torch-fsdp-pp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(part, mesh=mesh["dp"])
    tied = [(mesh.get_group("pp"), [piece.get_parameter(n) for n in tied_names])] if tied_names else []
    batch = share_rows(data, dp_rank, dp, device, settings)
    replicas = mesh.get_group("dp") if spec.strategy == "torch-ddp-pp" else None
    return _scheduled(spec, workload, batch, settings, device, part, pp_rank, pp, mesh.get_group("pp"), tied,
                      replicas)


Builder = Callable[[Spec, Workload, Batch, Settings, torch.device], Step]


def _later(name: str) -> Builder:
    """A builder of `references_ep_cp`, imported when first used: that module builds on this one's loop."""

    def build(spec: Spec, workload: Workload, data: Batch, settings: Settings, device: torch.device) -> Step:
        from . import references_ep_cp

        made: Step = getattr(references_ep_cp, name)(spec, workload, data, settings, device)
        return made

    return build


BUILDERS: dict[str, Builder] = {
    "torch-ddp": torch_ddp, "torch-pipeline": torch_pipeline, "torch-pipelining": torch_pipelining,
    "no-comm": no_comm, "torch-fsdp": torch_data_tensor, "torch-tp": torch_data_tensor,
    "torch-fsdp-tp": torch_data_tensor, "torch-tp-pp": torch_nd_pipelining, "torch-ddp-pp": torch_nd_pipelining,
    "torch-fsdp-pp": torch_nd_pipelining, "torch-ep": _later("torch_ep"), "torch-cp": _later("torch_cp"),
}
