"""Expert parallelism: each rank of an expert group holds a share of every MoE layer's experts, and tokens travel
to them (`dispatch`).

The expert axis is carved from the data-parallel ranks, as torchtitan carves it: ranks that load different rows
of the global batch also hold different experts. A grouped experts module keeps its 3-D weights as DTensors split
on the expert dimension over the group (so checkpoints, export and a meta build see one tensor under its own name);
a listed block keeps its own experts and reaches the others through the group, its rows exchanged once per forward
(`listed`). Each expert's gradient is then the sum over the group's tokens; `ExpertGrads` sums it over the ranks
holding the same experts and divides by the data-parallel degree, which makes it the mean over the global batch
that data parallelism gives every other weight (those go through FSDP or the replicas' average as usual, the
experts left out of both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ... import _forwards
from ...errors import ParatrainError
from ..tensor import local_part
from . import dispatch, listed
from .find import Experts, find
from .listed import REASON


@dataclass
class Groups:
    """The process groups of one rank's expert parallelism."""

    mesh: Any
    """1-D DeviceMesh over the expert group: ranks that exchange tokens and hold different experts."""
    rank: int
    size: int
    replicas: Any
    """Group of the ranks holding the same experts (other expert groups); None when there is one."""
    replica_count: int
    data_parallel: int
    """Ranks loading different rows: the gradient of every expert is divided by it, as data parallelism averages."""

    @property
    def group(self) -> Any:
        return self.mesh.get_group()


@dataclass
class ExpertGrads:
    """After a backward that ends an accumulation window: each expert's gradient summed over the ranks holding the
    same experts and divided by the data-parallel degree (see the module docstring)."""

    groups: Groups
    params: list[nn.Parameter] = field(default_factory=list)
    sync: bool = True
    _queued: bool = False

    def queue(self, grad: torch.Tensor) -> torch.Tensor:
        if self.sync and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce)  # type: ignore[attr-defined]
        return grad

    def reduce(self) -> None:
        self._queued = False
        for p in self.params:
            if p.grad is None:
                continue
            grad = local_part(p.grad)
            if self.groups.replica_count > 1:
                dist.all_reduce(grad, group=self.groups.replicas)
            grad /= self.groups.data_parallel


def apply_ep(model: nn.Module, groups: Groups) -> ExpertGrads:
    """Split every MoE layer's experts over the expert group; returns what reduces their gradients."""
    found = find(model)
    if not found:
        raise ParatrainError(
            f"expert parallelism: {type(model).__name__} has no mixture-of-experts layer paratrain recognises (a "
            "Hugging Face experts module with 3-D expert weights, or a block holding a router nn.Linear with one "
            "output per expert beside an nn.ModuleList of identical experts); drop 'ep' from the strategy")
    grads = ExpertGrads(groups)
    for experts in found:
        if experts.count % groups.size:
            raise ParatrainError(
                f"expert parallelism: {experts.path} has {experts.count} experts, which {groups.size} expert-parallel "
                f"ranks cannot share equally; use an ep_size that divides {experts.count}")
        module = model.get_submodule(experts.path)
        if experts.kind == "grouped":
            _split_grouped(module, experts, groups, grads)
        else:
            block = model.get_submodule(experts.block) if experts.block else model
            listed.split(block, module, experts, groups, grads)
    return grads


def _split_grouped(module: nn.Module, experts: Experts, groups: Groups, grads: ExpertGrads) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    for key, p in list(module._parameters.items()):
        assert p is not None
        split = nn.Parameter(distribute_tensor(p.detach(), groups.mesh, [Shard(0)], src_data_rank=None),
                             requires_grad=p.requires_grad)
        module._parameters[key] = split
        grads.params.append(split)
    local = experts.count // groups.size
    _forwards.replace(module, _grouped_forward(module, module.forward, experts, local, groups, grads), REASON)


@contextlib.contextmanager
def _own_experts(module: nn.Module, local: int) -> Iterator[None]:
    """The module computes as if it had only this rank's experts: its weights' local pieces, its expert count."""
    kept, count = dict(module._parameters), module.num_experts  # type: ignore[attr-defined]
    for key, p in kept.items():
        if p is not None:
            module._parameters[key] = p.to_local()  # type: ignore[assignment,attr-defined]  # grad into the DTensor
    module.num_experts = local  # type: ignore[assignment]
    try:
        yield
    finally:
        module._parameters.update(kept)
        module.num_experts = count  # type: ignore[assignment]


def _grouped_forward(module: nn.Module, inner: Any, experts: Experts, local: int, groups: Groups,
                     grads: ExpertGrads) -> Any:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert; each expert's rows in token order, as one process
        chosen = flat[order]
        kept = chosen < experts.count  # an index equal to the count marks "no expert" in Hugging Face's code
        order, chosen = order[kept], chosen[kept]
        tokens = order // k
        # Counts per expert, not per rank: the receiver then knows each row's expert from where it sits (rows come
        # sorted by expert from every rank), so no ids travel.
        per_expert = torch.bincount(chosen, minlength=experts.count)
        from_each = dispatch.counts(per_expert, groups.group).view(groups.size, local)  # [rank, my expert]
        sends, recvs = per_expert.view(groups.size, local).sum(1).tolist(), from_each.sum(1).tolist()
        rows = dispatch.exchange(hidden_states[tokens], sends, recvs, groups.group)
        ids = torch.arange(local, device=rows.device).repeat(groups.size).repeat_interleave(
            from_each.reshape(-1).to(rows.device))
        ones = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=rows.device)
        with _own_experts(module, local):
            computed = inner(rows, ids[:, None], ones)
        back = dispatch.exchange(computed, recvs, sends, groups.group)
        weights = top_k_weights.reshape(-1)[order]
        out = torch.zeros_like(hidden_states).index_add(0, tokens, (back * weights[:, None]).to(hidden_states.dtype))
        if out.requires_grad:
            out.register_hook(grads.queue)
        return out

    return forward
