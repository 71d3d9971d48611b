"""Split a model into K pipeline stages of consecutive layers.

An `nn.Sequential` is split between its children. Any other model is traced (`tracing`) and cut before
each of its layers (`graph_split`): top-level children and the items of containers of blocks, in the
model's own names, with any number of values (dicts, tuples, skip connections) crossing each cut.

Every layer takes one value and returns one: a Sequential child its input, the first traced segment
the model's input, later segments a tuple of the values crossing the cut. A `Stage` runs its layers in
order and registers the user's modules under their paths in the original model, so a stage's
state_dict keys are the unsplit model's keys for what it holds: checkpoints and weight comparisons line
up with the single-process model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..._tree import map_tensors
from ...errors import ParatrainError
from .. import batchnorm, randomness, step_state
from ..batchnorm import defer_modules
from ..microbatch import batch_size
from ..options import example_needed
from .graph_split import GraphSegment, traced_segments

Layer = tuple[str, nn.Module]


class Stage(nn.Module):
    """Consecutive layers run in order, each on the previous one's output."""

    def __init__(self, layers: Sequence[Layer], index: int = 0) -> None:
        super().__init__()
        self.index = index
        self.layer_names = [name for name, _ in layers]
        self._chain = [module for _, module in layers]  # a plain list: registration happens below, by name
        for name, module in layers:
            _register(self, name, module)
        self.inputs_spec: Any = None
        """Set on a first stage that receives its input as flat tensors (a multi-process pipeline sends
        tensors only): the input's structure, rebuilt before the first layer."""
        self.outputs_spec: Any = None
        """Set (to a placeholder) on a last stage that must return tensors only: the output's structure,
        recorded at each forward so the loss and the caller get the output as the model returns it."""
        self.sends = False
        """Set on a stage whose outputs a multi-process pipeline sends: they must be contiguous."""
        self.row_cursor: int | None = None
        """Set by a pipeline whose schedule runs this stage's micro-batches in order: the next one's first
        row within the step's batch, so dropout masks follow the rows wherever they run."""
        self.micro_rows: int | None = None
        """Set with `row_cursor`: the rows of each micro-batch, which the activation a later stage receives need not
        hold along its dim 0 (a sequence-first model's (t, b, h))."""

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Stage:
        super()._apply(fn, *args, **kwargs)
        self.repoint()
        return self

    def repoint(self) -> None:
        """A traced segment reads tensors through its graphs: after they were moved or made real, point them anew."""
        for module in self._chain:
            if isinstance(module, GraphSegment):
                module.repoint()

    def train(self, mode: bool = True) -> Stage:
        super().train(mode)
        for module in self._chain:  # traced segments are not registered children (their modules are)
            module.train(mode)
        return self

    def forward(self, *args: Any) -> Any:
        # A received activation is a leaf that requires grad; an in-place first layer (ReLU(inplace=True))
        # may not modify a leaf, but may modify a copy, and gradients flow through the copy unchanged.
        args = tuple(_received(a) if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a
                     for a in args)
        if self.inputs_spec is not None:
            out = pytree.tree_unflatten(list(args), self.inputs_spec)
        else:
            out = args[0] if len(args) == 1 else args
        rows = randomness.rows_offset(self.row_cursor) if self.row_cursor is not None else nullcontext()
        micro = self.micro_rows if self.micro_rows is not None else batch_size(out)
        calls = step_state.active().random_calls
        if calls is not None:  # a layer's draws place their samples against this micro-batch (`random_calls`)
            calls.rows = micro
        with rows:
            if self.row_cursor is not None:
                self.row_cursor += micro
            for module in self._chain:
                out = module(out)
        if self.outputs_spec is not None:
            leaves, self.outputs_spec = pytree.tree_flatten(out)
            return tuple(map_tensors(_own_storage, leaves))
        if self.sends:
            out = map_tensors(_own_storage, out)
            if self.training and torch.is_grad_enabled():
                out = map_tensors(_differentiable, out)
        return out

    @contextmanager
    def unobserved(self) -> Iterator[None]:
        """A forward torch runs only to learn shapes (a pipeline's metadata inference) leaves no trace here:
        the row cursor, the dropout call counts and BatchNorm's collected statistics are put back."""
        cursor, calls, pending = self.row_cursor, randomness.snapshot(), batchnorm.snapshot()
        try:
            yield
        finally:
            self.row_cursor = cursor
            randomness.restore(calls)
            batchnorm.restore(pending)

    def rebuild(self, leaves: Any) -> Any:
        """The output as the model returns it, from what a flattening last stage returned."""
        flat = list(leaves) if isinstance(leaves, list | tuple) else [leaves]
        return pytree.tree_unflatten(flat, self.outputs_spec)


