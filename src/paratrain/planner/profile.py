"""Measure a real model, layer by layer, at the micro-batch sizes the layouts need.

Each layer runs alone on a detached copy of its input, timed by the pipelines' own layer timer
(`parallel.pipeline.balance.time_layers`, which their time balance reads too), forward and backward apart: a
pipeline schedules them apart. Times are the median
of a few repeats after a warm-up: `--validate` compares predictions with the median step of real runs,
and on a shared machine the fastest repeat is the exception (predicting from it biased every layout
low by 5-10% on the 2-core development machine; read as the fastest, a `strategy="auto"` profile of the
`gpt` workload ranked pipelines first in 3 of 4 tries). The whole step, whose excess over the layers is the
model's own overhead, is its fastest repeat (`_whole_step`). FLOPs are counted with `torch.utils.flop_counter`: the
backward once over inputs and weights, and apart for the input and the weight gradients, which gives the
share a zero-bubble schedule defers. Activation bytes come from the saved-tensor meter the pipelines report
with (`parallel.pipeline.memory.ActivationMeter`), over the layers run as one chain (`_saved_in_chain`). A
weight two layers share (a tied embedding and head) is recorded on the later one (`shared_params`). What the expert
and context terms need (experts, their routing and load, attention calls and their keys' and values' bytes) is
seen in one more forward (`axis_profile`).

The whole model is then timed as one step; what it costs beyond the sum of its layers (hooks,
Python, the loss glue) is kept as a per-call overhead, and one optimizer step is timed for its cost
per parameter. On a GPU the whole step is timed at every size and the layers scaled to it where it is
shorter (`_overlapped`). CPU measurements run on one thread, as every CPU worker does.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .._tree import map_tensors, nbytes
from ..errors import ParatrainError
from ..measure.timing import best_seconds
from ..parallel.pipeline.balance import LayerTimes, time_layers
from ..parallel.pipeline.blocks import decoder_parts
from ..parallel.pipeline.memory import ActivationMeter, param_bytes
from ..parallel.pipeline.partition import layers_of
from ..precision import apply_autocast
from ..weights.build import all_meta, has_meta
from . import axis_profile, tensor_profile
from .costs import AxisFacts, LayerCost, Profile

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
    """(forward, input-gradient, weight-gradient) FLOPs per layer, the loss folded into the last layer; the two
    gradients add up to one backward over both."""
    counts = []
    value = x
    for module in [*modules, None]:
        value = map_tensors(_grad_leaf, value)
        with FlopCounterMode(display=False) as fwd:
            out = _call(module, value) if module is not None else loss_fn(value, y)
        outs = _float_outputs(out)
        inputs = _inputs_of(value)
        held = module.parameters() if module is not None else []
        weights: list[torch.Tensor] = [p for p in held if p.requires_grad]
        ones = [torch.ones_like(t) for t in outs]
        with FlopCounterMode(display=False) as both:
            if outs and inputs + weights:
                torch.autograd.grad(outs, inputs + weights, ones, retain_graph=True, allow_unused=True)
        with FlopCounterMode(display=False) as grad_in:
            if outs and inputs:
                torch.autograd.grad(outs, inputs, ones, retain_graph=True, allow_unused=True)
        with FlopCounterMode(display=False) as grad_w:
            if outs and weights:
                torch.autograd.grad(outs, weights, ones, allow_unused=True)
        # apart, the two passes each run the backward through a block's inner products (counted twice): the
        # backward is the one pass over both, split in the shares the two passes give
        total, apart = float(both.get_total_flops()), float(grad_in.get_total_flops() + grad_w.get_total_flops())
        scale = total / apart if apart else 0.0
        counts.append((float(fwd.get_total_flops()), float(grad_in.get_total_flops()) * scale,
                       float(grad_w.get_total_flops()) * scale))
        value = map_tensors(lambda t: t.detach(), out)
    loss = counts.pop()
    last = counts[-1]
    counts[-1] = (last[0] + loss[0], last[1] + loss[1], last[2] + loss[2])
    return counts


def _whole_step(model: nn.Module, x: Any, y: Any, loss_fn: nn.Module, repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` steps: a busy machine only ever slows a step down, and one slow step of three
    (a median's share) read as the model's own overhead added 0.24 s to every layout that runs the whole model
    (the 0.31 s GPT step of the `gpt` workload on 2 cores), enough to rank a pipeline above `ddp`."""
    return best_seconds(lambda: loss_fn(_call(model, x), y).backward(), device, repeats)


