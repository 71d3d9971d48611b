"""BatchNorm when a batch is split: refused by default, or statistics as torchgpipe's deferred batch norm.

BatchNorm normalises with the statistics of the rows it sees. Split over data-parallel workers, or
into micro-batches that pass one after another, each part is normalised with its own statistics and
the running statistics move once per part: the run no longer equals one process on the whole batch.

    batchnorm="exact" (default)   whole-batch statistics or a refusal: data-parallel workers use the
                                  statistics of the global batch (torch's SyncBatchNorm on CUDA; elsewhere
                                  `sync_modules`, the same all-reduce of sums and squares); micro-batches
                                  and traced stages have no exact form, so setup refuses with the options
    batchnorm="local"             each worker's share / each micro-batch is normalised by its own rows (what
                                  DistributedDataParallel does by default); in pipelines the running
                                  statistics are still updated once per step, with the statistics of all
                                  of the step's micro-batches together, as torchgpipe's DeferredBatchNorm does

Layers that normalise each sample on its own (LayerNorm, GroupNorm, RMSNorm) are exact under any split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from .. import _forwards
from ..errors import ParatrainError
from .step_state import active

_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Paths of the BatchNorm layers that normalise with batch statistics while training."""
    return [name or type(model).__name__ for name, m in model.named_modules()
            if isinstance(m, _BATCH_NORMS) and m.track_running_stats is not None]


def _names(layers: list[str]) -> str:
    return ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")


def for_replicas(model: nn.Module, mode: str, device: torch.device, replicas: int, syncable: bool,
                 where: str, modules_run: bool = False) -> nn.Module:
    """The model for `replicas` data-parallel workers: global-batch statistics where that is exact (replicas
    spanning the default group: torch's SyncBatchNorm on CUDA, `sync_modules` on other devices when the
    BatchNorm modules run as modules, `modules_run`, not inside a traced graph), unchanged with
    batchnorm="local", else refused."""
    layers = batchnorm_layers(model)
    if not layers or replicas < 2 or mode == "local":
        return model
    if device.type == "cuda" and syncable:
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if syncable and modules_run:
        sync_modules(model)
        return model
    why = ("SyncBatchNorm would reduce over every worker, pipeline stages included" if not syncable
           else "the model is traced into stages, where BatchNorm is no module to synchronise")
    raise ParatrainError(
        f"{where}: BatchNorm layers of {type(model).__name__} ({_names(layers)}) would normalise each of the "
        f"{replicas} data-parallel workers' shares with its own statistics, unlike one process ({why}). Pass "
        "setup(batchnorm='local') to accept per-worker statistics (DistributedDataParallel's default), or "
        "replace BatchNorm with GroupNorm/LayerNorm (per-sample statistics, exact under any split)"
    )


def sync_modules(model: nn.Module) -> None:
    """BatchNorm modules of `model` normalise by the statistics of the whole global batch: every worker's
    per-channel sums, sums of squares and row counts are all-reduced (differentiably, so the backward is the
    whole batch's too), as torch's CUDA-only SyncBatchNorm does, on any device and for uneven shares."""
    for module in model.modules():
        if isinstance(module, _BATCH_NORMS) and "forward" not in module.__dict__:
            _forwards.replace(module, _synced_forward(module), "global-batch batchnorm")


def _synced_forward(module: Any) -> Any:
    from torch.distributed.nn.functional import all_reduce

    def forward(x: torch.Tensor) -> torch.Tensor:
        batch_stats = module.training or module.running_mean is None
        if not batch_stats:
            return F.batch_norm(x, module.running_mean, module.running_var, module.weight, module.bias, False, 0.0,
                                module.eps)
        dims = [d for d in range(x.dim()) if d != 1]
        wide = x.double()
        rows = torch.full((1,), x.numel() // x.shape[1], dtype=torch.float64, device=x.device)
        sums = all_reduce(torch.cat([wide.sum(dims), (wide * wide).sum(dims), rows]))
        channels = x.shape[1]
        count = sums[-1]
        mean = sums[:channels] / count
        var = sums[channels : 2 * channels] / count - mean * mean
        shape = [1, channels] + [1] * (x.dim() - 2)
        out = (wide - mean.view(shape)) * torch.rsqrt(var.view(shape) + module.eps)
        if module.weight is not None:
            out = out * module.weight.double().view(shape) + module.bias.double().view(shape)
        if module.training and module.running_mean is not None:
            with torch.no_grad():
                _update_running(module.running_mean, module.running_var, module.num_batches_tracked,
                                module.momentum, mean.detach(), var.detach(), int(count))
        return out.to(x.dtype)

    return forward


def check_microbatches(model: nn.Module, mode: str, microbatches: int | str, where: str) -> bool:
    """Whether BatchNorm layers must defer their running statistics to the end of each step (they do in
    pipelines with batchnorm="local"); refuses a split batch with batchnorm="exact"."""
    layers = batchnorm_layers(model)
    if not layers:
        return False
    if mode == "local":
        return True
    if microbatches != 1:
        raise ParatrainError(
            f"{where}: BatchNorm layers of {type(model).__name__} ({_names(layers)}) would normalise each of "
            f"the micro-batches (microbatches={microbatches!r}) with its own statistics and update the running "
            "statistics once per micro-batch, unlike one process. Use microbatches=1, or pass "
            "setup(batchnorm='local') to normalise per micro-batch while keeping running statistics as for "
            "the whole batch, or replace BatchNorm with GroupNorm/LayerNorm (exact under any split)"
        )
    return False


class _Pending:
    """Sums of one layer's micro-batches in the current step: rows, per-channel sum and sum of squares."""

    def __init__(self, module_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], momentum: Any) -> None:
        self.running_mean, self.running_var, self.tracked = module_tensors
        self.momentum = momentum
        self.rows = 0
        self.total: torch.Tensor | None = None
        self.squares: torch.Tensor | None = None


