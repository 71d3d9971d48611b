"""Choose how many layers each stage gets, from measurements.

Like torchgpipe's `balance_by_time`: run a sample batch through the layers one at a time, timing each
layer's forward plus backward, and measure its parameters and saved activations. A pipeline runs at
the pace of its slowest stage, so the balance minimises the largest per-stage sum (an exact dynamic
program over contiguous splits, not a greedy cut). "memory" balances parameter plus activation bytes
instead; "equal" is the naive split by layer count.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..._tree import nbytes
from ...errors import ParatrainError, unknown_name
from ..trial import no_trace, synchronize
from .memory import ActivationMeter, param_bytes
from .partition import Layer, check_balance, equal_balance, too_few_layers

MODES = ("time", "memory", "equal")


@dataclass
class LayerCost:
    name: str
    seconds: float
    """Forward + backward time of the sample through this layer (fastest of the repeats: noise only adds)."""
    params_bytes: int
    activation_bytes: int
    """Bytes this layer saves for backward for the sample."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _float_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.requires_grad else []
    if isinstance(value, list | tuple):
        return [t for v in value for t in _float_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _float_tensors(v)]
    return []


def _detached(value: Any, device: torch.device | None) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().to(device) if device is not None else value.detach()
        if not value.is_floating_point():
            return value
        return value.requires_grad_().clone()  # not a leaf: a layer may work in place (ReLU(inplace=True))
    if isinstance(value, list | tuple):
        return type(value)(_detached(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v, device) for k, v in value.items()}
    return value


def _device_of(module: nn.Module) -> torch.device | None:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return None


@dataclass
class LayerTimes:
    """One layer's forward and backward seconds over the timed repeats, its saved-activation peak and output size."""

    forwards: list[float] = field(default_factory=list)
    backwards: list[float] = field(default_factory=list)
    activation_bytes: int = 0
    output_bytes: int = 0


def time_layers(layers: Sequence[Callable[[Any], Any]], sample: Any, repeats: int) -> list[LayerTimes]:
    """Each layer alone on a detached copy of the previous one's output (`sample` is the first one's input), its
    forward and its backward timed apart, `repeats` times after one warm-up pass; a layer runs where its
    parameters are. The one layer timer: the pipelines' balance and the planner's profile both read it."""
    modules = [m for m in layers if isinstance(m, nn.Module)]
    devices = [d for d in map(_device_of, modules) if d is not None]
    out = [LayerTimes() for _ in layers]
    for rep in range(repeats + 1):
        x = sample
        for i, layer in enumerate(layers):
            x = _detached(x, _device_of(layer) if isinstance(layer, nn.Module) else None)
            meter = ActivationMeter(exclude=[layer] if isinstance(layer, nn.Module) else [])
            synchronize(devices)
            start = time.perf_counter()
            with meter.measure():
                y = layer(x)
            synchronize(devices)
            middle = time.perf_counter()
            outs = _float_tensors(y)
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            synchronize(devices)
            if rep > 0:  # the first pass warms up allocators and kernels
                out[i].forwards.append(middle - start)
                out[i].backwards.append(time.perf_counter() - middle)
            out[i].activation_bytes = max(out[i].activation_bytes, meter.peak)
            out[i].output_bytes = nbytes(y)
            x = y
    return out


def profile_layers(layers: Sequence[Layer], sample: Any, repeats: int = 3) -> list[LayerCost]:
    """Per-layer forward+backward seconds (fastest of `repeats` after a warm-up), parameter and
    activation bytes: `sample` is the first layer's input, each layer gets the previous one's output.
    The model is left exactly as found."""
    modules = [m for _, m in layers]
    with no_trace(modules):
        times = time_layers(modules, sample, repeats)
    return [LayerCost(name, min(f + b for f, b in zip(t.forwards, t.backwards)), param_bytes(m), t.activation_bytes)
            for (name, m), t in zip(layers, times)]


