"""Where `paratrain run`'s node flags come from when they are not typed: the cluster that started it.

Each flag is taken, first found first, from the command line; from torchrun's own variables
(`PET_NNODES`, `PET_NODE_RANK`, `PET_MASTER_ADDR`, ...: what torchrun reads for its flags, and what
Kubeflow's training operator and a Kubernetes manifest set); from the Slurm job step; or from the
single-machine defaults.

Under Slurm, `srun paratrain run train.py` starts one launcher per node. Each finds in the step's
variables (read by `runtime.read_slurm`) the number of nodes, the step's first host (node 0, which
hosts the rendezvous store), and the job and step ids, from which the port and run id follow, the
same on every node. torchrun's c10d rendezvous then numbers the nodes itself, so no `--node-rank` is
passed (torch would ignore it with a warning). Without this, each launcher believed it was alone:
two nodes ran two separate jobs of the same script, each on all the data, both writing the same
files, and nothing said so. Two shapes that cannot be made right are refused: several launchers on
one node (`srun -n4` on two nodes; paratrain run already starts the node's workers) and a launcher
in the batch script of a multi-node allocation (which runs on the first node only).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import ParatrainError
from ..runtime import SlurmStep, slurm_port
from .checks import LaunchSpec, parse_nnodes


@dataclass(frozen=True, kw_only=True)
class NodeFlags:
    """`paratrain run`'s placement flags; None where not given."""

    nproc: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    run_id: str | None = None
    max_restarts: int | None = None


TORCHRUN_VARIABLES = {"NPROC_PER_NODE": "nproc", "NNODES": "nnodes", "NODE_RANK": "node_rank",
                      "MASTER_ADDR": "master_addr", "MASTER_PORT": "master_port", "RDZV_ID": "run_id",
                      "MAX_RESTARTS": "max_restarts"}
"""torchrun's variables (PET_ + the name) that stand for paratrain run's flags."""


def from_torchrun(variables: dict[str, str]) -> NodeFlags:
    """Flags from torchrun's PET_* variables (given without the prefix). PET_RDZV_ENDPOINT (HOST:PORT)
    stands for the master; PET_NPROC_PER_NODE other than a number ("auto", "gpu") keeps the default."""
    found: dict[str, Any] = {}
    host, _, port = variables.get("RDZV_ENDPOINT", "").rpartition(":")
    if host and port.isdigit():
        found |= {"master_addr": host, "master_port": int(port)}
    for name, flag in TORCHRUN_VARIABLES.items():
        value = variables.get(name, "").strip()
        if not value:
            continue
        if flag in ("nnodes", "master_addr", "run_id"):
            found[flag] = value
        elif value.isdigit():
            found[flag] = int(value)
        elif flag != "nproc":
            raise ParatrainError(f"PET_{name}={value!r} is not a number; fix or unset it (torchrun reads it too)")
    return NodeFlags(**found)


def resolve(spec: LaunchSpec, typed: NodeFlags, torchrun: NodeFlags, step: SlurmStep | None) -> LaunchSpec:
    """`spec` with its placement fields set: each from the flag typed, else torchrun's variable for it, else
    the Slurm step, else the single-machine default already in `spec`."""
    flags = {f.name: next((v for s in (typed, torchrun) if (v := getattr(s, f.name)) is not None), None)
             for f in fields(NodeFlags)}
    from_env = [f"PET_{n}" for n, flag in TORCHRUN_VARIABLES.items()
                if getattr(torchrun, flag) is not None and getattr(typed, flag) is None]
    nnodes = flags.pop("nnodes")
    if nnodes is not None:
        low, high = parse_nnodes(nnodes)
    else:
        low = high = 1 if step is None else _nodes_of(step)
    derived: dict[str, Any] = {"min_nodes": low, "max_nodes": high}
    if from_env:
        derived["origin"] = f"{', '.join(from_env)} from the environment"
    if step is not None and step.step is not None and high > 1:
        derived |= {"node_rank": step.node, "master_addr": step.first_host,
                    "master_port": slurm_port(step.job, step.step), "run_id": f"slurm-{step.job}.{step.step}",
                    "origin": f"Slurm job {step.job} step {step.step}: node {step.node} of {step.nodes}"}
    return replace(spec, **(derived | {k: v for k, v in flags.items() if v is not None}))


def _nodes_of(step: SlurmStep) -> int:
    """The number of nodes for a launcher started without --nnodes, or a refusal naming the fix."""
    command = "srun --ntasks-per-node=1 paratrain run [--nproc N] SCRIPT"
    if step.step is None:
        if step.nodes > 1:
            raise ParatrainError(
                f"paratrain run is running in the batch script of Slurm job {step.job}, which runs on the first "
                f"of its {step.nodes} nodes only; start it on every node with `{command}`, or pass --nnodes 1 "
                "to train on this node alone"
            )
        return 1
    if any(n > 1 for n in step.tasks_per_node):
        raise ParatrainError(
            f"srun started {sum(step.tasks_per_node)} copies of paratrain run on {step.nodes} node(s) "
            f"({_per_node(step)}) in Slurm job {step.job}, but paratrain run starts a node's workers itself "
            f"(--nproc): start one per node with `{command}`, or one task per worker without paratrain run: "
            "`srun python SCRIPT`"
        )
    return step.nodes


def _per_node(step: SlurmStep) -> str:
    counts = step.tasks_per_node
    if len(set(counts)) == 1:
        return f"{counts[0]} per node"
    return "per node: " + ", ".join(map(str, counts))
