"""Gradient clipping by the norm of the whole model's gradient, under every layout.

`torch.nn.utils.clip_grad_norm_(model.parameters(), c)` measures the gradients this process holds. That is
the whole model's under single, DDP and one-process model parallelism, and torch's DTensor arithmetic
makes it right under FSDP; but a pipeline rank holds only its stages, so each stage would be clipped by
its own norm and the run would train to other weights than one process, with no error. Here the norm is
taken over everything the model's gradient is made of, each element counted once:

    plain tensors   replicated layouts hold them all already; those a group's ranks hold between them (the
                    experts of a listed MoE block under `ep`) are summed over that group
    DTensors        FSDP shards and tensor-parallel pieces: their own mesh reduces them, per mesh
    pipelines       each rank's sum of both (p-th powers) is summed over the pipeline's ranks; a parameter
                    tied across stages, such as an embedding shared with the LM head, is counted on its
                    first holder only

and every rank scales its gradients by the same factor, min(1, max_norm / (norm + 1e-6)), as torch does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import ParatrainError

if TYPE_CHECKING:
    from .parallel.pipeline.pipelining import PipelineModule

SPREAD = "_paratrain_spread_over"
"""A plain parameter carrying this attribute (a process group) is one of a set the group's ranks hold between
them, each its own (a listed expert under expert parallelism): its part of the norm is summed over the group."""


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "full_tensor")


def _pipeline(model: nn.Module) -> PipelineModule | None:
    from .parallel.pipeline.pipelining import PipelineModule

    return next((m for m in model.modules() if isinstance(m, PipelineModule)), None)


def _power_sum(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Sum of norm**p (or the max for the inf-norm) as a float64 scalar on the first norm's device."""
    stacked = torch.stack([n.to(norms[0].device, torch.float64) for n in norms])
    return stacked.max() if math.isinf(norm_type) else (stacked**norm_type).sum()


def total_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient, the same on every rank (collective under pipelines, FSDP and
    tensor parallelism: every rank must call it)."""
    pipeline = _pipeline(model)
    counted_elsewhere = pipeline.tied.counted_elsewhere if pipeline is not None else set()
    plain: list[torch.Tensor] = []
    by_mesh: dict[object, list[torch.Tensor]] = {}
    spread: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for p in model.parameters():
        if p.grad is None or id(p) in counted_elsewhere:
            continue
        group = getattr(p, SPREAD, None)
        if group is not None:
            spread.setdefault(id(group), (group, []))[1].append(p.grad)
        elif _is_dtensor(p.grad):
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)  # type: ignore[attr-defined]
        else:
            plain.append(p.grad)
    parts: list[torch.Tensor] = []
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if plain or pipeline is not None:
        parts.append(_power_sum([torch.linalg.vector_norm(g.detach(), norm_type) for g in plain], norm_type)
                     if plain else torch.zeros((), dtype=torch.float64, device=device))
    for group, grads in spread.values():  # each rank holds some of the group's tensors: summed over the group
        power = _power_sum([torch.linalg.vector_norm(g.detach(), norm_type) for g in grads], norm_type)
        dist.all_reduce(power, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM,
                        group=group)
        parts.append(power)
    for grads in by_mesh.values():  # meshes in parameter order: the same on every rank of the mesh
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        whole = norm.full_tensor() if _is_dtensor(norm) else norm  # type: ignore[attr-defined]
        parts.append(_power_sum([whole], norm_type))
    if not parts:
        return torch.zeros((), device=device)
    stacked = torch.stack([part.to(parts[0].device) for part in parts])  # each is already a sum of p-th powers
    local = stacked.max() if math.isinf(norm_type) else stacked.sum()
    if pipeline is not None and dist.is_initialized():  # this rank's stages, then every stage of the pipeline
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        local = local.to(pipeline.device)
        dist.all_reduce(local, op=op, group=pipeline.group)
    return local if math.isinf(norm_type) else local ** (1.0 / norm_type)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale every gradient of `model` so that the whole model's gradient norm is at most `max_norm`;
    returns that norm before clipping (on every rank). Where this process holds the whole gradient on one
    kind of tensor, this is torch's own clip_grad_norm_, bit for bit."""
    if not max_norm > 0:
        raise ParatrainError(f"clip_grad_norm_: max_norm must be positive, got {max_norm!r}")
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    meshes = {getattr(g, "device_mesh") for g in grads if _is_dtensor(g)}  # noqa: B009 - DTensor only
    plain = any(not _is_dtensor(g) for g in grads)
    spread = any(getattr(p, SPREAD, None) is not None for p in params)
    if _pipeline(model) is None and len(meshes) + plain <= 1 and not spread:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    norm = total_norm(model, float(norm_type)).float()
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise ParatrainError(f"clip_grad_norm_: the gradient norm is {float(norm)}; some gradient is NaN or "
                             "infinite (pass error_if_nonfinite=False to clip anyway, as torch allows)")
    coef = float(torch.clamp(torch.tensor(float(max_norm)) / (norm.cpu() + 1e-6), max=1.0))  # torch's arithmetic
    for g in grads:
        g.mul_(coef)
    return norm
