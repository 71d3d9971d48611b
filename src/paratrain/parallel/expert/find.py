"""Which modules of a model are mixtures of experts, as their authors write them.

Two forms are recognised:

- grouped: a Hugging Face experts module (Mixtral, Qwen2-MoE, Qwen3-MoE and the other models transformers builds
  with `use_experts_implementation`): every expert's weights stacked in 3-D tensors whose first dimension is the
  expert, called as `experts(hidden_states, top_k_index, top_k_weights)` by its block after the router;
- listed: a user's block holding a router `Linear` with one output per expert and the experts as a `ModuleList` of
  identical feed-forward modules, each called on the rows routed to it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Experts:
    path: str
    """The experts module: a grouped module, or the ModuleList of a listed block."""
    kind: str
    """"grouped" or "listed"."""
    count: int
    block: str
    """The MoE block holding the experts and their router (where an auxiliary loss would come from)."""


def _grouped(module: nn.Module) -> int:
    """The number of experts of a grouped experts module, or 0."""
    count = getattr(module, "num_experts", None)
    own = list(module._parameters.values())
    if not isinstance(count, int) or count < 2 or not own:
        return 0
    if not all(p is not None and p.dim() >= 2 and p.shape[0] == count for p in own):
        return 0
    try:
        names = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return 0
    return count if "top_k_index" in names else 0


def _listed(module: nn.Module, parent: nn.Module) -> int:
    """The number of experts of a ModuleList of identical experts beside a router with one output each, or 0."""
    if not isinstance(module, nn.ModuleList) or len(module) < 2:
        return 0
    shapes = [[(n, tuple(p.shape)) for n, p in m.named_parameters()] for m in module]
    if len({type(m) for m in module}) != 1 or any(s != shapes[0] for s in shapes) or not shapes[0]:
        return 0
    routers = [m for m in parent.children() if isinstance(m, nn.Linear) and m.out_features == len(module)]
    return len(module) if routers else 0


def find(model: nn.Module) -> list[Experts]:
    found: list[Experts] = []
    for name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            path = f"{name}.{child_name}" if name else child_name
            count = _grouped(child)
            if count:
                found.append(Experts(path, "grouped", count, name))
                continue
            count = _listed(child, parent)
            if count:
                found.append(Experts(path, "listed", count, name))
    return found