def _saved_in_chain(modules: list[nn.Module], x: Any, y: Any, loss_fn: nn.Module) -> list[int]:
    """Bytes each layer (and, last, the loss) saves for backward when the layers run as one chain: a storage is
    charged to the first layer saving it, so a tensor one layer saves as its output and the next as its input
    (a ReLU's result that a convolution keeps) counts once, as in the whole model. Timed alone on a copy of its
    input (`time_layers`), every layer keeps its own copy of that tensor."""
    meter = ActivationMeter(exclude=modules)
    value = x
    with meter.measure():
        for i, module in enumerate(modules):
            meter.owner = i
            value = _call(module, value)
        meter.owner = len(modules)
        loss = loss_fn(value, y)
    loss.backward()
    for module in modules:
        module.zero_grad(set_to_none=True)
    return [meter.owned_peak.get(i, 0) for i in range(len(modules) + 1)]


def _overlapped(layers: list[tuple[float, float]], whole: float) -> list[tuple[float, float]]:
    """Layer times scaled to the whole step where it is shorter than their sum. Each layer is timed alone with
    the device synchronised around it, so every timing pays the kernel launches' latency; in a step the host
    queues the next kernels while the device runs, and that latency hides (on an H200, GPT-2 small's layers
    summed to 1.4x its bf16 step, ResNet-50's to 1.5x). The scale keeps the layers' proportions, which is
    what stage balance and schedule simulation read."""
    parts = sum(f + b for f, b in layers)
    scale = min(1.0, whole / parts) if parts else 1.0
    return [(f * scale, b * scale) for f, b in layers]


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
    return best_seconds(opt.step, device, repeats)


def _loss(loss_fn: nn.Module, target: Any, value: Any) -> Any:
    return loss_fn(value, target)


def _one_at_a_time(layers: list[tuple[str, nn.Module]], batches: dict[int, tuple[Any, Any]], loss_fn: nn.Module,
                   repeats: int, real: Callable[[nn.Module], nn.Module], precision: str, device: torch.device,
                   optimizer: str) -> tuple[dict[int, list[LayerTimes]], float]:
    """A model built on the meta device, timed as `_chain` times a real one, each layer made real (`real`: its
    initial values, on `device`) for its own turn only, so the profile never holds more than one layer's weights.
    Also the optimizer's seconds per parameter, timed on the layer with the most."""
    values = {b: x for b, (x, _) in batches.items()}
    times: dict[int, list[LayerTimes]] = {b: [] for b in batches}
    rate, most = 0.0, 0
    for i, (_, module) in enumerate(layers):
        twin = apply_autocast(real(module), precision, device.type)
        for b, (_, y) in batches.items():
            timed: list[Callable[[Any], Any]] = [twin]
            if i == len(layers) - 1:
                timed.append(functools.partial(_loss, loss_fn, y))
            times[b] += time_layers(timed, values[b], repeats)
            with torch.no_grad():
                values[b] = _call(twin, values[b])
        trained = sum(p.numel() for p in twin.parameters() if p.requires_grad)
        if trained > most:
            most, rate = trained, _optimizer_seconds(twin, optimizer, repeats, device) / trained
        del twin
    return times, rate


