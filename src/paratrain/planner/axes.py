"""What each model axis (tp, cp, ep) adds to one rank's step: one entry per axis in `TERMS`.

Every entry says, for a layout whose degree on that axis is above 1: why it cannot run this model (`problem`), a
layer's time on one rank and the communication inside it (`time`), the share of a layer's saved activations a rank
keeps (`activations`), the parameters a rank does not hold (`dropped`), those it holds but reduces itself, apart from
the data-parallel axes (`apart`), what it reduces after the backward (`after_backward`), and how many ranks average
the other gradients with the data-parallel ones (`averaged_over`).
A layer's time starts from the layer measured at the tokens a rank computes (`Step.tokens`: cp divides them), and
each axis in turn rewrites it. A new axis is one more entry.

    tp   the split share of a layer at 1/tp of the work, plus an all-reduce per row-split Linear forward and per
         column-split Linear backward over the tensor ranks, and DTensor's per-call cost (`Cluster.tp_overhead`)
    cp   1/cp of every sequence's tokens (attention too, load-balanced); per attention call an all-gather of the
         keys and values forward and a reduce-scatter of their gradients backward over the cp ranks; attention under
         an explicit causal mask (`Profile.masked_attention`); the outputs gathered, with the copies around the
         exchange (`logits_exchange`), and the loss taken on the whole sequences on every rank (`Profile.loss_s`),
         none of it where each rank takes its own tokens' loss (`setup(loss="token_mean")`: `gathers_outputs`);
         activations / cp; the replicated weights' gradients averaged over dp x cp
    ep   per MoE module the dispatch and combine all-to-alls forward and again backward, bytes = tokens per rank x
         top_k x hidden x dtype bytes, over the ep group, after the per-expert counts (grouped experts) or every
         rank's expert calls (listed experts: `parallel.expert.listed`, whose second routing pass is left out);
         the busiest rank's share of the rows (`Profile.imbalance`) sets the pace; expert parameters, gradients and
         optimizer state / ep; expert gradients all-reduced (one tensor at a time) over the dp / ep ranks holding
         the same experts
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..parallel.dims import ParallelDims
from . import costs
from .cluster import Cluster
from .comm import Group, collective_time, context_group, expert_group, tensor_group
from .costs import LayerCost, LayerTime, Profile


@dataclass
class Step:
    """One rank's micro-step: what every axis term reads."""

    profile: Profile
    cluster: Cluster
    dims: ParallelDims
    precision: str
    rows: float
    """Samples this rank loads per micro-step (whole sequences)."""
    loss: str = "any"
    """`setup(loss=...)`: "any" (under cp the outputs are gathered into whole sequences for the loss) or
    "token_mean" (each context rank takes its own tokens' loss: nothing gathered, outside pipelines)."""
    _times: dict[float, list[LayerTime]] = field(default_factory=dict)

    @property
    def tokens(self) -> float:
        """The rank's computed tokens, in samples: context ranks each compute 1/cp of every sequence."""
        return self.rows / self.dims.cp

    @property
    def gathers_outputs(self) -> bool:
        """Whether context ranks gather the outputs into whole sequences and every one takes their whole loss: always
        at a pipeline's exit, and outside pipelines unless the loss is a token mean (`strategies/nd.py`)."""
        return gathers_outputs(self.loss, self.dims)

    def at(self, b: float) -> list[LayerTime]:
        """Every layer's time on one device at micro-batch b (measured or from FLOPs), computed once per size."""
        if b not in self._times:
            self._times[b] = costs.times(self.profile, b, self.cluster, self.precision)
        return self._times[b]

    def collective(self, kind: str, n: float, group: Group) -> float:
        return collective_time(self.cluster, kind, n, group)


Timed = tuple[LayerTime, float]


@dataclass(frozen=True)
class Axis:
    name: str
    degree: Callable[[ParallelDims], int]
    problem: Callable[[Profile, ParallelDims], str | None]
    time: Callable[[Step, int, LayerTime], Timed]
    activations: Callable[[LayerCost, int], float] = lambda layer, degree: 1.0
    dropped: Callable[[LayerCost, int], float] = lambda layer, degree: 0.0
    apart: Callable[[LayerCost, int], float] = lambda layer, degree: 0.0
    after_backward: Callable[[Step], float] = lambda step: 0.0
    averaged_over: Callable[[ParallelDims], int] = lambda dims: 1


