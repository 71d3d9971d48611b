"""Predict one layout's step: time, where it goes, and memory of its busiest worker.

    step = compute + exposed communication + pipeline bubble + optimizer + per-call overhead

Compute is the layers' forward and backward at the micro-batch size this layout runs (`costs`). Data
parallelism overlaps its gradient all-reduce with the backward, bucket by bucket (`overlap.ddp_backward`);
FSDP gathers each unit's parameters one unit ahead and reduce-scatters its gradients behind
(`overlap.fsdp_step`), and each unit costs what the local measurement found FSDP2 adds beyond its math and its
collectives (`Cluster.fsdp_unit`: hooks, flat-buffer copies, and the core its transfers take from compute on CPU
workers; beside a model axis's exchanges, on CPU workers, both hide in the rank's waits: `_waits`), HSDP
all-reduces each unit's shard over its replicas (`shards_of`); pipelines run torch's own action lists
(`parallel.pipeline.simulate`), stages cut by the same time balance paratrain uses at run time, and ddp+pp then
all-reduces every stage's gradients over its replicas, after the schedule, as paratrain does. Every data-parallel
step also all-reduces its loss.

Tensor parallelism (`tp` > 1, any layout) runs each layer's split share (`LayerCost.tp_share`) at a 1/tp
share of the work (timed as the same layer at a 1/tp share of the micro-batch: the same FLOPs in products of
the same depth) and the rest whole, and adds its all-reduces over the tensor ranks (one per row-split Linear
forward, one per column-split Linear backward, none hidden: the next op needs them) and DTensor's per-call
cost (`Cluster.tp_overhead`). The planned Linears' parameters, and the split share of activations, divide by tp.

CPU workers beyond the machine's cores share them: such a step takes at least all workers' work
divided by the cores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ParatrainError
from ..parallel.dims import ParallelDims
from ..parallel.pipeline import schedules, simulate
from ..parallel.pipeline.balance import solve
from . import axes, costs, memory, overlap
from .cluster import GIB, Cluster
from .comm import Group, collective_time, p2p_time, pipeline_groups
from .costs import Profile
from .layout import Layout
from .memory import Memory

LOSS_BYTES = 4


@dataclass
class Prediction:
    layout: Layout
    step_s: float = 0.0
    compute_s: float = 0.0
    """Forward and backward seconds of the busiest worker (pipelines: with each action's runtime overhead)."""
    exposed_comm_s: float = 0.0
    """Communication the compute did not hide."""
    bubble: float = 0.0
    """Share of the step pipeline ranks sit idle, on average."""
    optimizer_s: float = 0.0
    overhead_s: float = 0.0
    memory: Memory = field(default_factory=Memory)
    fits: bool = True
    reason: str | None = None
    balance: list[int] | None = None
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    """Model FLOPs per second over the devices' peak."""

    def as_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.as_dict(), "step_s": self.step_s, "samples_per_s": self.samples_per_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "compute_s": self.compute_s,
                "exposed_comm_s": self.exposed_comm_s, "bubble": self.bubble, "optimizer_s": self.optimizer_s,
                "overhead_s": self.overhead_s, "memory": self.memory.as_dict(), "fits": self.fits,
                "reason": self.reason, "balance": self.balance}


def problem(layout: Layout, profile: Profile, batch: int, cluster: Cluster) -> str | None:
    """Why this layout cannot run at this global batch on this cluster (None: it can)."""
    if layout.devices > cluster.devices and cluster.kind == "cuda":
        return f"needs {layout.devices} devices, the cluster has {cluster.devices}"
    parts = layout.dp * (layout.microbatches if layout.pipelined else layout.grad_accum)
    if batch % parts:
        return (f"global batch {batch} does not split into {layout.dp} replica(s) x {parts // layout.dp} "
                f"{'micro-batches' if layout.pipelined else 'accumulation steps'}")
    why = axes.problem(profile, layout.dims)
    if why is not None:
        return why
    if layout.pipelined and len(profile.layers) < layout.stages:
        return f"the model has {len(profile.layers)} layers, fewer than the {layout.stages} stages"
    if layout.scheduled and layout.precision == "16":
        return "pipelines refuse precision '16' (the loss scaler cannot scale a loss the schedule computes); use bf16"
    if layout.scheduled:
        schedule, m = layout.schedule or "1f1b", layout.microbatches
        try:
            schedules.check(schedule, layout.pp, layout.stages_per_worker, m)
        except ParatrainError as exc:
            return str(exc).split(";")[0]
    return None