def _differentiable(t: torch.Tensor) -> torch.Tensor:
    """A sent floating value that needs no gradient (every parameter before it frozen, e.g. fine-tuning with the
    embeddings frozen) is sent as one that does: the next stage then receives it requiring grad, which torch's
    split backward (zero-bubble) needs to compute that stage's weight gradients; without it they stay empty."""
    if t.is_floating_point() and not t.requires_grad:
        return t.detach().requires_grad_(True)
    return t


def _received(t: torch.Tensor) -> torch.Tensor:
    """A copy of a received activation to compute on. Its gradient goes back over the wire, and gloo sends
    contiguous tensors only; the backward of a layer may leave a strided one (torch.cat's backward gives
    column slices), so it is made contiguous as it is computed. The hook goes on once per tensor: a recv
    buffer is reused step after step."""
    if not getattr(t, "_paratrain_contiguous_grad", False):
        t.register_hook(lambda g: g if g.is_contiguous() else g.contiguous())
        t._paratrain_contiguous_grad = True  # type: ignore[attr-defined]
    return t.clone()


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor a pipeline may send and detach in place: contiguous, and not a view of another."""
    return t.clone(memory_format=torch.contiguous_format) if t._is_view() or not t.is_contiguous() else t


def _register(owner: nn.Module, name: str, module: nn.Module) -> None:
    if isinstance(module, GraphSegment) or getattr(module, "holds_paths", False):  # the user's modules it holds,
        # under their paths (a traced segment, or a block of a decoder's own chain: `blocks`)
        for child_name, child in module.named_children():
            if child_name not in owner._modules:
                owner.add_module(child_name, child)
            else:
                _merge(owner._modules[child_name], child)  # type: ignore[arg-type]
        for pname, param in module.named_parameters(recurse=False):
            owner.register_parameter(pname, param)
        for bname, buf in module.named_buffers(recurse=False):
            owner.register_buffer(bname, buf)
    else:
        owner.add_module(name, module)


def _merge(into: nn.Module, other: nn.Module) -> None:
    """Two segments may both hold parents of the same path (`blocks` for blocks.0 and blocks.1)."""
    if into is other:
        return
    for name, param in other._parameters.items():
        if name not in into._parameters and param is not None:
            into.register_parameter(name, param)
    for name, buf in other._buffers.items():
        if name not in into._buffers and buf is not None:
            into.register_buffer(name, buf, persistent=name not in other._non_persistent_buffers_set)
    for name, child in other.named_children():
        if name not in into._modules:
            into.add_module(name, child)
        else:
            _merge(into._modules[name], child)  # type: ignore[arg-type]


def merged(stages: Sequence[Stage]) -> nn.Module:
    """One module holding the layers of several stages under their original names (for state dicts)."""
    holder = nn.Module()
    for stage in stages:
        for name, module in zip(stage.layer_names, stage._chain):
            _register(holder, name, module)
    return holder


def layers_of(model: nn.Module, example: Any = None, defer_batchnorm: bool = False,
              tp_plan: dict[str, str] | None = None, own_blocks: bool = False, share: Any = None) -> list[Layer]:
    """The model as a chain of named layers: a Sequential's children, or the segments of a traced model
    (cut before each layer; `example` is one input batch to trace with). `defer_batchnorm` makes BatchNorm
    layers update running statistics once per step (see `batchnorm`). `tp_plan` names the layers already
    sharded by tensor parallelism, which a traced segment calls as themselves (`tensor.traced`). `own_blocks`
    (expert or context parallelism inside the stages, `share` the latter's) makes the chain of a decoder's own
    blocks instead of a trace (`blocks`); an nn.Sequential's children are its own blocks already, which expert
    parallelism lives in as they are and context parallelism with the positions crossing the cuts."""
    if own_blocks and not (isinstance(model, nn.Sequential) and share is None):
        from .blocks import decoder_layers, sequential_layers

        return sequential_layers(model, share) if isinstance(model, nn.Sequential) else decoder_layers(model, share)
    if isinstance(model, nn.Sequential):
        if defer_batchnorm:
            defer_modules(model)
        layers = list(model.named_children())
        if not layers:
            raise ParatrainError("the nn.Sequential has no layers to split into pipeline stages")
        return layers
    if example is None:
        raise example_needed(type(model).__name__, "not an nn.Sequential, so it is traced to be split")
    from ...weights.build import all_meta
    from .tracing import trace

    with all_meta(model) as meta:  # a model built on the meta device is traced there, real buffers and all
        where = torch.device("meta") if meta else next((p.device for p in model.parameters()), None)
        if where is not None:  # trace where the weights are (stages are placed on their devices afterwards)
            from ..._tree import map_tensors

            example = map_tensors(lambda t: t.to(where), example)
        if not tp_plan:
            return traced_segments(model, trace(model, example), defer_batchnorm)
        from ..tensor.traced import call_layers, local_layers

        with local_layers(model, tp_plan):
            traced = trace(model, example)
    for gm in (traced.train, traced.eval):
        call_layers(gm, model, tp_plan)
    return traced_segments(model, traced, defer_batchnorm)


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
