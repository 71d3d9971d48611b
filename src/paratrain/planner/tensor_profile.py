"""What tensor parallelism would split in a model, per layer of the chain the planner sees.

The plan is the one `setup(strategy="...tp...")` would use (`parallel.tensor.plan.find_plan`: the user's, the
model's declared one, or its structure). One eager forward of the whole model, with the planned Linears and the
chain's layers reporting as they run (their forwards wrapped through `_forwards` for that one call), records per
layer:

- the FLOPs that run between a column-split Linear's input and its row-split partner's output (the Linears
  themselves, attention over the heads, the MLP's activation): each tensor rank runs a 1/tp share of them;
- the parameters of the planned Linears (a row-split Linear's bias stays whole);
- one all-reduce of the row-split output per forward, one of the column-split input's gradient per backward
  (torch's ColwiseParallel turns its replicated input's gradient from partial sums into a sum per module).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .. import _forwards
from .._tree import nbytes, tensors_in
from ..errors import ParatrainError
from ..parallel.tensor.plan import FUSED, is_parameter, owner_of

SPLITS_OUTPUT = frozenset({"colwise", "packed_colwise", "colwise_gather_output", FUSED})
"""Plan styles whose layer splits its output features (a split region starts there)."""


@dataclass
class Split:
    """One layer's tensor-parallel part, per sample."""

    flops: float = 0.0
    touched: bool = False
    """Some op of this layer ran inside a split region (a layer of no FLOPs, e.g. the ReLU between a pair)."""
    params: int = 0
    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)


@dataclass
class Found:
    splits: dict[str, Split]
    width: int
    """gcd of the split dimensions (0: no plan)."""
    note: str


class _Region:
    def __init__(self, layers: list[str]) -> None:
        self.splits = {name: Split() for name in layers}
        self.current = layers[0]
        self.open = 0


class _Counter(TorchDispatchMode):
    """Counts FLOPs (torch's formulas) of the ops run while a split region is open, for the current layer."""

    def __init__(self, region: _Region) -> None:
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.region.open:
            split = self.region.splits[self.region.current]
            split.touched = True
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                split.flops += float(formula(*args, **(kwargs or {}), out_val=out))
        return out


def _watch(module: nn.Module, before: Callable[[Any], None], after: Callable[[Any], None] | None = None) -> None:
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        before(args)
        out = inner(*args, **kwargs)
        if after is not None:
            after(out)
        return out

    _forwards.replace(module, forward, "the planner's tensor-parallel profile (one forward)")


@contextmanager
def _watching(model: nn.Module, plan: dict[str, str], layers: list[str], region: _Region,
              batch: int) -> Iterator[None]:
    """The planned Linears and the chain's layers report as they run (layers outermost: a layer that is itself
    a planned Linear is entered before its split is counted)."""
    watched: list[nn.Module] = []

    def column(module: nn.Module) -> Callable[[Any], None]:
        def before(args: Any) -> None:
            split = region.splits[region.current]
            split.params += sum(p.numel() for p in module.parameters())
            split.backward.append(nbytes(args) / batch)
            region.open += 1
        return before

    def closing(out: Any) -> None:  # a row-split output: summed over the ranks
        region.splits[region.current].forward.append(nbytes(out) / batch)
        region.open = max(0, region.open - 1)

    def row(module: nn.Module) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
        weight = module.weight
        assert isinstance(weight, torch.Tensor)

        def before(args: Any) -> None:
            region.splits[region.current].params += weight.numel()  # its bias stays whole

        return before, closing

    def enter(name: str) -> Callable[[Any], None]:
        def before(args: Any) -> None:
            region.current = name
        return before

    try:
        for name, style in plan.items():
            if owner_of(plan, name) is not None or is_parameter(model, name) or style == "partial_grad":
                continue  # an expert weight (counted with its experts), a module's own weight, a whole layer
            module = model.get_submodule(name)
            if isinstance(module, nn.Embedding):
                continue  # a head-indexed table (T5's position bias): no matrix product to split
            if style == "experts":  # both halves in one module: its FLOPs split, its output summed
                _watch(module, column(module), closing)
            elif style in SPLITS_OUTPUT:
                _watch(module, column(module))
            else:
                _watch(module, *row(module))
            watched.append(module)
        for name in layers:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                continue  # a traced segment named after no module: its ops count for the layer before it
            _watch(module, enter(name))
            watched.append(module)
        yield
    finally:
        for module in reversed(watched):
            _forwards.restore(module)


def measure(model: nn.Module, example: Any, layers: list[str], user_plan: dict[str, str] | None) -> Found:
    """Each layer's split part, from one forward on `example` (its first dimension is the batch)."""
    from ..parallel.tensor.plan import check_plan, find_plan
    from ..parallel.tensor.styles import in_features, out_features

    try:
        plan, source = find_plan(model, user_plan)
        check_plan(model, plan, 1)
    except ParatrainError as exc:
        return Found({}, 0, f"no tensor-parallel layouts: {exc}")
    fused = [name for name, style in plan.items() if style == FUSED]
    if fused:  # packed or interleaved, or neither: only the check on a process group can say (`parallel.tensor.check`)
        return Found({}, 0, f"no tensor-parallel layouts: {fused[0]} is a fused projection, which prepare shards only "
                            "where its check on the example batch finds the layout; name it in setup(tp_plan=...) "
                            "as 'packed_colwise' or 'colwise' for the planner to count it")
    sizes = [out_features(m) if style in SPLITS_OUTPUT else in_features(m)
             for name, style in plan.items() if style not in ("experts", "partial_grad")
             and owner_of(plan, name) is None and not is_parameter(model, name)
             for m in [model.get_submodule(name)] if not isinstance(m, nn.Embedding)]
    batch = next(t.shape[0] for t in tensors_in(example) if t.dim() > 0)
    region = _Region(layers)
    with torch.no_grad(), _watching(model, plan, layers, region, batch), _Counter(region):
        model(example)  # one positional input, as `prepare` traces with
    for split in region.splits.values():
        split.flops /= batch
    return Found(region.splits, math.gcd(*sizes) if sizes else 0, f"plan from {source}")
