"""One way to lay out training over devices, and how to ask paratrain for it.

A layout is a strategy with its degrees, held as the runtime holds them: one `parallel.dims.ParallelDims`
(dp_replicate, dp_shard, tp, cp, ep, pp), built by the runtime's own `dims_for` for the names of the grammar, so a
layout the runtime refuses is never predicted, and by its `PRESET_DIMS` for the presets. Beside the degrees: stages
per pipeline rank, micro-batches and schedule for pipelines, gradient-accumulation steps, and the precision. It
renders as the exact `paratrain.setup(...)` arguments and the launch command.

`mp` is the one predicted preset whose pipeline ranks are devices of one process: its `dims.pp` counts devices,
and `processes` is 1 (the runtime gives it one process's degrees; the planner needs its stages).

Facts about a strategy (its axes, pipelined, scheduled, sharded, how its replicas average, processes) are asked of
the runtime's own strategy object (`strategies.get`), never read off its name here.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import ParatrainError
from ..parallel.dims import ParallelDims, dims_for, is_grammar, parse
from .cluster import Cluster

SEARCHED_PRESETS = ("single", "ddp", "fsdp", "pp", "mp")
"""The presets of `paratrain.strategies.TABLE` the planner predicts (`dp` needs GPUs in one process and `ddp+mp`
is covered by `ddp+pp`); every other layout is a name of the grammar."""


@functools.lru_cache(maxsize=256)
def facts(strategy: str) -> Any:
    """The runtime's strategy object for `strategy` (`paratrain.strategies.base.Strategy`): what it is built of."""
    from ..strategies import get

    return get(strategy)


def _stages_in_process(strategy: str) -> bool:
    """The pipeline ranks are devices of one process (`mp`), not processes."""
    return bool(facts(strategy).in_process == "stages" and not facts(strategy).needs_process_group)


def presets() -> tuple[str, ...]:
    """The preset names the planner predicts, as the strategy table lists them."""
    from ..strategies import TABLE

    return tuple(name for name in TABLE if name in SEARCHED_PRESETS)


def axes(strategy: str) -> tuple[str, ...]:
    """The parallel axes of a strategy (presets and the grammar alike; `mp` and `single` have none)."""
    found: tuple[str, ...] = facts(strategy).axes
    return found


def known(strategy: str) -> str | None:
    """Why the planner cannot take `strategy` (None: a preset it predicts, or a valid name of the grammar)."""
    from ..strategies import TABLE

    if strategy in SEARCHED_PRESETS:
        return None
    if strategy in TABLE:
        return f"the planner does not predict {strategy!r}"
    if not is_grammar(strategy):
        return f"{strategy!r} is neither a preset ({', '.join(presets())}) nor a '+'-set of the grammar"
    try:
        parse(strategy)
    except ParatrainError as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=256)
def _preset(strategy: str, world: int) -> ParallelDims:
    """A preset's degrees on `world` workers, as the preset itself states them (`Strategy.degrees`)."""
    from ..config import make_config
    from ..strategies import get

    return get(strategy).degrees(make_config({"strategy": strategy}), world)