def capacity(cluster: Cluster, layout: Layout) -> float:
    """Bytes one worker may use: its device's, or a share of the machine when CPU workers outnumber cores."""
    if cluster.kind == "cpu" and layout.processes > cluster.devices:
        return cluster.memory * cluster.devices / layout.processes
    return cluster.memory


def predict(profile: Profile, layout: Layout, cluster: Cluster, batch: int, optimizer: str = "adam", *,
            loss: str = "any") -> Prediction:
    """The predicted step of `layout` training `profile` at global batch `batch` on `cluster`; `loss` is
    `setup(loss=...)` (a token mean spares context ranks the outputs' gather: `axes.gathers_outputs`)."""
    why = problem(layout, profile, batch, cluster)
    if why is not None:
        return Prediction(layout, fits=False, reason=why)
    if layout.scheduled or (layout.strategy == "mp" and cluster.kind == "cuda"):
        out = _pipeline(profile, layout, cluster, batch, optimizer, loss)
    elif layout.strategy == "mp":
        out = _serial_pipeline(profile, layout, cluster, batch, optimizer)
    else:
        out = _data_parallel(profile, layout, cluster, batch, optimizer, loss)
    out.memory.process = cluster.process_bytes
    out.memory.build = memory.building(profile.param_bytes, out.memory.params,
                                       max((x.param_bytes for x in profile.layers), default=0),
                                       profile.built == "meta", cluster.kind == "cpu")
    out.memory.phased = cluster.kind == "cuda" and layout.grad_accum == 1 and not layout.pipelined
    needed, available = out.memory.total + cluster.reserved, capacity(cluster, layout)
    if available and needed > available:
        out.fits = False
        m = out.memory
        held = (f"parameters+gradients+optimizer {m.state / GIB:.1f}, activations {m.activations / GIB:.1f}"
                if m.total > m.process + m.build else
                f"its build {m.build / GIB:.1f}" + ("" if profile.built == "meta" else
                                                    ": the whole model on every rank; build it on the meta device"))
        out.reason = f"needs {needed / GIB:.1f} GiB per worker, {available / GIB:.1f} GiB available ({held})"
    out.samples_per_s = batch / out.step_s if out.step_s else 0.0
    out.tokens_per_s = out.samples_per_s * profile.tokens_per_sample
    peak = cluster.peak_flops.get(layout.precision, 0.0)
    if peak and out.step_s:
        out.mfu = profile.flops_per_sample() * batch / (out.step_s * layout.devices * peak)
    return out


def _call_overhead(profile: Profile, cluster: Cluster, layout: Layout) -> float:
    """Per `run.forward_backward` call: paratrain's loop, and the model's own glue when measured here."""
    model = profile.step_overhead_s if costs.uses_measurements(profile, cluster, layout.precision) else 0.0
    return cluster.step_overhead + model


def _loss_reduce(cluster: Cluster, layout: Layout) -> float:
    world = Group(layout.devices, layout.devices > cluster.devices_per_node)
    return collective_time(cluster, "all_reduce", LOSS_BYTES, world)


def _shared_cores(step: float, work: float, cluster: Cluster, layout: Layout) -> float:
    if cluster.kind == "cpu" and layout.processes > cluster.devices:
        return max(step, work / cluster.devices)
    return step


def data_parallel_bytes(profile: Profile, dims: ParallelDims) -> list[float]:
    """Per layer, the bytes the data-parallel axes reduce, and so FSDP's units shard: what a rank holds less what an
    axis reduces itself (`axes.held`: a layer's experts under ep, which FSDP leaves out)."""
    return [axes.held([layer], dims)[1] for layer in profile.layers]


def _waits(cluster: Cluster, layout: Layout, axis_comm: float) -> float:
    """Seconds per micro-step a CPU worker sits blocked in the model axes' exchanges (the experts' all-to-alls, the
    keys' and values' gathers): its core is idle then, so FSDP's transfers and its own per-unit work, which on CPU
    workers otherwise take their time from compute, run there for free. 0 where workers outnumber the cores (the
    core goes to another worker) or on GPUs (the host does not wait on a collective)."""
    if cluster.kind != "cpu" or layout.processes > cluster.devices:
        return 0.0
    return axis_comm


