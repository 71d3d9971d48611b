"""Launch-environment parsing and configuration checks (no processes)."""

from __future__ import annotations

import time

import pytest
import torch

import paratrain
from paratrain import ParatrainError
from paratrain.config import make_config
from paratrain.launcher import checks
from paratrain.runtime import (
    SlurmStep,
    first_slurm_host,
    pick_backend,
    read_placement,
    read_slurm,
    slurm_counts,
    slurm_port,
    torchrun_variables,
)


def test_torchrun_environment() -> None:
    p = read_placement({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
                        "TORCHELASTIC_RUN_ID": "x"})
    assert (p.rank, p.world_size, p.local_rank, p.node_rank, p.launcher) == (3, 4, 1, 1, "torchrun")


# What a real `srun -N2 -n4` task (rank 3, on the second node) and a real two-node batch script saw.
SRUN_TASK = {"SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NODELIST": "n[1-2]",
             "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
             "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "3,1",
             "SLURM_TASKS_PER_NODE": "3,1"}
BATCH_SCRIPT = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
                "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)"}


def test_slurm_environment() -> None:
    p = read_placement({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
                        "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1", "SLURM_JOB_ID": "1234",
                        "SLURM_STEP_NODELIST": "gpu[07-08]"})
    assert (p.rank, p.world_size, p.local_rank, p.master_addr, p.launcher) == (5, 8, 1, "gpu07", "slurm")
    assert p.local_world_size == 4
    assert p.master_port == 10000 + 1234


def test_srun_task_and_batch_script() -> None:
    p = read_placement(SRUN_TASK)
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size, p.node_rank) == (3, 4, 0, 1, 1)
    assert (p.master_addr, p.master_port, p.launcher) == ("n1", 10001, "slurm")
    # The batch script runs once, on the first node: one process, whatever --ntasks says (it used to wait
    # for 7 peers that never come).
    assert read_placement(BATCH_SCRIPT).world_size == 1
    step = read_slurm(SRUN_TASK)
    assert step == SlurmStep(job=1, step=0, node=1, nodes=2, first_host="n1", tasks_per_node=[3, 1])
    batch = read_slurm(BATCH_SCRIPT)
    assert batch is not None and (batch.step, batch.nodes, batch.tasks_per_node) == (None, 2, [])
    assert read_slurm({}) is None
    assert slurm_port(1, 0) == 10001 and slurm_port(1, 1) == 10000 + 7920 and slurm_port(25000) == 15000


@pytest.mark.parametrize("text,counts", [("1(x2)", [1, 1]), ("3,1", [3, 1]), ("2(x3),1", [2, 2, 2, 1]), ("", [])])
def test_slurm_counts(text: str, counts: list[int]) -> None:
    assert slurm_counts(text) == counts


def test_torchrun_variables() -> None:
    assert torchrun_variables({"PET_NNODES": "2", "NNODES": "9", "PET_NODE_RANK": "1"}) == {"NNODES": "2",
                                                                                         "NODE_RANK": "1"}


def test_plain_python_is_one_process() -> None:
    assert read_placement({}).world_size == 1


@pytest.mark.parametrize("nodes,first", [("n1", "n1"), ("a[3-5]", "a3"), ("gpu[01,04]x", "gpu01"), ("h1,h2", "h1")])
def test_slurm_nodelist(nodes: str, first: str) -> None:
    assert first_slurm_host(nodes) == first


def _fails_fast(match: str, fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(ParatrainError, match=match):
        fn(*args, **kwargs)
    assert time.monotonic() - start < 30  # the slow ways are the 60 s connect and rendezvous timeouts


def test_bad_setup_options_name_the_fix() -> None:
    _fails_fast("unknown strategy 'dpx'. Did you mean .* Choose one of: .*ddp", paratrain.setup, strategy="dpx")
    _fails_fast("needs CUDA GPUs.*strategy='ddp'", paratrain.setup, strategy="dp")
    _fails_fast("precision", make_config, {"precision": "8"})
    _fails_fast("unknown setup option", make_config, {"stratgy": "ddp"})
    _fails_fast("nccl.*needs CUDA", pick_backend, "nccl", torch.device("cpu"))


def test_global_batch_must_split_over_workers() -> None:
    run = paratrain.setup(strategy="single", grad_accum=2)
    assert run.per_worker_batch(8) == 4
    _fails_fast("global batch 3 .* 2 parts", run.per_worker_batch, 3)
    _fails_fast("global batch 1 ", run.per_worker_batch, 1)


def test_launch_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = checks.LaunchSpec(nproc=1, max_nodes=2, node_rank=2, master_port=1234)
    _fails_fast("node-rank 2 is out of range", checks.check, spec)
    _fails_fast("backend nccl needs CUDA", checks.check, checks.LaunchSpec(nproc=1, backend="nccl"))
    _fails_fast("multi-node run needs --master-port", checks.check, checks.LaunchSpec(nproc=1, max_nodes=2))
    _fails_fast("--nnodes", checks.parse_nnodes, "3:1")
    monkeypatch.setattr(checks, "cuda_count", lambda: 2)
    _fails_fast("--nproc=4 but only 2 GPU", checks.check, checks.LaunchSpec(nproc=4))
