"""Split a model into K pipeline stages of consecutive layers.

An `nn.Sequential` is split by its children. Any other model is traced by torch.distributed.pipelining's
front end with a split point before every top-level child, which yields a chain of graph modules that
still own the original parameter objects (so an optimizer built on the user's model keeps working).

A `Stage` registers each layer under its name in the original model, so a stage's state_dict keys are
the unsplit model's keys for the layers it holds: checkpoints and weight comparisons line up with the
single-process model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ParatrainError
from .options import example_needed

Layer = tuple[str, nn.Module]


class Stage(nn.Module):
    """Consecutive layers run in order; the first gets the stage's inputs, each next one the previous output."""

    def __init__(self, layers: Sequence[Layer], index: int = 0) -> None:
        super().__init__()
        self.index = index
        self.layer_names = [name for name, _ in layers]
        self._chain = [module for _, module in layers]  # a plain list: registration happens below, by name
        for name, module in layers:
            _register(self, name, module)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Stage:
        super()._apply(fn, *args, **kwargs)
        for module in self._chain:  # a traced piece's own buffers are not registered here; move them too
            if isinstance(module, torch.fx.GraphModule):
                module._apply(fn, *args, **kwargs)
        return self

    def forward(self, *args: Any) -> Any:
        # A received activation is a leaf that requires grad; an in-place first layer (ReLU(inplace=True))
        # may not modify a leaf, but may modify a copy, and gradients flow through the copy unchanged.
        args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a
                     for a in args)
        out = self._chain[0](*args)
        for module in self._chain[1:]:
            out = module(out)
        return out


def _register(owner: nn.Module, name: str, module: nn.Module) -> None:
    if isinstance(module, torch.fx.GraphModule):  # traced piece: its children carry the original names
        for child_name, child in module.named_children():
            owner.add_module(child_name, child)
        for pname, param in module.named_parameters(recurse=False):
            owner.register_parameter(pname, param)
        for bname, buf in module.named_buffers(recurse=False):
            owner.register_buffer(bname, buf)
    else:
        owner.add_module(name, module)


def merged(stages: Sequence[Stage]) -> nn.Module:
    """One module holding the layers of several stages under their original names (for state dicts)."""
    holder = nn.Module()
    for stage in stages:
        for name, module in zip(stage.layer_names, stage._chain):
            _register(holder, name, module)
    return holder


def layers_of(model: nn.Module, example: tuple[Any, ...] | None = None) -> list[Layer]:
    """The model as a chain of named layers: a Sequential's children, or a traced split of any other model."""
    if isinstance(model, nn.Sequential):
        layers = list(model.named_children())
        if not layers:
            raise ParatrainError("the nn.Sequential has no layers to split into pipeline stages")
        return layers
    if example is None:
        raise example_needed(type(model).__name__, "not an nn.Sequential, so it is traced to be split")
    return _trace(model, example)


def _trace(model: nn.Module, example: tuple[Any, ...]) -> list[Layer]:
    from torch.distributed.pipelining import SplitPoint, pipeline

    names = [name for name, _ in model.named_children()]
    if len(names) < 2:
        raise ParatrainError(
            f"{type(model).__name__} has {len(names)} top-level child module(s); a split needs at least 2. "
            "Express the model as an nn.Sequential of its layers"
        )
    spec = {name: SplitPoint.BEGINNING for name in names[1:]}
    where = next((p.device for p in model.parameters()), None)
    if where is not None:  # trace where the weights are (stages are placed on their devices afterwards)
        example = tuple(x.to(where) if isinstance(x, torch.Tensor) else x for x in example)
    try:
        pipe = pipeline(model, mb_args=example, split_spec=spec)
    except Exception as exc:
        raise ParatrainError(
            f"torch.distributed.pipelining could not trace {type(model).__name__} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); express the model as an nn.Sequential"
        ) from exc
    _check_chain(pipe, type(model).__name__)
    layers = []
    for i in range(pipe.num_stages):
        module = pipe.get_stage_module(i)
        for part in module.modules():  # run the generated code, not torch.fx's node-by-node interpreter
            if getattr(part, "_run_with_interpreter", False):
                object.__setattr__(part, "_run_with_interpreter", False)
        children = [n for n, _ in module.named_children()]
        layers.append((",".join(children) or f"part{i}", module))
    return layers


def _check_chain(pipe: Any, model_name: str) -> None:
    """Stages must pass one value each to the next (no skip connections across top-level children)."""
    prev = None
    for node in pipe.split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        if prev is not None and (len(node.args) != 1 or node.args[0] is not prev or node.kwargs):
            raise ParatrainError(
                f"{model_name}'s top-level children do not form a chain (a value skips over a child at "
                f"{node.target}); wrap the skipping blocks into one child module, or use an nn.Sequential"
            )
        prev = node


def equal_balance(layers: int, stages: int) -> list[int]:
    """Layers per stage as even as possible, larger stages first (torchgpipe's naive split)."""
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def check_balance(balance: Sequence[int], layers: int, stages: int) -> list[int]:
    balance = [int(b) for b in balance]
    if len(balance) != stages or sum(balance) != layers or min(balance) < 1:
        raise ParatrainError(
            f"balance {balance} must give each of the {stages} stages at least one layer and sum to the "
            f"model's {layers} layers (it has {len(balance)} entries summing to {sum(balance)}); e.g. "
            f"balance={equal_balance(layers, stages) if layers >= stages else '[...]'} or balance='time'"
        )
    return balance


def split_into_stages(layers: Sequence[Layer], balance: Sequence[int]) -> list[Stage]:
    """Consecutive runs of `balance[i]` layers, one `Stage` each."""
    balance = check_balance(balance, len(layers), len(balance))
    stages, start = [], 0
    for index, count in enumerate(balance):
        stages.append(Stage(layers[start : start + count], index))
        start += count
    return stages


def too_few_layers(layers: int, stages: int) -> ParatrainError:
    return ParatrainError(
        f"the model has {layers} layer(s) but {stages} pipeline stages were asked for; use at most "
        f"{layers} stages (fewer devices/workers, or stages_per_worker=1) or a model with more layers"
    )
