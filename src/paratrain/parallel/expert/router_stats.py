"""Router statistics over the global batch, as one process computes them.

A mixture of experts' load-balancing loss (Switch, Mixtral: the number of experts times the sum over experts of
the share of tokens routed to each and its mean router probability) is a product of two means over the tokens of a
batch. Under data parallelism each rank's forward sees its own rows: the product of its means is not the global
batch's, and averaging the ranks' values does not make it one (a user MoE under plain `ddp 2` trained to weights
3e-3 away from one process's). So the statistics are taken over every data-parallel rank's rows:

- `global_rows(t)`: the rows of `t` from every rank that loads other rows of the global batch, concatenated in
  the global batch's order, differentiable (its backward hands each rank the gradient of its own rows, summed over
  the ranks' losses, which the data-parallel mean then divides). One process: `t` itself.
- Hugging Face MoE models compute theirs in `load_balancing_loss_func`, which `install` wraps to pass it the global
  batch's router logits and mask.
- A user MoE block whose forward leaves a loss-like scalar (an attribute or an output) that was not computed
  through `global_rows` is refused by name under a layout whose forward sees part of the global batch, once that
  scalar reaches the loss: when the backward hands it a gradient that is not exactly zero. A term the loop leaves
  out, or weights by an exact 0, contributes nothing to any gradient, so the run is exact either way and trains.

Micro-batches (accumulation, pipelines) see part of the global batch in each forward, and no collective in one
forward can see the rest: there the statistics are refused, naming the fix.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ... import _forwards
from ...errors import ParatrainError
from .. import step_state
from .find import find

_HF_BALANCE = "load_balancing_loss_func"
"""Where a Hugging Face MoE model's module computes its auxiliary loss (Mixtral, Qwen2-MoE, ...)."""
REASON = "router statistics over the global batch (parallel.expert.router_stats)"


