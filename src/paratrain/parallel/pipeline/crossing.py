"""What crosses one cut of a traced graph, and how the later segment gets each value back.

torch's pipeline stages pass tensors only, so a value the later segment needs is one of:

- sent: a tensor (or a structure of them) the earlier segment computed, passed as it is;
- reread: an integer equal to a dimension of a sent tensor (`b = x.size(0)` before `x.view(b, t, h, d)`),
  read again from that tensor, so the graph stays valid at any batch size;
- recomputed: integer arithmetic on such sizes (`b * heads` where attention folds heads into the batch, a class
  token expanded over `b`), the same operations copied into the later segment, which yields the same value;
- carried: any other number (one computed from data, or from a size no sent tensor has), sent as a 0-d integer
  tensor (a float as its bits, so that no gradient is asked for it) and turned back into a Python number after
  the cut.

The earlier segment returns `sent + carried` in this order; the later one takes them as its inputs in the same
order, and computes the reread and recomputed integers itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

SCALARS = (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)


@dataclass
class Crossing:
    """The values one cut passes, split by how the later segment gets them."""

    sent: list[fx.Node] = field(default_factory=list)
    """Values passed to the next segment as they are, in this order."""
    carried: list[fx.Node] = field(default_factory=list)
    """Numbers passed as 0-d integer tensors, after the sent values."""
    reread: dict[fx.Node, tuple[fx.Node, int]] = field(default_factory=dict)
    """Integers recomputed after the cut as `tensor.size(dim)` of a sent tensor."""
    recomputed: list[fx.Node] = field(default_factory=list)
    """Integer operations on reread sizes (and constants), copied after the cut in graph order."""


def _expr(size: Any) -> str:
    return str(size.node.expr) if isinstance(size, torch.SymInt) else str(size)


def _is_scalar(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), SCALARS)


class _Finder:
    """Decides, per integer node, whether the later segment can compute it from what crosses."""

    def __init__(self, tensors: list[fx.Node]) -> None:
        self.sizes = {_expr(size): (t, d) for t in reversed(tensors) for d, size in enumerate(t.meta["val"].shape)}
        self.tensors = set(tensors)
        self.reread: dict[fx.Node, tuple[fx.Node, int]] = {}
        self.recomputed: set[fx.Node] = set()
        self._known: dict[fx.Node, bool] = {}

    def derivable(self, node: fx.Node) -> bool:
        if node not in self._known:
            self._known[node] = self._derive(node)
        return self._known[node]

    def _derive(self, node: fx.Node) -> bool:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and _expr(val) in self.sizes:
            self.reread[node] = self.sizes[_expr(val)]
            return True
        if node.op != "call_function" or not _is_scalar(node):
            return False
        inputs = node.all_input_nodes
        if all(n in self.tensors or (_is_scalar(n) and self.derivable(n)) for n in inputs):
            self.recomputed.add(node)
            return True
        return False


def crossing(live: list[fx.Node]) -> Crossing:
    """How the values `live` across a cut (defined before it, used after it, in graph order) cross it."""
    tensors = [n for n in live if isinstance(n.meta.get("val"), torch.Tensor)]
    finder = _Finder(tensors)
    out = Crossing()
    for node in live:
        if not _is_scalar(node):
            out.sent.append(node)
        elif not finder.derivable(node):
            out.carried.append(node)
    out.reread = finder.reread
    order = {n: i for i, n in enumerate(live[0].graph.nodes)} if live else {}
    out.recomputed = sorted(finder.recomputed - set(finder.reread), key=order.__getitem__)
    return out


def _is_float(node: fx.Node) -> bool:
    return isinstance(node.meta["val"], torch.SymFloat | float)


def receive(graph: fx.Graph, out: Crossing, env: dict[fx.Node, fx.Node], lookup: Callable[[fx.Node], fx.Node]) -> None:
    """The later segment's inputs, in the order `send` returns them, and the integers it computes itself."""
    for node in out.sent:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in out.carried:
        value = graph.placeholder(node.name)
        if _is_float(node):
            value = graph.call_method("view", (value, torch.float64))
        env[node] = graph.call_method("item", (value,))
    for node, (tensor, dim) in out.reread.items():
        env[node] = graph.call_function(torch.ops.aten.sym_size.int, (env[tensor], dim))
    for node in out.recomputed:
        env[node] = graph.node_copy(node, lookup)


def send(graph: fx.Graph, out: Crossing, sent: Callable[[fx.Node], fx.Node],
         lookup: Callable[[fx.Node], fx.Node]) -> tuple[fx.Node, ...]:
    """The earlier segment's outputs: `sent(node)` for each sent value, then each carried number as a 0-d tensor."""
    carried = []
    for node in out.carried:
        boolean = isinstance(node.meta["val"], torch.SymBool | bool)
        dtype = torch.bool if boolean else torch.float64 if _is_float(node) else torch.int64
        value = graph.call_function(torch.scalar_tensor, (lookup(node),), {"dtype": dtype})
        carried.append(graph.call_method("view", (value, torch.int64)) if _is_float(node) else value)
    return (*(sent(n) for n in out.sent), *carried)


__all__ = ["Crossing", "crossing", "receive", "send"]