@dataclass(frozen=True)
class Shards:
    """How FSDP holds a layout's data-parallel weights: sharded over `shards` ranks (dp_shard, and the context ranks
    beside them), and, under HSDP, each shard's gradients all-reduced over `replicas` copies (dp_replicate)."""

    shards: int
    shard_group: Group
    replicas: int
    replica_group: Group


def shards_of(cluster: Cluster, dims: ParallelDims) -> Shards:
    """FSDP's mesh (`parallel.parallelize._shard_mesh`): "dp_shard" x "cp", or HSDP's "dp_replicate" x that. On the
    one N-D mesh the shard ranks are a block of neighbours, the replicas that block's size apart."""
    inner = dims.dp_shard * dims.cp
    per_node = cluster.devices_per_node
    return Shards(inner, Group(inner, inner > 1 and inner * dims.tp > per_node), dims.dp_replicate,
                  Group(dims.dp_replicate, dims.dp_replicate > 1 and dims.dp * dims.cp * dims.tp > per_node))


def fsdp_unit_cost(cluster: Cluster, unit: list[float]) -> float:
    """What FSDP2 adds per micro-step beyond its math and collectives (`Cluster.fsdp_unit`), over the units it
    shards: `unit` holds only the bytes FSDP shards (a layer's experts under ep are not among them)."""
    alpha, beta = cluster.fsdp_unit
    return sum(alpha + beta * n for n in unit if n)


def _sharded_micro_step(fwd: list[float], bwd: list[float], unit: list[float], groups: Shards, cluster: Cluster,
                        waits: float, sync: bool) -> tuple[float, float, float]:
    """(seconds, exposed communication, FSDP's per-unit seconds charged) of one FSDP micro-step. The collectives run
    beside compute in torch's order (`overlap.fsdp_step`); with `overlap` below 1 the part compute hides still costs
    its share of compute time, and FSDP's own per-unit work is charged, both less the seconds the rank waits in the
    model axes' exchanges (`_waits`). HSDP all-reduces each unit's reduce-scattered shard over its replicas."""
    gather = lambda n: collective_time(cluster, "all_gather", n, groups.shard_group)  # noqa: E731
    scatter = lambda n: (collective_time(cluster, "reduce_scatter", n, groups.shard_group)  # noqa: E731
                         + collective_time(cluster, "all_reduce", n / groups.shards, groups.replica_group))
    free = overlap.fsdp_step(fwd, bwd, unit, gather, scatter, 1.0, sync=sync)  # the timeline, nothing charged
    hidden = (1 - cluster.overlap) * max(0.0, free.comm - free.exposed)
    charged = max(0.0, hidden - waits)
    units = fsdp_unit_cost(cluster, unit) if groups.shards * groups.replicas > 1 else 0.0
    units = max(0.0, units - max(0.0, waits - hidden))
    return free.end + charged, free.exposed + charged, units