@dataclass
class Rows:
    """Which rows of the global batch one forward sees: set by `run.prepare` in the run's step state."""

    replica: int = 0
    replicas: int = 1
    parts: int = 1
    """Forwards per step of one replica (accumulation steps, or a pipeline's micro-batches)."""
    groups: tuple[tuple[int, ...], ...] = ()
    """Every set of ranks that load different rows of one step (`ParallelDims.replica_groups`); empty: the world."""
    _group: Any = field(default=None, repr=False)
    _made: bool = False

    def group(self) -> Any:
        """This rank's data-parallel ranks, made on first use (collective: every rank runs the same forward and
        makes every group, in the same order)."""
        if not self._made:
            self._made = True
            for ranks in self.groups if len(self.groups) > 1 else ():
                made = dist.new_group(list(ranks))
                if dist.get_rank() in ranks:
                    self._group = made
        return self._group


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(counts, torch.tensor([t.shape[0]], dtype=torch.int64), group=group)
        sizes = [int(c) for c in counts]
        most = max(sizes)
        padded = t.new_zeros((most, *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.sizes, ctx.group, ctx.rank = sizes, group, dist.get_rank(group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)  # every rank's loss holds the global statistic
        start = sum(ctx.sizes[: ctx.rank])
        return summed[start : start + ctx.sizes[ctx.rank]], None, None


def global_rows(t: torch.Tensor) -> torch.Tensor:
    """The rows (first dimension) of `t` from every data-parallel rank, in the global batch's order (see the module
    docstring); `t` itself in one process or outside a run."""
    rows = step_state.active().rows
    if rows is None or (rows.replicas == 1 and rows.parts == 1):
        return t
    if rows.parts > 1:
        raise ParatrainError(
            f"global_rows: each forward sees 1/{rows.parts} of its replica's rows (gradient accumulation or a "
            "pipeline's micro-batches), and no forward can see the rest of the global batch; statistics over the "
            "global batch (an MoE load-balancing loss) need grad_accum=1 and a layout without pipeline stages")
    return _GatherRows.apply(t, rows.group(), rows.replicas)  # type: ignore[no-any-return]


def _through_gather(t: torch.Tensor, limit: int = 20000) -> bool:
    """Whether `t` was computed through `global_rows`."""
    seen: set[int] = set()
    stack = [t.grad_fn]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if "_GatherRows" in type(node).__name__:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _scalars(value: Any) -> list[torch.Tensor]:
    items = value if isinstance(value, tuple | list) else value.values() if isinstance(value, dict) else [value]
    return [t for t in items if isinstance(t, torch.Tensor) and t.dim() == 0 and t.requires_grad]


def _checked(block: nn.Module, name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        rows = step_state.active().rows
        if rows is None or (rows.replicas == 1 and rows.parts == 1) or not torch.is_grad_enabled():
            return out
        found = [("its output", t) for t in _scalars(out)]
        found += [(f"self.{k}", t) for k, t in vars(block).items() if isinstance(t, torch.Tensor)
                  and t.dim() == 0 and t.requires_grad]
        for where, t in found:
            if not _through_gather(t):
                refusal = _refusal(block, name, where, rows)
                if rows.parts > 1:  # a pipeline's stages would wait on a backward that raised: refused at once
                    raise refusal
                t.register_hook(_refuse_if_weighted(refusal))
        return out

    return forward


def _refusal(block: nn.Module, name: str, where: str, rows: Rows) -> ParatrainError:
    sees = (f"1/{rows.parts} of its replica's rows" if rows.parts > 1
            else f"the rows of 1 of {rows.replicas} data-parallel ranks")
    return ParatrainError(
        f"{name} ({type(block).__name__}) is a mixture of experts whose forward leaves a loss-like scalar ({where}) "
        f"computed from the tokens it sees, {sees}, and the loss uses it: an auxiliary loss of router statistics "
        "(token shares times mean probabilities) over part of the batch is not the global batch's, and the run "
        "would train to other weights than one process. Take the statistics over the global batch: probs = "
        "paratrain.global_rows(probs) before computing them (with grad_accum=1 and no pipeline), or leave the "
        "auxiliary loss out of the loss (or weight it 0)")


def _refuse_if_weighted(refusal: ParatrainError) -> Callable[[torch.Tensor], None]:
    """A hook on the scalar: its gradient is the loss's weight on it. Exactly zero (weighted 0, or reaching the loss
    only through a product with an exact 0) changes no parameter's gradient, so the per-rank statistic is harmless;
    anything else is refused, in the backward, before any parameter's gradient is computed from it. Every rank
    weights the term alike (the loop's own constant), so every rank refuses in the same backward."""

    def hook(grad: torch.Tensor) -> None:
        if bool(grad.detach().ne(0).any()):
            raise refusal

    return hook


def install(model: nn.Module) -> None:
    """Watch the user's MoE blocks, and give Hugging Face's load-balancing loss the global batch's router logits."""
    for experts in find(model):
        block = model.get_submodule(experts.block) if experts.block else model
        if experts.kind == "listed" and REASON not in _forwards.replaced(block):
            _forwards.replace(block, _checked(block, experts.block, block.forward), REASON)
    for module in model.modules():
        namespace = sys.modules.get(type(module).__module__)
        original = getattr(namespace, _HF_BALANCE, None)
        if namespace is not None and original is not None and not getattr(original, "_paratrain_global", False):
            setattr(namespace, _HF_BALANCE, _global_balance(original))


def _global_balance(original: Callable[..., Any]) -> Callable[..., Any]:
    def balance(gate_logits: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(gate_logits, tuple):
            gate_logits = tuple(global_rows(g) for g in gate_logits)
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        if mask is not None:
            mask = global_rows(mask)
            if len(args) > 2:
                args = (*args[:2], mask, *args[3:])
            else:
                kwargs["attention_mask"] = mask
        return original(gate_logits, *args, **kwargs)

    balance._paratrain_global = True  # type: ignore[attr-defined]
    return balance
