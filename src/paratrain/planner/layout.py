"""One way to lay out training over devices, and how to ask paratrain for it.

A layout is a strategy with its degrees: data-parallel replicas x tensor ranks x pipeline ranks, stages per
pipeline rank, micro-batches and schedule for pipelines, gradient-accumulation steps for data parallelism, and
the precision. N-D strategies are the names of the grammar (`parallel.dims`): which axes a layout has is read
from its name, never from a list of names. It renders as the exact `paratrain.setup(...)` arguments and the
launch command.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..parallel.dims import is_grammar, parse
from .cluster import Cluster

TENSOR = ("tp", "ddp+tp", "fsdp+tp", "tp+pp", "ddp+tp+pp", "fsdp+tp+pp")
"""The tensor-parallel layouts the planner predicts."""
STRATEGIES = ("single", "ddp", "fsdp", "pp", "ddp+pp", "fsdp+pp", "mp", *TENSOR)


def axes(strategy: str) -> tuple[str, ...]:
    """The parallel axes of a strategy name (presets and the grammar alike; `mp` and `single` have none)."""
    return parse(strategy) if is_grammar(strategy) else ()


@dataclass(frozen=True, kw_only=True)
class Layout:
    strategy: str
    dp: int = 1
    """Data-parallel replicas."""
    pp: int = 1
    """Pipeline ranks (devices of one `mp` process)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    stages_per_worker: int = 1
    microbatches: int = 1
    schedule: str | None = None
    grad_accum: int = 1
    precision: str = "32"

    @property
    def devices(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def scheduled(self) -> bool:
        """Runs a pipeline schedule over processes (a `pp` axis)."""
        return "pp" in axes(self.strategy)

    @property
    def pipelined(self) -> bool:
        return self.scheduled or self.strategy == "mp"

    @property
    def sharded(self) -> bool:
        return "fsdp" in axes(self.strategy)

    @property
    def processes(self) -> int:
        return 1 if self.strategy == "mp" else self.devices

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_worker

    @property
    def label(self) -> str:
        if self.tp > 1:  # the degrees in the order of the name's words: data-parallel x tensor x pipeline
            degrees = "x".join(str(v) for v in (self.dp, self.tp, self.pp) if v > 1)
            if not self.scheduled:
                return f"{self.strategy} {degrees}" + (f" (accum {self.grad_accum})" if self.grad_accum > 1 else "")
            virtual = f"V={self.stages_per_worker}, " if self.stages_per_worker > 1 else ""
            return f"{self.strategy} {degrees} ({self.schedule}, {virtual}M={self.microbatches})"
        if self.strategy in ("single", "ddp", "fsdp"):
            text = self.strategy if self.strategy == "single" else f"{self.strategy} {self.dp}"
            return text + (f" (accum {self.grad_accum})" if self.grad_accum > 1 else "")
        degrees = f"{self.dp}x{self.pp}" if self.dp > 1 else str(self.pp)
        sched = f"{self.schedule}, " if self.schedule else ""
        virtual = f"V={self.stages_per_worker}, " if self.stages_per_worker > 1 else ""
        return f"{self.strategy} {degrees} ({sched}{virtual}M={self.microbatches})"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label, "devices": self.devices}

    def setup_kwargs(self, cluster: Cluster) -> dict[str, Any]:
        """The `paratrain.setup(...)` arguments that run this layout."""
        kwargs: dict[str, Any] = {"strategy": self.strategy, "precision": self.precision}
        if self.grad_accum > 1:
            kwargs["grad_accum"] = self.grad_accum
        if self.tp > 1:
            kwargs["tp_size"] = self.tp
        if self.scheduled:
            kwargs.update(microbatches=self.microbatches, schedule=self.schedule)
            if self.stages_per_worker > 1:
                kwargs["stages_per_worker"] = self.stages_per_worker
            if self.dp > 1 or self.tp > 1:
                kwargs["pp_size"] = self.pp
        if self.strategy == "mp":
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