def solve(costs: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of `costs` into `stages` non-empty parts minimising the largest part's sum.

    Ties go to the split whose parts are most even in count, so equal costs give the equal split.
    Cached by its inputs: the planner solves the same split for every layout that cuts one pipeline.
    """
    return list(_solve(tuple(costs), stages))


@functools.lru_cache(maxsize=4096)
def _solve(costs: tuple[float, ...], stages: int) -> tuple[int, ...]:
    n = len(costs)
    if n < stages:
        raise too_few_layers(n, stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: (largest part, spread of part sizes) splitting the first i costs into k parts
    best = [[(inf, inf)] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    ideal = n / stages
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev[0] == inf:
                    continue
                cand = (max(prev[0], prefix[i] - prefix[j]), prev[1] + (i - j - ideal) ** 2)
                if cand[0] < best[k][i][0] * (1 - 1e-9) or (
                        cand[0] <= best[k][i][0] * (1 + 1e-9) and cand[1] < best[k][i][1]):
                    best[k][i], cut[k][i] = cand, j
    balance, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return tuple(balance[::-1])


def stage_sums(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    out, start = [], 0
    for count in balance:
        out.append(float(sum(costs[start : start + count])))
        start += count
    return out


def _names(layers: Sequence[Layer]) -> str:
    return ", ".join(name for name, _ in layers)


def cut_by_name(points: Sequence[str], layers: Sequence[Layer], stages: int) -> list[int]:
    """Layers per stage when each name in `points` starts a stage: the first layer that is that module or lies
    inside it (a traced model's layers are named `layer3.0`, `layer3.1`, ...)."""
    if len(points) + 1 != stages:
        raise ParatrainError(f"split_points {list(points)} make {len(points) + 1} stages, but there are {stages}")
    names = [name for name, _ in layers]
    starts = [0]
    for point in points:
        at = next((i for i, name in enumerate(names) if name == point or name.startswith(f"{point}.")), None)
        if at is None:
            raise ParatrainError(f"split_points: no layer is named {point!r} or lies inside it; the model's "
                                 f"{len(names)} layers: {_names(layers)}")
        if at <= starts[-1]:
            raise ParatrainError(f"split_points {list(points)}: {point!r} (layer {at}, {names[at]}) does not come "
                                 f"after the previous cut (layer {starts[-1]}, {names[starts[-1]]}); list the "
                                 "names in the model's order, each stage at least one layer")
        starts.append(at)
    return [b - a for a, b in zip(starts, [*starts[1:], len(names)], strict=True)]


def balance_costs(costs: Sequence[LayerCost], mode: str) -> list[float]:
    if mode == "time":
        return [c.seconds for c in costs]
    if mode == "memory":
        return [float(c.params_bytes + c.activation_bytes) for c in costs]
    raise unknown_name("balance", mode, MODES)


def choose_balance(
    requested: Sequence[int] | Sequence[str] | str, layers: Sequence[Layer], stages: int, sample: Any = None,
    agree: Callable[[list[float]], list[float]] | None = None,
) -> tuple[list[int], list[LayerCost] | None]:
    """The balance to use and the measured layer costs (None when nothing was measured).

    `agree` makes every process use the same measurements (e.g. an all-reduced mean), so that all
    ranks of a pipeline split the model identically.
    """
    n = len(layers)
    if n < stages:
        raise too_few_layers(n, stages)
    if not isinstance(requested, str) and all(isinstance(r, str) for r in requested):
        return cut_by_name([str(r) for r in requested], layers, stages), None
    if not isinstance(requested, str):
        try:
            return check_balance([int(r) for r in requested], n, stages), None
        except ParatrainError as exc:
            raise ParatrainError(f"{exc}. The model's {n} layers, in its own names: {_names(layers)}; or cut by "
                                 "name: split_points=['NAME'] starts a stage at NAME") from None
    if requested == "equal":
        return equal_balance(n, stages), None
    if requested not in MODES:
        raise unknown_name("balance", requested, MODES)
    if _built_on_meta(layers):  # no values to time yet: the layers' sizes stand in for their costs
        return solve([float(param_bytes(m)) for _, m in layers], stages), None
    if sample is None:
        raise ParatrainError(f"balance={requested!r} needs a sample batch to measure the layers")
    costs = profile_layers(layers, sample)
    if agree is not None:
        flat = [v for c in costs for v in (c.seconds, float(c.params_bytes), float(c.activation_bytes))]
        flat = agree(flat)
        costs = [LayerCost(c.name, flat[3 * i], int(flat[3 * i + 1]), int(flat[3 * i + 2]))
                 for i, c in enumerate(costs)]
    return solve(balance_costs(costs, requested), stages), costs


def _built_on_meta(layers: Sequence[Layer]) -> bool:
    from ...weights.build import is_empty

    return any(is_empty(t) for _, m in layers for t in m.parameters())


def describe(balance: Sequence[int], costs: Sequence[LayerCost] | None, mode: str | Sequence[int] | Sequence[str],
             names: Sequence[str] = ()) -> str:
    """One line for the log: the balance, what each stage holds in the model's own names, and when
    measured the per-stage times against the equal split."""
    text = f"balance {list(balance)}"
    if names:
        starts = [sum(balance[:i]) for i in range(len(balance))]
        spans = [names[a] if n == 1 else f"{names[a]}..{names[a + n - 1]}" for a, n in zip(starts, balance)]
        text += f" ({' | '.join(spans)})"
    if costs:
        seconds = [c.seconds for c in costs]
        mine = stage_sums(seconds, balance)
        equal = stage_sums(seconds, equal_balance(len(costs), len(balance)))
        text += (f" by {mode}: stage fwd+bwd ms {[round(s * 1e3, 2) for s in mine]} (max {max(mine) * 1e3:.2f}; "
                 f"equal split {equal_balance(len(costs), len(balance))} would be max {max(equal) * 1e3:.2f})")
    return text