def _pending() -> dict[str, _Pending]:
    """This step's sums, held by the active run (`step_state`)."""
    return active().batchnorm


def deferred_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                        momentum: Any, eps: float, key: str, tracked: torch.Tensor | None = None) -> torch.Tensor:
    """Batch norm normalising by this micro-batch's statistics, collecting them for `commit`."""
    if not training or running_mean is None or running_var is None:
        return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum or 0.0, eps)
    dims = [d for d in range(x.dim()) if d != 1]
    with torch.no_grad():
        flat = x.detach().double()
        held = _pending()
        pending = held.get(key)
        if pending is None:
            pending = held[key] = _Pending((running_mean, running_var, tracked), momentum)
        pending.rows += x.numel() // x.shape[1]
        total, squares = flat.sum(dims), (flat * flat).sum(dims)
        pending.total = total if pending.total is None else pending.total + total
        pending.squares = squares if pending.squares is None else pending.squares + squares
    return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)


def commit() -> None:
    """End of a training step: update every layer's running statistics once, from all its micro-batches."""
    held = _pending()
    with torch.no_grad():
        for pending in held.values():
            if pending.rows == 0 or pending.total is None or pending.squares is None:
                continue
            mean = pending.total / pending.rows
            var = pending.squares / pending.rows - mean * mean
            _update_running(pending.running_mean, pending.running_var, pending.tracked, pending.momentum, mean, var,
                            pending.rows)
    held.clear()


def _update_running(running_mean: torch.Tensor, running_var: torch.Tensor, tracked: torch.Tensor | None,
                    momentum: float | None, mean: torch.Tensor, var: torch.Tensor, rows: int) -> None:
    """One BatchNorm update of the running statistics from a batch's mean and biased variance over `rows`,
    as torch makes it (the variance made unbiased; momentum=None: a cumulative average)."""
    unbiased = var * rows / max(rows - 1, 1)
    if tracked is not None:
        tracked.add_(1)
    if momentum is None:
        momentum = 1.0 / float(tracked) if tracked is not None else 0.0
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)


def snapshot() -> dict[str, _Pending]:
    return dict(_pending())


def restore(pending: dict[str, _Pending]) -> None:
    held = _pending()
    held.clear()
    held.update(pending)


def discard() -> None:
    """Forget what trial steps collected (they leave no trace)."""
    _pending().clear()


def defer_modules(model: nn.Module) -> None:
    """BatchNorm modules of `model` (not traced) collect micro-batch statistics instead of updating."""
    for name, module in model.named_modules():
        if isinstance(module, _BATCH_NORMS) and "forward" not in module.__dict__:
            _forwards.replace(module, _module_forward(module, name), "deferred batchnorm")


def _module_forward(module: Any, key: str) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return deferred_batch_norm(x, module.weight, module.bias, module.running_mean, module.running_var,
                                   module.training, module.momentum, module.eps, key, module.num_batches_tracked)

    return forward


def defer_graph(gm: fx.GraphModule, path_of: Any) -> None:
    """The same in a traced graph: batch_norm ops collect, and the per-call increments of
    num_batches_tracked go (commit counts a step once)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.add_.Tensor and isinstance(node.args[0], fx.Node) \
                and str(node.args[0].target).endswith("num_batches_tracked"):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.target is torch.ops.aten.batch_norm.default:
            x, w, b, rm, rv, training, momentum, eps = node.args[:8]
            tracked_name = str(rm.target).rsplit(".", 1)[0] + ".num_batches_tracked" if isinstance(rm, fx.Node) \
                else None
            tracked = next((n for n in gm.graph.nodes if n.op == "get_attr" and n.target == tracked_name), None)
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(deferred_batch_norm, (x, w, b, rm, rv, training, momentum, eps,
                                                                   path_of(node), tracked))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    gm.recompile()