def _data_parallel(profile: Profile, layout: Layout, cluster: Cluster, batch: int, optimizer: str,
                   loss: str = "any") -> Prediction:
    dims, accum, sharded = layout.dims, layout.grad_accum, layout.sharded
    b = batch // (layout.dp * accum)
    on_rank = axes.Step(profile, cluster, dims, layout.precision, b, loss)
    lt, axis_comm = axes.layer_times(on_rank)
    fwd, bwd = [t.forward for t in lt], [t.backward for t in lt]
    unit = data_parallel_bytes(profile, dims)
    ranks = axes.averaged_over(dims)  # the replicas, and the context ranks beside them
    group = Group(ranks, ranks > 1 and ranks * dims.tp > cluster.devices_per_node)
    reduce = lambda kind: (lambda n: collective_time(cluster, kind, n, group))  # noqa: E731
    call = _call_overhead(profile, cluster, layout)
    units = 0.0
    groups = shards_of(cluster, dims)
    shards = groups.shards if sharded else 1
    if sharded:
        waits = _waits(cluster, layout, axis_comm)
        q_end, q_exposed, q_units = _sharded_micro_step(fwd, bwd, unit, groups, cluster, waits, sync=False)
        l_end, l_exposed, l_units = _sharded_micro_step(fwd, bwd, unit, groups, cluster, waits, sync=True)
        body, exposed = (accum - 1) * q_end + l_end, (accum - 1) * q_exposed + l_exposed
        units = (accum - 1) * q_units + l_units
    elif layout.grammar:  # replicas average in one flat all-reduce after the backward (strategies/nd.py)
        averaged = reduce("all_reduce")(sum(unit))
        body, exposed = accum * (sum(fwd) + sum(bwd)) + averaged, averaged
    else:
        last = overlap.ddp_backward(bwd, unit, reduce("all_reduce"), cluster.overlap)
        body = (accum - 1) * (sum(fwd) + sum(bwd)) + sum(fwd) + last.end
        exposed = last.exposed
    after = axes.after_backward(on_rank)  # what an axis reduces itself when the window ends (experts)
    body, exposed = body + after, exposed + after
    overhead = accum * (call + (_loss_reduce(cluster, layout) if layout.devices > 1 else 0.0)) + units
    params, held, own_params, own_bytes = axes.held(profile.layers, dims)
    opt = costs.optimizer_time(profile, params / shards + own_params, cluster, optimizer)
    step = body + overhead + opt
    mem = memory.model_state(held, params, optimizer, shards)
    mem.add(memory.model_state(own_bytes, own_params, optimizer))
    largest = max(unit)
    if sharded:
        mem.buffers = 3 * largest + (held * (1 - 1 / shards) if accum > 1 else 0.0)
    elif ranks > 1:
        mem.buffers = held  # DDP's buckets (or the replicas' flat buffer) hold a copy of every gradient
    if dims.cp > 1:
        mem.buffers += axes.context_buffers(profile, b, on_rank.loss)
    mem.activations = memory.activations(axes.activations(profile.layers, dims),
                                         max(layer.output_bytes for layer in profile.layers), on_rank.tokens)
    mem.data = profile.sample_bytes * b
    compute = accum * (sum(fwd) + sum(bwd)) - accum * axis_comm
    return Prediction(layout, step_s=_shared_cores(step, layout.devices * step, cluster, layout), compute_s=compute,
                      exposed_comm_s=exposed + accum * axis_comm + (overhead - accum * call - units),
                      optimizer_s=opt, overhead_s=accum * call + units, memory=mem)


def _stage_costs(profile: Profile, lt: list[costs.LayerTime], balance: list[int], b: int,
                 send: Callable[[float], float], dims: ParallelDims) -> list[simulate.StageCost]:
    out, start = [], 0
    for count in balance:
        part = range(start, start + count)
        backward = sum(lt[i].backward for i in part)
        weight = sum(lt[i].weight_grad for i in part)
        out.append(simulate.StageCost(
            forward=sum(lt[i].forward for i in part), backward=backward,
            weight_share=weight / backward if backward else 0.5,
            activation_bytes=axes.activations([profile.layers[i] for i in part], dims) * b,
            send=send(profile.layers[start + count - 1].output_bytes * b)))
        start += count
    return out


def _tie_in_one_rank(profile: Profile, balance: list[int], where: dict[int, int]) -> str | None:
    """FSDP shards each stage as one unit, so a weight tied between two stages of one rank is refused at run
    time (`parallel/pipeline/sharded.py`); the planner says so instead of predicting it."""
    stage_of, start = {}, 0
    for s, count in enumerate(balance):
        stage_of.update({layer.name: s for layer in profile.layers[start : start + count]})
        start += count
    for layer in profile.layers:
        for other in layer.shared_with:
            a, b = stage_of.get(other), stage_of[layer.name]
            if a is not None and a != b and where[a] == where[b]:
                return (f"{layer.name} is tied to {other} in stages {a} and {b} of one rank, which FSDP cannot "
                        "shard as two units; one stage per worker, or another schedule")
    return None


