"""Expert and context parallelism written by hand in plain PyTorch, as twins of paratrain's `ep` and `cp`.

- `torch-ep` (the `gpt-moe` workload): each rank of an expert group holds a contiguous share of every MoE block's
  experts (rank r: experts r*E/ep .. (r+1)*E/ep - 1, the ownership paratrain gives them). Once per MoE block the
  routed rows travel to their owners: the per-expert counts first (`all_to_all_single`), then the rows
  (`all_to_all_single_autograd`), each owner runs its experts on their rows, and the results travel back the same
  way to be weighted and summed. Expert gradients are summed over the ranks holding the same experts and divided
  by the data-parallel degree: each rank's loss is the mean over its share of the global batch, so the mean over
  the whole batch (one process's loss) is their mean; the other weights average over every rank.

      rank 0 rows -> experts 0..3 (rank 0) | 4..7 (rank 1)     sorted by expert, cut by owner, exchanged,
      rank 1 rows -> experts 0..3 (rank 0) | 4..7 (rank 1)     grouped by expert, computed, exchanged back

  Hugging Face grouped experts (Mixtral's 3-D `gate_up_proj` and `down_proj`) are split the same way: each rank
  keeps its experts' slices as its own parameters and the experts module's call goes through the same exchange.

- `torch-cp` (the `gpt-long` workload): each sequence cut into 2 x cp chunks, rank r keeping chunks r and
  2cp-1-r (the load balance of causal attention), its tokens given their global positions; every attention
  layer gathers the keys and values of the whole sequence over the group (`all_gather_single_autograd`: its
  backward returns each key's gradient to the rank that made it) and attends with the causal mask of the global
  positions. Each rank's loss is the mean over its own tokens' targets (torchtitan shards the labels with the
  inputs), so the mean over the ranks is the whole sequence's loss and the ranks' gradients average to one
  process's.

Nothing here imports paratrain's training API: it is the code a user would write without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..errors import ParatrainError
from ..measure import gpt as gpt_model
from ..measure.workloads import Batch, Workload
from .jobs import Settings, Spec
from .references import Step, build_model, share_rows, train_loop


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None, "the process group is initialised before a reference is built"
    return group


def _wait(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import wait_tensor

    return wait_tensor(t)


def _dispatch(flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, count: int, group: Any, size: int,
              compute: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """Rows (N, d) routed to experts `chosen` (N, k) with `weights` (N, k): each (row, expert) pair sent to the
    expert's owner, `compute(rows grouped by local expert, count of each)` there, the results sent back, weighted
    and summed per row."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    local = count // size
    order = torch.argsort(chosen.reshape(-1), stable=True)  # (row, slot) pairs by expert
    tokens = order // chosen.shape[-1]
    per_expert = torch.bincount(chosen.reshape(-1), minlength=count)
    from_each = torch.empty_like(per_expert)  # each rank's rows for each of my experts, rank-major
    dist.all_to_all_single(from_each, per_expert, group=group)
    send = per_expert.view(size, local).sum(1).tolist()
    recv = from_each.view(size, local).sum(1).tolist()
    rows = _wait(all_to_all_single_autograd(flat[tokens], recv, send, group))
    expert_of = torch.arange(local, device=flat.device).repeat(size).repeat_interleave(from_each)
    grouped = torch.argsort(expert_of, stable=True)
    computed = compute(rows[grouped], torch.bincount(expert_of, minlength=local).tolist())
    computed = computed.index_select(0, torch.argsort(grouped))  # back in the order received
    back = _wait(all_to_all_single_autograd(computed, send, recv, group))
    return torch.zeros_like(flat).index_add(0, tokens, (back * weights.reshape(-1)[order, None]).to(flat.dtype))


