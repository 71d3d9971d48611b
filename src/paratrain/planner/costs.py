"""What one layer costs: time, FLOPs and memory, per sample, and its time on a given cluster.

A model is a chain of layers (the children a pipeline would split it between). Each layer carries
counted FLOPs (forward, backward, and the share of backward that computes weight gradients, which a
zero-bubble schedule runs separately), parameter bytes, the activation bytes autograd saves for
backward and the bytes it hands to the next layer, all per sample. A layer measured on this machine
also carries its forward and backward seconds at the micro-batch sizes the layouts need.

On the machine that measured them, those seconds are the prediction (interpolated between measured
sizes): small micro-batches run far below peak and only a measurement says how far. Elsewhere the
time is counted FLOPs over the device's peak times the efficiency the cluster spec gives for a layer
call of that size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .cluster import Cluster

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}
"""fp32 state tensors per parameter: plain SGD none, SGD with momentum one, Adam/AdamW two."""
OPTIMIZER_TRAFFIC = {"sgd": 12, "momentum": 20, "adam": 28}
"""Bytes per parameter an optimizer step streams (read param, grad and states, write param and states)."""


@dataclass(kw_only=True)
class AxisFacts:
    """What a layer holds that expert and context parallelism split: its experts and its attention calls."""

    experts: int = 0
    """Experts of each mixture-of-experts module in this layer (0: none; `parallel.expert.find`)."""
    expert_kind: str = ""
    """"listed" (a ModuleList called in turn) or "grouped" (3-D weights): both exchange once a module, listed after
    gathering every rank's expert calls (`parallel.expert.listed`)."""
    moe_modules: int = 0
    expert_params: int = 0
    """Parameters of all the layer's experts (expert parallelism holds 1/ep of them)."""
    expert_tensors: int = 0
    """Parameter tensors of the experts (their gradients are all-reduced one tensor at a time)."""
    expert_share: float = 0.0
    """Share of the layer's forward FLOPs spent in its experts."""
    routed_bytes: float = 0.0
    """Bytes routed to experts per sample, all modules of the layer: tokens x top_k x hidden x dtype bytes."""
    expert_rows: tuple[int, ...] = ()
    """Rows the router sent to each expert on the profiling example (listed experts; empty: not measured)."""
    attention_calls: int = 0
    """`F.scaled_dot_product_attention` calls in this layer's forward."""
    kv_bytes: float = 0.0
    """Bytes of the keys and values of those calls, per sample (what context parallelism gathers)."""


