"""Tensor-parallel layers inside a traced pipeline stage (`tp+pp`, `ddp+tp+pp`).

A pipeline cuts a model it has traced with torch.export, and the traced graph computes each Linear as an aten
op on the weight it reads, with every shape the trace saw written into it (`expand(b, 2, 2, t, d)` of a
grouped-query attention that read its head counts from a tensor). So a graph traced from the whole model runs
the whole model, whatever its weights have become. Two steps make it run a rank's tensor-parallel share:

1. the model is traced with each planned Linear standing in as a plain Linear of this rank's shard (the local
   piece of the DTensor weight, no copy), so every shape in the graph is the rank's own;
2. each planned Linear's op in the graph becomes a call of the real tensor-parallel module, so torch's DTensor
   code (ColwiseParallel / RowwiseParallel: their input and output layouts, the all-reduce of a row-wise
   output, the gradient all-reduce of a column-wise input) runs there as it does in the eager model.

The model's forward was already run with the sharded layers in `apply_tp`'s check, which refuses a forward that
hard-codes the full sizes, so what the trace sees is what the rank computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import fx, nn

from ...errors import ParatrainError

_LINEAR = torch.ops.aten.linear.default


def _local(value: torch.Tensor | None) -> nn.Parameter | None:
    if value is None:
        return None
    local = value.to_local() if hasattr(value, "to_local") else value
    return nn.Parameter(local.detach(), requires_grad=value.requires_grad)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr


@contextmanager
def local_layers(model: nn.Module, plan: dict[str, str]) -> Iterator[None]:
    """While tracing: every planned layer is a plain Linear holding this rank's shard of its weights."""
    real: dict[str, nn.Module] = {}
    try:
        for name in sorted(plan, key=lambda n: plan[n] in ("colwise", "rowwise")):  # refusals first
            parent, attr = _parent(model, name)
            layer = parent._modules.get(attr)
            if not isinstance(layer, nn.Linear) or plan[name] in ("packed_colwise", "experts", "partial_grad"):
                what = type(layer).__name__ if layer is not None else "a parameter"
                raise _unplanned(name, f"it is {what} sharded {plan[name]}, which computes on its local pieces "
                                 "outside the trace")
            weight = _local(layer.weight)
            assert weight is not None
            stand_in = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            stand_in.weight = weight
            stand_in.bias = _local(layer.bias)  # type: ignore[assignment]
            real[name] = layer
            parent._modules[attr] = stand_in
        yield
    finally:
        for name, layer in real.items():
            parent, attr = _parent(model, name)
            parent._modules[attr] = layer


def call_layers(gm: fx.GraphModule, model: nn.Module, plan: dict[str, str]) -> None:
    """Each planned Linear's op in `gm` (traced under `local_layers`) becomes a call of the model's module."""
    from ..pipeline.tracing import module_path

    done: set[str] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _LINEAR:
            continue
        path = (module_path(node) or [""])[-1]
        if path not in plan:
            continue
        weight = node.args[1]
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target == f"{path}.weight"):
            raise _unplanned(path, "its linear op does not read the layer's own weight")
        if path in done:
            raise _unplanned(path, "the layer runs more than once in one forward")
        done.add(path)
        gm.add_submodule(path, model.get_submodule(path))
        with gm.graph.inserting_after(node):
            call = gm.graph.call_module(path, (node.args[0],))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):  # the stand-ins' weights, now unread
        if node.op == "get_attr" and not node.users and str(node.target).rpartition(".")[0] in plan:
            gm.graph.erase_node(node)
    leftover = [str(n.target) for n in gm.graph.nodes
                if n.op == "get_attr" and str(n.target).rpartition(".")[0] in plan]
    if leftover:
        raise _unplanned(leftover[0].rpartition(".")[0], "its weight is read outside the layer's own call")
    missing = [name for name in plan if name not in done]
    if missing:
        raise _unplanned(missing[0], "the trace has no linear op of it")
    gm.recompile()


def _unplanned(path: str, why: str) -> ParatrainError:
    return ParatrainError(
        f"tensor parallelism inside pipeline stages cannot shard {path}: {why}. A traced stage calls each planned "
        "layer once, as an nn.Linear; leave this layer out of setup(tp_plan=...), or use 'fsdp+tp' / 'ddp+tp' "
        "without a pipeline")