def _attention_seconds(facts: axis_profile.Facts, batch: int, device: torch.device,
                       meta: bool) -> tuple[tuple[float, float], float]:
    """Per sample (forward, backward) seconds of one causal attention call, and the masked factor context
    parallelism pays (`axis_profile.time_attention`): timed only where context parallelism applies."""
    if facts.attention_call is None or not facts.position_ids or facts.context_refused or meta:
        return (0.0, 0.0), 1.0
    query, key, dtype = facts.attention_call
    try:
        return axis_profile.time_attention(query, key, dtype, batch, device)
    except RuntimeError as exc:  # a call whose shapes the stand-in cannot reproduce: no correction, said so
        facts.notes.append(f"attention not timed ({str(exc).splitlines()[0][:100]}): masked factor 1.0 assumed")
        return (0.0, 0.0), 1.0


def fresh_copy_seconds(nbytes: float, device: torch.device, repeats: int = 5) -> float:
    """Seconds per byte of a copy of `nbytes` into newly allocated memory (a clone), one thread: the tensors context
    parallelism makes around its gather of the outputs (`axes.logits_exchange`) are each of these. On CPU workers a
    large fresh tensor is page-faulted in on every step, which a copy into a reused buffer (the cluster's memory
    bandwidth) does not see."""
    elements = max(1, int(nbytes) // 4)
    source = torch.ones(elements, device=device)
    return best_seconds(source.clone, device, repeats) / (4 * elements)


def _axis_fields(facts: AxisFacts | None, attention: tuple[float, float]) -> dict[str, Any]:
    """A layer's expert and attention facts as `LayerCost` fields."""
    if facts is None:
        return {}
    return {**{f.name: getattr(facts, f.name) for f in fields(facts)}, "expert_share": min(1.0, facts.expert_share),
            "attention_s": (attention[0] * facts.attention_calls, attention[1] * facts.attention_calls)}


def measure(model: nn.Module, batch: Batch, loss_fn: nn.Module, sizes: Sequence[int], *, name: str,
            precision: str = "32", optimizer: str = "adam", repeats: int = 5,
            device: torch.device | None = None, tp_plan: dict[str, str] | None = None,
            real: Callable[[nn.Module], nn.Module] | None = None) -> Profile:
    """The model's `Profile`, measured at every micro-batch size in `sizes` (one device, one thread on CPU);
    `tp_plan` as `setup(tp_plan=)` takes it (None: the plan tensor parallelism would find). A model built on the
    meta device is traced and its FLOPs counted there, and each layer timed with `real(layer)`, a copy of it with
    storage and its initial values; its whole step is not run (no per-call overhead is measured)."""
    meta = has_meta(model)
    if meta and real is None:
        raise ParatrainError("the model is on the meta device and has no values to time; measure it through "
                             "run.prepare with strategy='auto', which makes each layer real in turn")
    device = device or next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    sizes = sorted(set(int(s) for s in sizes))
    largest = sizes[-1]
    with _one_thread(device):
        batches = {b: batch(b) for b in sizes}  # built once: every measurement below reads the same batches
        x_small, y_small = batches[sizes[0]]
        layers = layers_of(model, x_small)  # traced with the batch as its one positional input, as `prepare` does
        modules = [apply_autocast(m, precision, device.type) for _, m in layers]
        if meta:
            assert real is not None
            measured, opt_per_param = _one_at_a_time(layers, batches, loss_fn, repeats, real, precision, device,
                                                     optimizer)
            x_meta, y_meta = map_tensors(lambda t: t.to("meta"), (x_small, y_small))
            with all_meta(model):
                flops = _count(modules, x_meta, y_meta, loss_fn)
                split = tensor_profile.measure(model, x_meta, [n for n, _ in layers], tp_plan)
            saved = [t.activation_bytes for t in measured[largest]]  # each layer alone (a real chain is not built)
            wholes: dict[int, float] = {}
            with all_meta(model):
                facts = axis_profile.measure(model, x_meta, [n for n, _ in layers])
        else:
            measured = {b: _chain(modules, *batches[b], loss_fn, repeats) for b in sizes}
            flops = _count(modules, x_small, y_small, loss_fn)
            split = tensor_profile.measure(model, x_small, [n for n, _ in layers], tp_plan)
            stepped = apply_autocast(model, precision, device.type)
            wholes = {b: _whole_step(stepped, *batches[b], loss_fn, repeats, device)
                      for b in (sizes if device.type == "cuda" else [largest])}
            saved = _saved_in_chain(modules, *batches[largest], loss_fn)
            opt_seconds = _optimizer_seconds(model, optimizer, repeats, device)
            facts = axis_profile.measure(model, x_small, [n for n, _ in layers])
        attention, masked = _attention_seconds(facts, largest, device, meta)
        outputs = measured[largest][len(layers) - 1].output_bytes
        copy = fresh_copy_seconds(outputs, device, repeats) if facts.attention_call is not None and not meta else 0.0
    median = statistics.median
    seconds_at = {b: [(median(t.forwards), median(t.backwards)) for t in measured[b]] for b in sizes}
    if wholes and device.type == "cuda":  # see _overlapped
        seconds_at = {b: _overlapped(times, wholes[b]) for b, times in seconds_at.items()}
    parts = sum(f + b for f, b in seconds_at[largest])
    whole = wholes.get(largest, parts)
    costs = []
    seen: dict[int, str] = {}  # parameter -> the first layer holding it
    for i, (layer_name, module) in enumerate(layers):
        fwd, grad_in, grad_w = (f / sizes[0] for f in flops[i])
        timing = measured[largest]
        seconds = {b: seconds_at[b][i] for b in sizes}
        activations = saved[i]
        if i == len(layers) - 1:  # the loss runs with the last layer (it is the last stage's work)
            seconds = {b: (s[0] + seconds_at[b][-1][0], s[1] + seconds_at[b][-1][1]) for b, s in seconds.items()}
            activations += saved[-1]
        tp = split.splits.get(layer_name, tensor_profile.Split())
        tied = [(seen.setdefault(id(p), layer_name), p.numel()) for p in module.parameters()]
        tied = [(owner, n) for owner, n in tied if owner != layer_name]
        costs.append(LayerCost(
            name=layer_name, params=sum(p.numel() for p in module.parameters()), param_bytes=param_bytes(module),
            flops_fwd=fwd, flops_bwd=grad_in + grad_w,
            weight_share=grad_w / (grad_in + grad_w) if grad_in + grad_w else 0.5,
            activation_bytes=activations / largest, output_bytes=timing[i].output_bytes / largest, seconds=seconds,
            tp_share=min(1.0, tp.flops / fwd) if fwd else float(tp.touched), tp_params=tp.params,
            tp_forward_reduces=tuple(tp.forward), tp_backward_reduces=tuple(tp.backward),
            shared_params=sum(n for _, n in tied), shared_with=tuple(sorted({owner for owner, _ in tied})),
            **_axis_fields(facts.layers.get(layer_name), attention),
        ))
    profile = Profile(
        name=name, layers=costs, sample_bytes=nbytes(batches[largest]) / largest, source="measured",
        precision=precision, optimizer=optimizer, step_overhead_s=max(0.0, whole - parts), tp_width=split.width,
        tp_note=split.note, built="meta" if meta else "whole", top_k=facts.top_k, sequence=facts.sequence,
        position_ids=facts.position_ids, context_refused=facts.context_refused, masked_attention=masked,
        own_blocks=decoder_parts(model) is not None, sequential=isinstance(model, nn.Sequential),
        axes_note="; ".join(facts.notes) or None,
        loss_s=(seconds_at[largest][-1][0] / largest, seconds_at[largest][-1][1] / largest), copy_s_per_byte=copy,
    )
    # the step updated each distinct parameter once
    profile.optimizer_s_per_param = opt_per_param if meta else opt_seconds / max(1, profile.params)
    return profile