def _owned(count: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(first, how many): the contiguous share of `count` experts rank `rank` of `size` holds."""
    if count % size:
        raise ParatrainError(f"torch-ep: {what} has {count} experts, which {size} ranks cannot share equally")
    return rank * (count // size), count // size


class ExpertParallelMoE(nn.Module):
    """The gpt-moe workload's MoE block with this rank's experts only; the others are reached by `_dispatch`."""

    def __init__(self, moe: gpt_model.MoE, group: dist.ProcessGroup, rank: int, size: int) -> None:
        super().__init__()
        self.router, self.top_k, self.count = moe.router, moe.top_k, len(moe.experts)
        self.group, self.size = group, size
        self.first, local = _owned(self.count, rank, size, "an MoE block")
        """The global index of this rank's first expert."""
        self.experts = nn.ModuleList(moe.experts[self.first:self.first + local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = F.softmax(self.router(flat), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = _dispatch(flat, chosen, weights, self.count, self.group, self.size, self._compute)
        return out.reshape_as(x)

    def _compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return torch.cat([expert(part) for expert, part in zip(self.experts, rows.split(counts))])


class GroupedExpertParallel(nn.Module):
    """A Hugging Face experts module (every expert's weights stacked in 3-D `gate_up_proj` and `down_proj`:
    Mixtral's, Qwen2-MoE's) with this rank's slices only, called as its block calls it."""

    def __init__(self, experts: Any, group: dist.ProcessGroup, rank: int, size: int) -> None:
        super().__init__()
        self.count, self.group, self.size = int(experts.num_experts), group, size
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = experts.act_fn
        self.first, local = _owned(self.count, rank, size, type(experts).__name__)
        mine = slice(self.first, self.first + local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[mine].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[mine].clone())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _dispatch(hidden_states, top_k_index, top_k_weights, self.count, self.group, self.size,
                         self._compute)

    def _compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for j, part in enumerate(rows.split(counts)):
            gate, up = F.linear(part, self.gate_up_proj[j]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[j]))
        return torch.cat(outs)


def _grouped(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Parameter) and getattr(module, name).dim() == 3
               for name in ("gate_up_proj", "down_proj")) and hasattr(module, "num_experts")


def expert_parallel(model: nn.Module, group: dist.ProcessGroup, rank: int, size: int) -> list[nn.Parameter]:
    """Every MoE block of the gpt-moe workload, or every Hugging Face grouped experts module, replaced by its
    expert-parallel form; returns this rank's expert weights."""
    experts: list[nn.Parameter] = []
    for block in list(model.modules()):
        mlp = getattr(block, "mlp", None)
        if isinstance(mlp, gpt_model.MoE):
            block.mlp = ExpertParallelMoE(mlp, group, rank, size)
            experts += list(block.mlp.experts.parameters())
        grouped = getattr(block, "experts", None)
        if isinstance(grouped, nn.Module) and _grouped(grouped):
            block.experts = GroupedExpertParallel(grouped, group, rank, size)
            experts += list(block.experts.parameters())
    if not experts:
        raise ParatrainError(f"torch-ep is written for the gpt-moe workload's MoE blocks (measure/gpt.py MoE) and "
                             f"Hugging Face grouped experts (Mixtral); {type(model).__name__} has neither: use "
                             "--workload gpt-moe")
    return experts


def _average(params: list[nn.Parameter], group: Any, divide: int) -> None:
    """Gradients summed over `group` in one flat all-reduce (Megatron's contiguous buffer), then divided."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= divide
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p)


def torch_ep(spec: Spec, workload: Workload, data: Batch, settings: Settings, device: torch.device) -> Step:
    """Expert parallelism over expert groups of `ep_size` ranks (default: every worker), the expert group innermost
    on a ("ep_replicas", "ep") mesh as paratrain lays it out; every rank loads its own rows of the global batch."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    ep = int(dict(spec.options).get("ep_size", world))
    if ep < 2 or world % ep:
        raise ParatrainError(f"torch-ep: ep_size {ep} must be at least 2 and divide the {world} workers")
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("ep_replicas", "ep"))
    model = build_model(workload, settings).to(device)
    experts = expert_parallel(model, mesh.get_group("ep"), mesh.get_local_rank("ep"), ep)
    own = {id(p) for p in experts}
    shared = [p for p in model.parameters() if id(p) not in own]
    replicas = mesh.get_group("ep_replicas") if world > ep else None

    def reduce() -> None:
        _average(shared, _world(), world)
        _average(experts, replicas, world)

    inputs, labels = share_rows(data, dist.get_rank(), world, device, settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=workload.lr)
    return train_loop(model, inputs, labels, workload.loss(), optimizer, device, settings.precision,
                      after_backward=reduce)


def shares(length: int, size: int, rank: int) -> torch.Tensor:
    """Positions rank `rank` of `size` keeps of a sequence of `length`: chunks rank and 2*size-1-rank of 2*size."""
    if length % (2 * size):
        raise ParatrainError(f"torch-cp: sequences of {length} tokens do not cut into {2 * size} equal chunks")
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class ContextParallelAttention(nn.Module):
    """The workload's attention on this rank's queries against the whole sequence's keys and values."""

    def __init__(self, attention: gpt_model.Attention, group: dist.ProcessGroup, mask: torch.Tensor) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = attention.qkv, attention.proj, attention.heads
        self.group, self.mask = group, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_single_autograd

        b, t, d = x.shape
        q, kv = self.qkv(x).split([d, 2 * d], dim=2)
        # keys and values in one gather, sequence first: each rank's share after the other's, in rank order
        kv = _wait(all_gather_single_autograd(kv.transpose(0, 1).contiguous(), 0, self.group))
        k, v = (z.reshape(-1, b, self.heads, d // self.heads).permute(1, 2, 0, 3) for z in kv.split(d, dim=2))
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class WithPositions(nn.Module):
    """The GPT called on its share of the sequence with the share's global positions."""

    def __init__(self, model: nn.Module, positions: torch.Tensor) -> None:
        super().__init__()
        self.model, self.positions = model, positions

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx, self.positions[None, :].expand(idx.shape[0], -1))


def context_parallel(model: nn.Module, group: dist.ProcessGroup, rank: int, size: int, length: int) -> torch.Tensor:
    """Every attention of the GPT made context-parallel for sequences of `length`; returns this rank's positions."""
    blocks = [b for b in getattr(model, "blocks", []) if isinstance(b.attn, gpt_model.Attention)]
    if not blocks:
        raise ParatrainError(f"torch-cp is written for the GPT workloads' attention (measure/gpt.py Attention); "
                             f"{type(model).__name__} has none: use --workload gpt-long")
    mine = shares(length, size, rank)
    keys = torch.cat([shares(length, size, r) for r in range(size)])  # the gathered keys' positions
    mask = (keys[None, :] <= mine[:, None]).to(next(model.parameters()).device)
    for block in blocks:
        block.attn = ContextParallelAttention(block.attn, group, mask)
    return mine


def torch_cp(spec: Spec, workload: Workload, data: Batch, settings: Settings, device: torch.device) -> Step:
    """Context parallelism over every worker: each holds the whole global batch's rows, its share of every
    sequence, and the gradients average over the group."""
    world = dist.get_world_size()
    model = build_model(workload, settings).to(device)
    inputs, labels = share_rows(data, 0, 1, device, settings)
    mine = context_parallel(model, _world(), dist.get_rank(), world, inputs.shape[1]).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=workload.lr)
    return train_loop(WithPositions(model, mine), inputs[:, mine], labels[:, mine], workload.loss(), optimizer, device,
                      settings.precision, after_backward=lambda: _average(params, _world(), world))
