"""Measure a real model, layer by layer, at the micro-batch sizes the layouts need.

Each layer runs alone on a detached copy of its input, timed by the pipelines' own layer timer
(`parallel.pipeline.balance.time_layers`, which their time balance reads too), forward and backward apart: a
pipeline schedules them apart. Times are the median
of a few repeats after a warm-up: `--validate` compares predictions with the median step of real runs,
and on a shared machine the fastest repeat is the exception (predicting from it biased every layout
low by 5-10% on the 2-core development machine). FLOPs are counted once with
`torch.utils.flop_counter`, the backward twice: gradients for the layer's input only, then for its
weights only, which gives the share a zero-bubble schedule defers. Activation bytes come from the
saved-tensor meter the pipelines report with (`parallel.pipeline.memory.ActivationMeter`).

The whole model is then timed as one step; what it costs beyond the sum of its layers (hooks,
Python, the loss glue) is kept as a per-call overhead, and one optimizer step is timed for its cost
per parameter. CPU measurements run on one thread, as every CPU worker does.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .._tree import map_tensors, nbytes
from ..parallel.pipeline.balance import LayerTimes, time_layers
from ..parallel.pipeline.memory import param_bytes
from ..parallel.pipeline.partition import layers_of
from ..precision import apply_autocast
from . import tensor_profile
from .costs import LayerCost, Profile

Batch = Callable[[int], tuple[Any, Any]]


def _grad_leaf(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.requires_grad_().clone() if t.is_floating_point() else t  # not a leaf: in-place layers may write it


def _float_outputs(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) if t.is_floating_point() and t.requires_grad else None, value)
    return found


def _inputs_of(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) if t.requires_grad else None, value)
    return found


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _call(module: nn.Module, x: Any) -> Any:
    return module(x)  # one positional input, as nn.Sequential hands it on and as `prepare` traces with


def _chain(modules: list[nn.Module], x: Any, y: Any, loss_fn: nn.Module, repeats: int) -> list[LayerTimes]:
    """Per layer, plus one more entry for the loss (`balance.time_layers`, the pipelines' own layer timer)."""
    return time_layers([*modules, lambda value: loss_fn(value, y)], x, repeats)


def _count(modules: list[nn.Module], x: Any, y: Any, loss_fn: nn.Module) -> list[tuple[float, float, float]]:
    """(forward, input-gradient, weight-gradient) FLOPs per layer, the loss folded into the last layer."""
    counts = []
    value = x
    for module in [*modules, None]:
        value = map_tensors(_grad_leaf, value)
        with FlopCounterMode(display=False) as fwd:
            out = _call(module, value) if module is not None else loss_fn(value, y)
        outs = _float_outputs(out)
        inputs = _inputs_of(value)
        weights = [p for p in (module.parameters() if module is not None else []) if p.requires_grad]
        with FlopCounterMode(display=False) as grad_in:
            if outs and inputs:
                torch.autograd.grad(outs, inputs, [torch.ones_like(t) for t in outs], retain_graph=True,
                                    allow_unused=True)
        with FlopCounterMode(display=False) as grad_w:
            if outs and weights:
                torch.autograd.grad(outs, weights, [torch.ones_like(t) for t in outs], allow_unused=True)
        counts.append((float(fwd.get_total_flops()), float(grad_in.get_total_flops()),
                       float(grad_w.get_total_flops())))
        value = map_tensors(lambda t: t.detach(), out)
    loss = counts.pop()
    last = counts[-1]
    counts[-1] = (last[0] + loss[0], last[1] + loss[1], last[2] + loss[2])
    return counts


def _whole_step(model: nn.Module, x: Any, y: Any, loss_fn: nn.Module, repeats: int, device: torch.device) -> float:
    times = []
    for rep in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        loss = loss_fn(_call(model, x), y)
        loss.backward()
        _sync(device)
        if rep > 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if name == "momentum" else 0.0)


def _optimizer_seconds(model: nn.Module, name: str, repeats: int, device: torch.device) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt = _optimizer(name, params)
    times = []
    for rep in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        if rep > 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model: nn.Module, batch: Batch, loss_fn: nn.Module, sizes: Sequence[int], *, name: str,
            precision: str = "32", optimizer: str = "adam", repeats: int = 5,
            device: torch.device | None = None, tp_plan: dict[str, str] | None = None) -> Profile:
    """The model's `Profile`, measured at every micro-batch size in `sizes` (one device, one thread on CPU);
    `tp_plan` as `setup(tp_plan=)` takes it (None: the plan tensor parallelism would find)."""
    device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
    sizes = sorted(set(int(s) for s in sizes))
    with _one_thread(device):
        x_small, y_small = batch(sizes[0])
        layers = layers_of(model, x_small)  # traced with the batch as its one positional input, as `prepare` does
        modules = [apply_autocast(m, precision, device.type) for _, m in layers]
        measured: dict[int, list[LayerTimes]] = {}
        for b in sizes:
            x, y = batch(b)
            measured[b] = _chain(modules, x, y, loss_fn, repeats)
        flops = _count(modules, x_small, y_small, loss_fn)
        split = tensor_profile.measure(model, x_small, [n for n, _ in layers], tp_plan)
        largest = sizes[-1]
        x, y = batch(largest)
        whole = _whole_step(apply_autocast(model, precision, device.type), x, y, loss_fn, repeats, device)
        opt = _optimizer_seconds(model, optimizer, repeats, device)
    median = statistics.median
    seconds_at = {b: [(median(t.forwards), median(t.backwards)) for t in measured[b]] for b in sizes}
    parts = sum(f + b for f, b in seconds_at[largest])
    costs = []
    for i, (layer_name, module) in enumerate(layers):
        fwd, grad_in, grad_w = (f / sizes[0] for f in flops[i])
        timing = measured[largest]
        seconds = {b: seconds_at[b][i] for b in sizes}
        activations = timing[i].activation_bytes
        if i == len(layers) - 1:  # the loss runs with the last layer (it is the last stage's work)
            seconds = {b: (s[0] + seconds_at[b][-1][0], s[1] + seconds_at[b][-1][1]) for b, s in seconds.items()}
            activations += timing[-1].activation_bytes
        tp = split.splits.get(layer_name, tensor_profile.Split())
        costs.append(LayerCost(
            name=layer_name, params=sum(p.numel() for p in module.parameters()), param_bytes=param_bytes(module),
            flops_fwd=fwd, flops_bwd=grad_in + grad_w,
            weight_share=grad_w / (grad_in + grad_w) if grad_in + grad_w else 0.5,
            activation_bytes=activations / largest, output_bytes=timing[i].output_bytes / largest, seconds=seconds,
            tp_share=min(1.0, tp.flops / fwd) if fwd else float(tp.touched), tp_params=tp.params,
            tp_forward_reduces=tuple(tp.forward), tp_backward_reduces=tuple(tp.backward),
        ))
    return Profile(
        name=name, layers=costs, sample_bytes=(nbytes(x) + nbytes(y)) / largest, source="measured",
        precision=precision, optimizer=optimizer, optimizer_s_per_param=opt / max(1, sum(c.params for c in costs)),
        step_overhead_s=max(0.0, whole - parts), tp_width=split.width, tp_note=split.note,
    )