def _pipeline(profile: Profile, layout: Layout, cluster: Cluster, batch: int, optimizer: str,
              loss: str = "any") -> Prediction:
    dp, pp, per_worker, micro, tp = layout.dp, layout.pp, layout.stages_per_worker, layout.microbatches, layout.tp
    schedule = layout.schedule or "gpipe"
    b = batch // (dp * micro)
    lt, _ = axes.layer_times(axes.Step(profile, cluster, layout.dims, layout.precision, b, loss))
    balance = solve([t.forward + t.backward for t in lt], layout.stages)
    dp_group, pp_group = pipeline_groups(cluster, dp, pp, tp * layout.cp)
    stages = _stage_costs(profile, lt, balance, b, lambda n: p2p_time(cluster, n, pp_group.crosses_nodes),
                          layout.dims)
    where = simulate.stage_ranks(schedule, pp, per_worker)
    if layout.sharded:
        tie = _tie_in_one_rank(profile, balance, where)
        if tie:
            return Prediction(layout, fits=False, reason=tie)
    run = simulate.run_schedule(schedule, pp, per_worker, micro, stages, cluster.action_overhead, cluster.overlap)
    starts = [sum(balance[:s]) for s in range(len(balance))]
    rank_params = [0.0] * pp
    rank_bytes = [0.0] * pp
    for s, count in enumerate(balance):  # what a rank holds of its stages: its tensor shards, its experts
        params, held, own, own_bytes = axes.held(profile.layers[starts[s] : starts[s] + count], layout.dims)
        rank_params[where[s]] += params + own
        rank_bytes[where[s]] += held + own_bytes
    shards = dp if layout.sharded else 1
    if layout.sharded and dp > 1:  # each stage one FSDP unit: gathered before its first forward, its unsharded
        # gradients reduce-scattered after its last backward, and FSDP's own cost per unit (as in _data_parallel)
        alpha, beta = cluster.fsdp_unit
        grads = max(collective_time(cluster, "all_gather", n, dp_group) + collective_time(
            cluster, "reduce_scatter", n, dp_group) + per_worker * alpha + beta * n for n in rank_bytes)
    else:
        grads = max(collective_time(cluster, "all_reduce", n, dp_group) for n in rank_bytes) if dp > 1 else 0.0
    reduced = _loss_reduce(cluster, layout) if layout.processes > 1 else 0.0
    opts = [costs.optimizer_time(profile, n / shards, cluster, optimizer) for n in rank_params]
    step = run.step + grads + reduced + max(opts) + cluster.step_overhead
    work = dp * tp * (sum(run.busy) + pp * (grads + reduced + cluster.step_overhead) + sum(opts))
    largest_output = max(layer.output_bytes for layer in profile.layers) * b
    worst = max(range(pp), key=lambda r: rank_bytes[r] + run.activation_peak[r])
    mem = memory.model_state(rank_bytes[worst], rank_params[worst], optimizer, shards)
    mem.activations = run.activation_peak[worst] + 2 * largest_output
    mem.in_flight = run.in_flight[worst]
    if shards > 1:  # the gathered stages and their gradients, whole until the step's reduce-scatter
        mem.buffers = 2 * rank_bytes[worst]
    else:
        mem.buffers = rank_bytes[worst] if dp > 1 else 0.0  # the flat gradient copy of the replica all-reduce
    mem.data = profile.sample_bytes * batch / dp
    if cluster.kind == "cpu" and profile.built != "meta":  # the balance's trial run stays resident (memory.py)
        build = costs.tensor_params(profile.layers, tp)[1] + memory.activations(axes.activations(profile.layers,
                                                                                                  layout.dims),
                                                         max(x.output_bytes for x in profile.layers), b)
        mem.retained = max(0.0, build - mem.activations - mem.grads)
    return Prediction(layout, step_s=_shared_cores(step, work, cluster, layout), compute_s=max(run.busy),
                      exposed_comm_s=grads + reduced + run.comm_wait, bubble=run.bubble, optimizer_s=max(opts),
                      overhead_s=cluster.step_overhead, memory=mem, balance=balance)


def _serial_pipeline(profile: Profile, layout: Layout, cluster: Cluster, batch: int, optimizer: str) -> Prediction:
    """`mp` with every stage on the one CPU: the micro-batches run one after another."""
    micro = layout.microbatches
    b = batch // micro
    lt = costs.times(profile, b, cluster, layout.precision)
    compute = micro * sum(t.forward + t.backward for t in lt)
    call = _call_overhead(profile, cluster, layout)
    opt = costs.optimizer_time(profile, profile.params, cluster, optimizer)
    mem = memory.model_state(profile.param_bytes, profile.params, optimizer)
    mem.activations = memory.activations(sum(layer.activation_bytes for layer in profile.layers) * micro,
                                         max(layer.output_bytes for layer in profile.layers), b)
    mem.in_flight = micro
    mem.data = profile.sample_bytes * batch
    balance = solve([t.forward + t.backward for t in lt], layout.stages)
    return Prediction(layout, step_s=compute + call + opt, compute_s=compute, optimizer_s=opt, overhead_s=call,
                      memory=mem, balance=balance)