def _plus(t: LayerTime, forward: float, backward: float) -> LayerTime:
    return LayerTime(t.forward + forward, t.backward + backward, t.weight_share)


# -- tensor ----------------------------------------------------------------------------------------------------------


def _tensor_problem(profile: Profile, dims: ParallelDims) -> str | None:
    if not profile.tp_width:
        return profile.tp_note or "the model has no tensor-parallel plan"
    if profile.tp_width % dims.tp:
        return (f"tensor parallelism over {dims.tp} ranks cannot split the planned Linears evenly (their split "
                f"dimensions have greatest common divisor {profile.tp_width})")
    return None


def _tensor_time(step: Step, i: int, whole: LayerTime) -> Timed:
    layer, tp = step.profile.layers[i], step.dims.tp
    split = step.at(step.tokens / tp)[i]
    group = tensor_group(step.cluster, tp)
    b = step.tokens
    f_comm = sum(step.collective("all_reduce", n * b, group) for n in layer.tp_forward_reduces)
    b_comm = sum(step.collective("all_reduce", n * b, group) for n in layer.tp_backward_reduces)
    calls = (len(layer.tp_forward_reduces) + len(layer.tp_backward_reduces)) * step.cluster.tp_overhead / 2
    share = layer.tp_share
    return LayerTime((1 - share) * whole.forward + share * split.forward + f_comm + calls,
                     (1 - share) * whole.backward + share * split.backward + b_comm + calls,
                     whole.weight_share), f_comm + b_comm


def _tensor_activations(layer: LayerCost, tp: int) -> float:
    share = layer.tp_share if layer.tp_activation_share is None else layer.tp_activation_share
    return 1 - share * (1 - 1 / tp)


def _tensor_dropped(layer: LayerCost, tp: int) -> float:
    return layer.tp_params * (1 - 1 / tp)


# -- context ---------------------------------------------------------------------------------------------------------


def _context_problem(profile: Profile, dims: ParallelDims) -> str | None:
    if not profile.attention:
        return "context parallelism shares out attention, and the model makes no F.scaled_dot_product_attention call"
    if not profile.position_ids:
        return "the model's forward takes no position_ids, which context parallelism gives every rank's share"
    if profile.context_refused:
        return f"context parallelism refuses this model's attention: {profile.context_refused}"
    if profile.sequence % (2 * dims.cp):
        return (f"context parallelism over {dims.cp} ranks cuts each sequence into {2 * dims.cp} chunks, and "
                f"{profile.sequence} tokens do not divide")
    return None


def _context_time(step: Step, i: int, t: LayerTime) -> Timed:
    layer, cp = step.profile.layers[i], step.dims.cp
    group = context_group(step.cluster, cp, step.dims.tp)
    forward = backward = 0.0
    if layer.attention_calls:
        kv = layer.kv_bytes * step.rows / layer.attention_calls  # one call's keys and values, the whole sequence
        forward += layer.attention_calls * step.collective("all_gather", kv, group)
        backward += layer.attention_calls * step.collective("reduce_scatter", kv, group)
    comm = forward + backward
    if i == len(step.profile.layers) - 1 and step.gathers_outputs:  # the outputs gathered back into whole
        # sequences, and the loss taken on them on every rank: the last layer was timed with its share's loss only
        (gather, scatter), copies = logits_exchange(step, layer.output_bytes * step.rows, group)
        forward, backward, comm = forward + gather, backward + scatter, comm + gather + scatter
        whole = step.rows - step.tokens
        forward += step.profile.loss_s[0] * whole + copies[0]
        backward += step.profile.loss_s[1] * whole + copies[1]
    extra = step.profile.masked_attention - 1  # the layers were timed with causal attention, which skips blocks
    forward += extra * layer.attention_s[0] * step.tokens
    backward += extra * layer.attention_s[1] * step.tokens
    return _plus(t, forward, backward), comm


