"""Tracing a model that is not an nn.Sequential, so a pipeline can cut it between layers.

torch.export captures the model's forward as an aten graph with the batch dimension of every input
left symbolic (`Dim.AUTO`), so the graph runs at any batch size: a micro-batch, the short last batch
of an epoch, a validation batch. Training and evaluation are traced separately, because a graph fixes
`self.training`-dependent code (dropout, BatchNorm, `if self.training:` branches) at trace time; a
stage runs the graph of its current mode, so `model.eval()` reaches every piece.

A pipeline trains, so a Hugging Face model's key/value cache (`use_cache`, read from its config, True by
default) is no output of it: the model is traced with every config's `use_cache` off, and the pipeline's
output carries no cache (`past_key_values` None). The user's config is left as it was.

Every node keeps the module path it came from (`nn_module_stack`), which is how the cut points and the
report use the user's own names (`blocks.0` ... `blocks.3`) and how dropout layers are keyed.
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ... import _forwards
from ...errors import ParatrainError


@dataclass
class Traced:
    """The two graphs of one model (same parameters), and how the user's input and output flatten."""

    train: fx.GraphModule
    eval: fx.GraphModule
    in_spec: Any
    out_spec: Any


def _dynamic_batch(value: Any) -> Any:
    """A dynamic_shapes entry marking dim 0 of every tensor dynamic, mirroring the value's structure."""
    from torch.export import Dim

    if isinstance(value, torch.Tensor):
        return {0: Dim.AUTO} if value.dim() else None
    if isinstance(value, dict):
        return {k: _dynamic_batch(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_dynamic_batch(v) for v in value)
    return None


def dynamic_shapes(model: nn.Module, example: Any) -> tuple[Any, ...]:
    """torch.export's dynamic_shapes for `model(example)`: one entry for the argument, nested one level deeper when
    the forward takes `*args` (a wrapper such as peft's PeftModel), as torch.export matches them."""
    spec = _dynamic_batch(example)
    params = list(inspect.signature(model.forward).parameters.values())
    return ((spec,),) if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL else (spec,)


def _widen(value: Any) -> Any:
    """An example of at least 2 rows: torch.export fixes a dimension of size 1 (or 0) to that size."""
    if isinstance(value, torch.Tensor):
        return torch.cat([value, value]) if value.dim() and value.shape[0] < 2 else value
    if isinstance(value, dict):
        return {k: _widen(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_widen(v) for v in value)
    return value


@contextmanager
def _plain_modules(model: nn.Module, training: bool) -> Iterator[None]:
    """The model in `training` mode with its own forwards (paratrain's layout-independent dropout is put
    back into the graph afterwards, not traced through), restored on exit."""
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        with _forwards.own_forwards(m for m in model.modules() if m is not model):
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode


@contextmanager
def _no_cache(model: nn.Module) -> Iterator[None]:
    """Every Hugging Face config the model's modules hold with `use_cache` off, restored on exit: their
    forwards read it from the config, and a cache object is no value a pipeline stage can pass on."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None):
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def exported(model: nn.Module, example: Any, training: bool) -> Any:
    """torch.export's program of `model(example)` in `training` mode, as a pipeline traces it."""
    from torch.export import export

    with _plain_modules(model, training), _no_cache(model):
        return export(model, (example,), dynamic_shapes=dynamic_shapes(model, example), strict=False)


_LEAKED = "fake tensor in the exported program constant"
"""torch.export's report of a fake tensor among a graph's constants: seen on one of two ranks tracing the same
model (a Hugging Face mixture of experts' `lifted_tensor_0`), in some runs of the suite and more often on a busy
machine, never twice in a row in those runs; the trace is tried again, after a collection, before the model is
refused."""
_TRIES = 3


def _export(model: nn.Module, example: Any, training: bool) -> fx.GraphModule:
    for attempt in range(_TRIES):
        try:
            return exported(model, example, training).module()  # type: ignore[no-any-return]
        except RuntimeError as exc:
            if _LEAKED not in str(exc) or attempt == _TRIES - 1:
                raise
        gc.collect()  # what the leaked constant came from
    raise AssertionError("unreachable")


def trace(model: nn.Module, example: Any) -> Traced:
    """Both graphs of `model` for inputs shaped like `example` (one positional argument), any batch size."""
    name = type(model).__name__
    if hasattr(model, "_orig_mod") and hasattr(model, "_torchdynamo_orig_callable"):
        raise ParatrainError(
            f"the model was torch.compile'd before run.prepare ({name} of "
            f"{type(model._orig_mod).__name__}), and a pipeline cuts the model itself into stages; pass the "
            "model before torch.compile and set setup(compile=True), which compiles each layer of each stage")
    example = _widen(example)
    try:
        train = _export(model, example, training=True)
        evaluation = _export(model, example, training=False)
    except Exception as exc:
        raise untraceable(model, exc) from exc
    info = train.graph._codegen.pytree_info  # type: ignore[attr-defined]
    return Traced(train=train, eval=evaluation, in_spec=info.in_spec, out_spec=info.out_spec)


def untraceable(model: nn.Module, exc: BaseException) -> ParatrainError:
    """The refusal for a model torch.export could not trace: torch's reason, the module of the model whose code
    raised it and that line, and the fix (for a Hugging Face mixture of experts left on the library's looping
    "eager" experts, the library's grouped implementations, which have no data-dependent loop)."""
    name = type(model).__name__
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    looping = _looping_experts(model)
    if looping is None:
        fix = ("Make that forward traceable (no data-dependent Python control flow), or write the model as an "
               "nn.Sequential of its layers, or use a data-parallel strategy (ddp, fsdp)")
    else:
        owner = f"{name}.{looping}" if looping else name
        fix = (f"Its experts run experts_implementation 'eager', a Python loop over the experts the routing picked, "
               f"which no graph can hold: call set_experts_implementation('grouped_mm') (the library's default) or "
               f"('batched_mm') on {owner}, or pass experts_implementation='grouped_mm' to from_pretrained; they "
               "compute the same without the loop. Or use a data-parallel strategy (ddp, fsdp)")
    return ParatrainError(f"{name} cannot be traced to be split into pipeline stages (torch.export: "
                          f"{type(exc).__name__}: {first[:300]}){_culprit(model, exc)}. {fix}")


def _culprit(model: nn.Module, exc: BaseException) -> str:
    """` in NAME.path (Type) at file:line` for the innermost frame of the error that ran a module of `model`."""
    names = {id(m): path for path, m in model.named_modules()}
    found = ""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:  # the error and what caused it, innermost frames last
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                code = tb.tb_frame.f_code
                path = names[id(owner)]
                found = (f" in {type(model).__name__}{'.' + path if path else ''} ({type(owner).__name__}) at "
                         f"{code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}")
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    return found


def _looping_experts(model: nn.Module) -> str | None:
    """The path of a Hugging Face model inside `model` whose experts run the library's "eager" loop, if any."""
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        if (getattr(config, "_experts_implementation", None) == "eager"
                and callable(getattr(module, "set_experts_implementation", None))):
            return path
    return None


def module_path(node: fx.Node) -> list[str]:
    """The module paths a node ran inside, outermost first ("" is the model itself)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values()]


def module_types(node: fx.Node) -> list[Any]:
    stack = node.meta.get("nn_module_stack") or {}
    return [kind for _, kind in stack.values()]