def degrees(strategy: str, *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> ParallelDims:
    """The runtime's degrees for `strategy` with `dp` data-parallel replicas x `tp` x `cp` x `pp` ranks (`ep` carved
    from the replicas): `dims_for` for a name of the grammar, which refuses what the runtime refuses, and the
    preset's own for a preset."""
    from ..strategies import TABLE

    world = dp * tp * pp * cp
    if _stages_in_process(strategy):
        return ParallelDims(pp=pp)
    if strategy in TABLE:
        found = _preset(strategy, world)
    else:
        words = parse(strategy)
        return dims_for(strategy, world, tp_size=tp if "tp" in words else None,
                        pp_size=pp if "pp" in words else None, cp_size=cp if "cp" in words else None,
                        ep_size=ep if "ep" in words else None)
    if (found.dp, found.tp, found.pp, found.cp, found.ep) != (dp, tp, pp, cp, ep) and world > 1:
        raise ParatrainError(f"strategy {strategy!r} on {world} workers runs {found.describe()}, not dp {dp} x tp {tp} "
                             f"x cp {cp} x pp {pp} (ep {ep}); name the axes in the strategy")
    return found


@dataclass(frozen=True, init=False)
class Layout:
    strategy: str
    dims: ParallelDims
    """The degrees, as the runtime holds them (`mp`: its devices on `pp`)."""
    stages_per_worker: int = 1
    microbatches: int = 1
    schedule: str | None = None
    grad_accum: int = 1
    precision: str = "32"

    def __init__(self, *, strategy: str, dims: ParallelDims | None = None, dp: int | None = None,
                 tp: int | None = None, pp: int | None = None, cp: int | None = None, ep: int | None = None,
                 stages_per_worker: int = 1, microbatches: int = 1, schedule: str | None = None, grad_accum: int = 1,
                 precision: str = "32") -> None:
        """Either `dims`, or the degrees (`dp` replicas, `tp`, `cp`, `pp` ranks, `ep` carved from the replicas)
        from which the runtime's rules build them."""
        given = {k: v for k, v in dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep).items() if v is not None}
        if dims is None:
            dims = degrees(strategy, **given)
        elif given:
            raise ParatrainError(f"Layout: give dims or the degrees {sorted(given)}, not both")
        for name, value in dict(strategy=strategy, dims=dims, stages_per_worker=stages_per_worker,
                                microbatches=microbatches, schedule=schedule, grad_accum=grad_accum,
                                precision=precision).items():
            object.__setattr__(self, name, value)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: each loads its own share of the global batch."""
        return self.dims.dp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        """Pipeline ranks (devices of one `mp` process)."""
        return self.dims.pp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def devices(self) -> int:
        return self.dims.world

    @property
    def scheduled(self) -> bool:
        """Runs a pipeline schedule over processes (a `pp` axis)."""
        return bool(facts(self.strategy).scheduled)

    @property
    def pipelined(self) -> bool:
        """The model is split into stages (over processes, or over the devices of one process)."""
        return bool(facts(self.strategy).microbatched)

    @property
    def sharded(self) -> bool:
        return "fsdp" in axes(self.strategy)

    @property
    def grammar(self) -> bool:
        """Replicas average after the backward (`parallel.data_parallel.replicas`), not in DDP's buckets: DDP is
        built where the replicas are the layout's one axis (`parallel.parallelize`)."""
        return bool(axes(self.strategy)) and axes(self.strategy) != ("ddp",)

    @property
    def processes(self) -> int:
        return self.devices if facts(self.strategy).needs_process_group else 1

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_worker

    def _degrees(self) -> list[int]:
        """The degree of each word of the name, in its order (ep, carved from the replicas, adds no factor)."""
        dims = self.dims
        of = {"ddp": dims.dp_replicate, "fsdp": dims.dp_shard, "tp": dims.tp, "cp": dims.cp, "pp": dims.pp}
        words = axes(self.strategy)
        if _stages_in_process(self.strategy):
            return [dims.pp]
        if "ep" in words and not {"ddp", "fsdp"} & set(words):
            words = ("ddp", *words)  # ep alone carves its experts from replicas
        return [of[w] for w in words if w in of and (of[w] > 1 or w in ("ddp", "fsdp"))]

    @property
    def label(self) -> str:
        """`fsdp+tp 2x4`: the degrees in the order of the name's words; schedule, expert degree and accumulation
        in brackets."""
        text = self.strategy if self.strategy == "single" else f"{self.strategy} {'x'.join(map(str, self._degrees()))}"
        extra: list[str] = []
        if self.pipelined:
            extra += [self.schedule] if self.schedule else []
            extra += [f"V={self.stages_per_worker}"] if self.stages_per_worker > 1 else []
            extra.append(f"M={self.microbatches}")
        carved = self.dims.dp_shard if self.dims.expert_axis == "dp_shard" else self.dims.dp_replicate
        if self.ep > 1 and self.ep != carved:
            extra.append(f"ep={self.ep}")
        if self.grad_accum > 1 and not self.pipelined:
            extra.append(f"accum {self.grad_accum}")
        return text + (f" ({', '.join(extra)})" if extra else "")

    def as_dict(self) -> dict[str, Any]:
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "dims"}
        return {**own, "dp": self.dp, "pp": self.pp, "tp": self.tp, "cp": self.cp, "ep": self.ep,
                "dims": asdict(self.dims), "label": self.label, "devices": self.devices}

    def setup_kwargs(self, cluster: Cluster) -> dict[str, Any]:
        """The `paratrain.setup(...)` arguments that run this layout."""
        kwargs: dict[str, Any] = {"strategy": self.strategy, "precision": self.precision}
        if self.grad_accum > 1:
            kwargs["grad_accum"] = self.grad_accum
        words = axes(self.strategy)
        for word, value in (("tp", self.tp), ("cp", self.cp), ("ep", self.ep)):
            if value > 1 and word in words:
                kwargs[f"{word}_size"] = value
        if self.scheduled:
            kwargs.update(microbatches=self.microbatches, schedule=self.schedule)
            if self.stages_per_worker > 1:
                kwargs["stages_per_worker"] = self.stages_per_worker
            if self.dp > 1 or self.tp > 1:
                kwargs["pp_size"] = self.pp
        if _stages_in_process(self.strategy):
            kwargs["microbatches"] = self.microbatches
            device = "cuda" if cluster.kind == "cuda" else "cpu"
            kwargs["devices"] = [f"{device}:{i}" if device == "cuda" else device for i in range(self.pp)]
        return kwargs

    def setup_call(self, cluster: Cluster) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.setup_kwargs(cluster).items())
        return f"paratrain.setup({args})"

    def commands(self, cluster: Cluster, script: str = "train.py") -> list[str]:
        """How to start it: `paratrain run` on one machine, `srun` (and `paratrain run` per node) on several."""
        if self.processes == 1:
            return [f"python {script}"]
        per_node = min(self.processes, cluster.devices_per_node)
        nodes = -(-self.processes // per_node)
        if nodes == 1:
            return [f"paratrain run --nproc {self.processes} {script}"]
        gpus = f" --gpus-per-node {per_node}" if cluster.kind == "cuda" else ""
        return [f"srun --nodes {nodes} --ntasks-per-node {per_node}{gpus} python {script}",
                f"paratrain run --nnodes {nodes} --nproc {per_node} --node-rank $NODE_RANK --master-addr HOST0 "
                f"--master-port 29500 {script}   # on each node"]