def gathers_outputs(loss: str, dims: ParallelDims) -> bool:
    """Context ranks gather the model's outputs for the loss unless it is a token mean taken outside a pipeline
    (`strategies/nd.py`: each rank then takes its own tokens' loss); a pipeline's last stage always gathers."""
    return dims.cp > 1 and (loss != "token_mean" or dims.pp > 1)


def logits_exchange(step: Step, whole: float, group: Group) -> tuple[tuple[float, float], tuple[float, float]]:
    """((all-gather, reduce-scatter), (forward, backward) copies) seconds of gathering `whole` bytes of outputs into
    whole sequences (`parallel.context.Share.whole`): the differentiable all-gather of every rank's share, its
    gradient reduce-scattered back, and the tensors made around them, each a copy into fresh memory (`fresh`):
    forward the share made contiguous, the gathered buffer and the whole put back in sequence order; backward the
    gradient's pieces joined, made contiguous for the reduce-scatter, its output and the share's gradient."""
    share = whole / step.dims.cp
    fresh = _fresh_copy(step)
    exchange = step.collective("all_gather", whole, group), step.collective("reduce_scatter", whole, group)
    return exchange, (fresh * (share + 2 * whole), fresh * (2 * whole + 2 * share))


def _fresh_copy(step: Step) -> float:
    """Seconds per byte of a copy into new memory: measured with the profile on this machine, else a read and a
    write at the device's memory bandwidth."""
    if step.profile.copy_s_per_byte and costs.uses_measurements(step.profile, step.cluster, step.precision):
        return step.profile.copy_s_per_byte
    return 2 / (step.cluster.memory_bandwidth or 1e11)


def context_buffers(profile: Profile, rows: float, loss: str = "any") -> float:
    """What a context rank holds whole: every attention call's gathered keys and values (kept for the backward),
    and the gathered outputs unless each rank takes its own tokens' loss (`gathers_outputs`)."""
    kept = sum(x.kv_bytes for x in profile.layers) * rows
    return kept + (profile.layers[-1].output_bytes * rows if loss != "token_mean" else 0.0)


# -- expert ----------------------------------------------------------------------------------------------------------


def _expert_problem(profile: Profile, dims: ParallelDims) -> str | None:
    if not profile.experts:
        return "the model has no mixture-of-experts layer paratrain recognises (parallel.expert.find)"
    if profile.experts % dims.ep:
        return f"{dims.ep} expert-parallel ranks cannot share {profile.experts} experts equally"
    return None


def _expert_time(step: Step, i: int, t: LayerTime) -> Timed:
    layer, ep = step.profile.layers[i], step.dims.ep
    if not layer.experts:
        return t, 0.0
    group = expert_group(step.cluster, ep)
    a2a = lambda n: step.collective("all_to_all", n, group)  # noqa: E731
    per_module = layer.routed_bytes * step.rows / max(1, layer.moe_modules)
    modules = layer.moe_modules
    extra = step.cluster.expert_overhead / 2  # the runtime's own cost per exchange, half each way
    if layer.expert_kind == "listed":  # every rank's calls gathered at once (`parallel.expert.listed`)
        calls = step.collective("all_gather", 8 * (1 + 2 * layer.experts), group)
    else:  # the per-expert counts: latency, mostly
        calls = a2a(8 * layer.experts)
    # one exchange per module: the rows there and back; the rows' gradients both ways
    forward = modules * (calls + 2 * a2a(per_module) + extra)
    backward = modules * (2 * a2a(per_module) + extra)
    slow = step.profile.imbalance(ep) - 1  # the busiest rank's rows set the pace
    compute = _plus(t, layer.expert_share * slow * t.forward, layer.expert_share * slow * t.backward)
    return _plus(compute, forward, backward), forward + backward


def _expert_dropped(layer: LayerCost, ep: int) -> float:
    return layer.expert_params * (1 - 1 / ep)


def _expert_apart(layer: LayerCost, ep: int) -> float:
    return layer.expert_params / ep