@dataclass(kw_only=True)
class LayerCost(AxisFacts):
    name: str
    params: int
    param_bytes: int
    flops_fwd: float
    """FLOPs of the forward pass, per sample."""
    flops_bwd: float
    """FLOPs of the backward pass (input and weight gradients), per sample."""
    weight_share: float = 0.5
    """Share of the backward that computes weight gradients (a zero-bubble W action)."""
    activation_bytes: float = 0.0
    """Bytes saved for backward, per sample."""
    output_bytes: float = 0.0
    """Bytes of the output (what a pipeline sends to the next stage), per sample."""
    seconds: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Micro-batch size -> (forward, backward) seconds measured on this machine."""
    tp_share: float = 0.0
    """Share of the forward FLOPs that tensor parallelism splits over its ranks: the planned Linears and what runs
    between a column-split Linear and its row-split partner (attention over the local heads, the MLP's activation)."""
    tp_activation_share: float | None = None
    """Share of the saved activations that tensor parallelism splits (None: `tp_share`)."""
    tp_params: int = 0
    """Parameters in the planned Linears, which each tensor rank holds a 1/tp share of."""
    tp_forward_reduces: tuple[float, ...] = ()
    """Per-sample bytes of each all-reduce over the tensor ranks in the forward (a row-split Linear's output)."""
    tp_backward_reduces: tuple[float, ...] = ()
    """Per-sample bytes of each all-reduce in the backward (a column-split Linear's input gradient)."""
    shared_params: int = 0
    """Parameters of this layer that an earlier layer holds too (a tied weight, e.g. a GPT's head and embedding)."""
    shared_with: tuple[str, ...] = ()
    """The earlier layers holding them: where one of them is on the same worker the weight is held once there."""
    attention_s: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds of those calls per sample, causal, as measured (0: not measured)."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = {str(k): list(v) for k, v in self.seconds.items()}
        out["expert_rows"], out["attention_s"] = list(self.expert_rows), list(self.attention_s)
        return out


def tensor_params(layers: Sequence[LayerCost], tp: int = 1) -> tuple[float, float]:
    """(parameters, bytes) one tensor rank holds of `layers`: a weight tied between two of them once."""
    names = {x.name for x in layers}
    params = held = 0.0
    for x in layers:
        if not x.params:
            continue
        tied = x.shared_params if names.intersection(x.shared_with) else 0
        mine = (x.params - x.tp_params * (1 - 1 / tp)) * (1 - tied / x.params)
        params += mine
        held += mine * x.param_bytes / x.params
    return params, held


@dataclass(kw_only=True)
class Profile:
    """A model as the planner sees it."""

    name: str
    layers: list[LayerCost]
    sample_bytes: float
    """Input plus target bytes per sample (every pipeline rank holds its batch of both)."""
    tokens_per_sample: int = 1
    source: str = "measured"
    """"measured" here, or "analytic" (formulas for a model that is never built)."""
    precision: str = "32"
    """Precision the seconds were measured at."""
    optimizer: str = "adam"
    optimizer_s_per_param: float | None = None
    """Seconds per parameter of one optimizer step, measured here (None: from memory bandwidth)."""
    step_overhead_s: float = 0.0
    """Per forward-backward call, measured: the whole step minus its layers (Python, hooks, loss glue)."""
    tp_width: int = 0
    """Greatest common divisor of the dimensions tensor parallelism splits: a tensor degree must divide it
    (0: the model has no tensor-parallel plan, see `tp_note`)."""
    tp_note: str | None = None
    """Why tensor-parallel layouts do not apply (the plan's refusal), or where the plan came from."""
    built: str = "whole"
    """How each rank builds the model before `prepare` splits it: "whole" (its every tensor, on every rank), or
    "meta" (on the meta device: each rank gets storage for its share only, a layer's tensors at a time)."""
    top_k: int = 0
    """Experts each token is routed to (0: no mixture of experts)."""
    sequence: int = 0
    """Tokens per sequence that attention sees (0: no attention call found)."""
    position_ids: bool = False
    """The model's forward takes `position_ids`, which context parallelism needs (`parallel.context`)."""
    context_refused: str | None = None
    """Why context parallelism would refuse the model's attention (a call with its own mask or dropout)."""
    own_blocks: bool = False
    """Its pipeline stages can be its own blocks (a transformers decoder: `parallel.pipeline.blocks`), which expert
    and context parallelism need inside a pipeline; other models are traced to be split."""
    sequential: bool = False
    """An nn.Sequential: its children are its stages, called as themselves, so expert and context parallelism can
    live inside a pipeline of them (`parallel.pipeline.blocks.sequential_layers`)."""
    masked_attention: float = 1.0
    """Seconds of attention from half the queries to every key under an explicit causal mask (what a context-parallel
    rank runs) over half of causal attention's seconds (what the profiled layers ran): the kernel skips the masked
    blocks only when told the attention is causal."""
    axes_note: str | None = None
    """What the expert and context terms could not measure and assumed instead."""
    loss_s: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds of the loss per sample, measured after the last layer (whose time includes them):
    under context parallelism every rank computes the whole sequences' loss, not its share's (0: not measured)."""
    copy_s_per_byte: float = 0.0
    """Seconds per byte of copying the last layer's output (at the largest profiled micro-batch) into newly allocated
    memory, measured here: what each tensor made around context parallelism's gather of the outputs costs, the
    fresh memory's page faults included (0: not measured; the device's memory bandwidth stands in)."""

    @property
    def params(self) -> int:
        """Distinct parameters (a tied weight once)."""
        return round(tensor_params(self.layers)[0])

    @property
    def param_bytes(self) -> int:
        return round(tensor_params(self.layers)[1])

    @property
    def experts(self) -> int:
        """Experts every MoE layer can split evenly (their greatest common divisor; 0: none)."""
        return math.gcd(*(x.experts for x in self.layers if x.experts)) if any(x.experts for x in self.layers) else 0

    @property
    def attention(self) -> bool:
        return any(x.attention_calls for x in self.layers)

    def imbalance(self, ep: int) -> float:
        """The busiest expert-parallel rank's routed rows over the mean, summed over the layers measured (rank r
        holds experts r*E/ep .. (r+1)*E/ep - 1); 1.0 where routing was not measured."""
        busiest = mean = 0.0
        for x in self.layers:
            if not x.expert_rows or ep <= 1 or len(x.expert_rows) % ep:
                continue
            local = len(x.expert_rows) // ep
            loads = [sum(x.expert_rows[r * local : (r + 1) * local]) for r in range(ep)]
            busiest += max(loads)
            mean += sum(loads) / ep
        return busiest / mean if mean else 1.0

    def flops_per_sample(self) -> float:
        return sum(layer.flops_fwd + layer.flops_bwd for layer in self.layers)

    def as_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "layers"},
                "params": self.params, "layers": [layer.as_dict() for layer in self.layers]}


def _interpolate(seconds: dict[int, tuple[float, float]], b: float) -> tuple[float, float]:
    """Measured (forward, backward) at micro-batch b: exact, linear between the nearest sizes, or scaled
    in proportion to b from the nearest one outside the measured range."""
    if b == int(b) and int(b) in seconds:
        return seconds[int(b)]
    sizes = sorted(seconds)
    below = [s for s in sizes if s < b]
    above = [s for s in sizes if s > b]
    if below and above:
        lo, hi = below[-1], above[0]
        w = (b - lo) / (hi - lo)
        return tuple(x + w * (y - x) for x, y in zip(seconds[lo], seconds[hi]))  # type: ignore[return-value]
    near = below[-1] if below else above[0]
    return tuple(t * b / near for t in seconds[near])  # type: ignore[return-value]


@dataclass(frozen=True)
class LayerTime:
    forward: float
    backward: float
    weight_share: float

    @property
    def input_grad(self) -> float:
        return self.backward * (1 - self.weight_share)

    @property
    def weight_grad(self) -> float:
        return self.backward * self.weight_share


def layer_time(layer: LayerCost, b: float, cluster: Cluster, precision: str, measured: bool) -> LayerTime:
    """Seconds of `layer` on micro-batch `b` on one device of `cluster`."""
    if measured and layer.seconds:
        fwd, bwd = _interpolate(layer.seconds, b)
        return LayerTime(fwd, bwd, layer.weight_share)
    peak = cluster.peak(precision)
    fwd_flops, bwd_flops = layer.flops_fwd * b, layer.flops_bwd * b
    fwd = fwd_flops / (peak * cluster.efficiency_at(fwd_flops)) if fwd_flops else 0.0
    bwd = bwd_flops / (peak * cluster.efficiency_at(bwd_flops)) if bwd_flops else 0.0
    return LayerTime(fwd, bwd, layer.weight_share)


def uses_measurements(profile: Profile, cluster: Cluster, precision: str) -> bool:
    """Measured seconds apply only on the machine that took them, at the precision they were taken at."""
    return cluster.measured_here and profile.source == "measured" and profile.precision == precision


def times(profile: Profile, b: float, cluster: Cluster, precision: str) -> list[LayerTime]:
    measured = uses_measurements(profile, cluster, precision)
    return [layer_time(layer, b, cluster, precision, measured) for layer in profile.layers]


def optimizer_time(profile: Profile, params: float, cluster: Cluster, optimizer: str) -> float:
    """Seconds of one optimizer step over `params` parameters held by one worker."""
    if profile.optimizer_s_per_param is not None and cluster.measured_here and profile.optimizer == optimizer:
        return params * profile.optimizer_s_per_param
    bandwidth = cluster.memory_bandwidth or 1e11
    return params * OPTIMIZER_TRAFFIC[optimizer] / bandwidth

