"""One way to lay out training over devices, and how to ask paratrain for it.

A layout is a strategy with its degrees: data-parallel replicas x pipeline ranks, stages per pipeline
rank, micro-batches and schedule for pipelines, gradient-accumulation steps for data parallelism, and
the precision. It renders as the exact `paratrain.setup(...)` arguments and the launch command.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .cluster import Cluster

STRATEGIES = ("single", "ddp", "fsdp", "pp", "ddp+pp", "mp")
PIPELINED = ("pp", "ddp+pp", "mp")


@dataclass(frozen=True, kw_only=True)
class Layout:
    strategy: str
    dp: int = 1
    """Data-parallel replicas."""
    pp: int = 1
    """Pipeline ranks (devices of one `mp` process)."""
    stages_per_worker: int = 1
    microbatches: int = 1
    schedule: str | None = None
    grad_accum: int = 1
    precision: str = "32"

    @property
    def devices(self) -> int:
        return self.dp * self.pp

    @property
    def processes(self) -> int:
        return 1 if self.strategy == "mp" else self.devices

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_worker

    @property
    def label(self) -> str:
        if self.strategy in ("single", "ddp", "fsdp"):
            text = self.strategy if self.strategy == "single" else f"{self.strategy} {self.dp}"
            return text + (f" (accum {self.grad_accum})" if self.grad_accum > 1 else "")
        degrees = f"{self.dp}x{self.pp}" if self.strategy == "ddp+pp" else str(self.pp)
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
        if self.strategy in ("pp", "ddp+pp"):
            kwargs.update(microbatches=self.microbatches, schedule=self.schedule)
            if self.stages_per_worker > 1:
                kwargs["stages_per_worker"] = self.stages_per_worker
            if self.strategy == "ddp+pp":
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