def _expert_reduce(step: Step) -> float:
    """Expert gradients summed over the ranks holding the same experts, one tensor at a time (`ExpertGrads`)."""
    dims, cluster = step.dims, step.cluster
    replicas = dims.dp // dims.ep
    if replicas <= 1:
        return 0.0
    group = Group(replicas, dims.dp > cluster.devices_per_node)
    total = 0.0
    for layer in step.profile.layers:
        tensors = layer.expert_tensors // dims.ep
        if tensors and layer.params:
            size = layer.expert_params / dims.ep * layer.param_bytes / layer.params / tensors
            total += tensors * step.collective("all_reduce", size, group)
    return total


TERMS: tuple[Axis, ...] = (
    Axis("cp", lambda d: d.cp, _context_problem, _context_time, averaged_over=lambda d: d.cp),
    Axis("tp", lambda d: d.tp, _tensor_problem, _tensor_time, _tensor_activations, _tensor_dropped),
    Axis("ep", lambda d: d.ep, _expert_problem, _expert_time, dropped=_expert_dropped, apart=_expert_apart,
         after_backward=_expert_reduce),
)
"""The model axes, in the order their terms rewrite a layer's time (cp first: it sets the tokens a rank computes)."""


def active(dims: ParallelDims) -> list[Axis]:
    return [axis for axis in TERMS if axis.degree(dims) > 1]


def refused(dims: ParallelDims) -> str | None:
    """Combinations the runtime does not build: the degrees' own answer (`ParallelDims.refused`), which the strategy
    refuses by."""
    return dims.refused()


def problem(profile: Profile, dims: ParallelDims) -> str | None:
    """Why this model cannot run with these degrees (None: it can)."""
    if dims.pp > 1 and (dims.cp > 1 or dims.ep > 1) and not (profile.own_blocks or profile.sequential):
        return ("expert and context parallelism inside pipeline stages need stages of the model's own blocks (a "
                "transformers decoder or an nn.Sequential's children, parallel.pipeline.blocks); this model would "
                "be traced")
    return refused(dims) or next((why for axis in active(dims) for why in [axis.problem(profile, dims)] if why), None)


def layer_times(step: Step) -> tuple[list[LayerTime], float]:
    """Each layer's time on one rank with every active axis's terms, and the communication seconds among them."""
    out, comm = [], 0.0
    axes = active(step.dims)
    for i, t in enumerate(step.at(step.tokens)):
        for axis in axes:
            t, seconds = axis.time(step, i, t)
            comm += seconds
        out.append(t)
    return out, comm


def activations(layers: list[LayerCost], dims: ParallelDims) -> float:
    """Saved bytes per computed sample on one rank (`Step.tokens` of them): each axis's share of each layer."""
    axes = active(dims)
    total = 0.0
    for layer in layers:
        kept = layer.activation_bytes
        for axis in axes:
            kept *= axis.activations(layer, axis.degree(dims))
        total += kept
    return total


def held(layers: list[LayerCost], dims: ParallelDims) -> tuple[float, float, float, float]:
    """(parameters, bytes) one rank holds of `layers` that the data-parallel axes share or average (a weight tied
    between two of them once), then (parameters, bytes) an axis reduces itself and they leave alone (experts)."""
    names = {x.name for x in layers}
    axes = active(dims)
    params = size = own = own_size = 0.0
    for x in layers:
        if not x.params:
            continue
        tied = x.shared_params / x.params if names.intersection(x.shared_with) else 0.0
        mine = x.params - sum(axis.dropped(x, axis.degree(dims)) for axis in axes)
        apart = sum(axis.apart(x, axis.degree(dims)) for axis in axes)
        per = x.param_bytes / x.params
        params += (mine - apart) * (1 - tied)
        size += (mine - apart) * (1 - tied) * per
        own, own_size = own + apart, own_size + apart * per
    return params, size, own, own_size


def after_backward(step: Step) -> float:
    return sum(axis.after_backward(step) for axis in active(step.dims))


def averaged_over(dims: ParallelDims) -> int:
    """Ranks that average the data-parallel gradients: the replicas, times each axis's own (cp)."""
    n = dims.dp
    for axis in active(dims):
        n *= axis.averaged_over(dims)
    return n
