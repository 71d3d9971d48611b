"""Where `paratrain run`'s node flags come from (tier 1, no processes): the typed flag, else torchrun's PET_*
variable, else the Slurm job step, else one machine; launches that would split into separate jobs are refused.
The same rules on a real Slurm: tests/test_slurm.py."""

from __future__ import annotations

import pytest

from paratrain import ParatrainError
from paratrain.launcher.checks import LaunchSpec
from paratrain.launcher.cli_run import torchrun_args
from paratrain.launcher.cluster import NodeFlags, from_torchrun, resolve
from paratrain.runtime import SlurmStep, slurm_port

NONE = NodeFlags()
TWO_NODES = SlurmStep(job=42, step=1, node=1, nodes=2, first_host="gpu07", tasks_per_node=[1, 1])


def _spec(typed: NodeFlags = NONE, torchrun: NodeFlags = NONE, step: SlurmStep | None = None) -> LaunchSpec:
    return resolve(LaunchSpec(nproc=1), typed, torchrun, step)


def test_one_machine_without_flags() -> None:
    spec = _spec()
    assert (spec.min_nodes, spec.max_nodes, spec.master_port, spec.run_id) == (1, 1, None, "paratrain")
    assert "--standalone" in torchrun_args(spec, "train.py", [])


def test_slurm_step_gives_one_job_over_its_nodes() -> None:
    spec = _spec(step=TWO_NODES)
    assert (spec.max_nodes, spec.node_rank, spec.master_addr) == (2, 1, "gpu07")
    assert (spec.master_port, spec.run_id) == (slurm_port(42, 1), "slurm-42.1")
    assert spec.origin == "Slurm job 42 step 1: node 1 of 2"
    args = torchrun_args(spec, "train.py", [])
    assert f"--rdzv-endpoint=gpu07:{slurm_port(42, 1)}" in args and "--rdzv-id=slurm-42.1" in args
    assert not any(a.startswith("--node-rank") for a in args)  # c10d numbers the nodes; torch would warn
    assert "--rdzv-conf=is_host=false,join_timeout=60" in args  # node 1 does not host the store
    first = resolve(LaunchSpec(nproc=1), NONE, NONE, SlurmStep(42, 1, 0, 2, "gpu07", [1, 1]))
    assert "--rdzv-conf=is_host=true,join_timeout=60" in torchrun_args(first, "train.py", [])


def test_typed_flags_win_then_torchrun_variables() -> None:
    typed = NodeFlags(nnodes="1:2", master_port=29500, max_restarts=3)
    spec = _spec(typed, NodeFlags(master_port=1, run_id="pet", nproc=4), TWO_NODES)
    assert (spec.min_nodes, spec.max_nodes, spec.max_restarts) == (1, 2, 3)
    assert (spec.master_port, spec.run_id, spec.nproc, spec.master_addr) == (29500, "pet", 4, "gpu07")
    # one Slurm node with no flags: a plain one-machine run on a free port
    assert _spec(step=SlurmStep(7, 0, 0, 1, "n1", [1])).master_port is None


def test_torchrun_variables_as_kubernetes_sets_them() -> None:
    pet = from_torchrun({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456",
                         "NPROC_PER_NODE": "4"})
    spec = _spec(torchrun=pet)
    assert (spec.max_nodes, spec.node_rank, spec.master_addr, spec.master_port, spec.nproc) == (
        2, 1, "train-master-0", 23456, 4)
    assert spec.origin == "PET_NPROC_PER_NODE, PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT from " \
                          "the environment"
    elastic = from_torchrun({"RDZV_ENDPOINT": "head:29400", "RDZV_ID": "job7", "NNODES": "1:4",
                             "NPROC_PER_NODE": "auto"})
    assert elastic == NodeFlags(nnodes="1:4", master_addr="head", master_port=29400, run_id="job7")
    with pytest.raises(ParatrainError, match="PET_NODE_RANK='one' is not a number; fix or unset it"):
        from_torchrun({"NODE_RANK": "one"})


def test_launches_that_would_split_the_job_are_refused() -> None:
    crowded = SlurmStep(job=5, step=0, node=0, nodes=2, first_host="n1", tasks_per_node=[2, 2])
    with pytest.raises(ParatrainError, match=r"srun started 4 copies of paratrain run on 2 node\(s\) \(2 per node\) "
                       r"in Slurm job 5.*srun --ntasks-per-node=1 paratrain run \[--nproc N\] SCRIPT"):
        _spec(step=crowded)
    with pytest.raises(ParatrainError, match=r"\(per node: 3, 1\)"):
        _spec(step=SlurmStep(5, 0, 0, 2, "n1", [3, 1]))
    batch = SlurmStep(job=6, step=None, node=0, nodes=2, first_host="n1", tasks_per_node=[])
    with pytest.raises(ParatrainError, match="batch script of Slurm job 6, which runs on the first of its 2 nodes"):
        _spec(step=batch)
    # told what to do, each is honoured
    assert _spec(NodeFlags(nnodes="1"), step=batch).max_nodes == 1
    assert _spec(NodeFlags(nnodes="4", node_rank=2), step=crowded).node_rank == 2


def test_failures_are_told_once_per_distinct_error() -> None:
    from paratrain.launcher.failures import Failure, describe

    same = "ParatrainError: global batch 2 cannot be split"
    text = describe([Failure(2, same, f"Traceback 2\n{same}", 1.2), Failure(0, same, f"Traceback 0\n{same}", 1.0),
                     Failure(1, "RuntimeError: peer gone", "Traceback 1\nRuntimeError: peer gone", 1.5)], 3)
    assert text == (f"worker ranks 0, 2 of 3 failed with the same error:\nTraceback 0\n{same}\n"
                    "then rank 1 failed:\nTraceback 1\nRuntimeError: peer gone")
    stopped = "stopped by the launcher after the first failure (SIGTERM)"
    assert describe([Failure(1, "E: x", "Traceback\nE: x", 1.0), Failure(0, stopped, stopped, 2.0)]) == (
        f"worker rank 1 failed:\nTraceback\nE: x\nthen rank 0: {stopped}")
