"""`paratrain run`: torchrun's elastic agent with paratrain's defaults and up-front checks.

The agent (rendezvous, restarts, error files) is torch's own: we translate flags into a
`torch.distributed.run` invocation. What we add is the layer users trip over: a free port when none
is given, one thread per CPU worker, a deterministic store host for multi-node runs on one machine,
and clear errors before anything starts.
"""

from __future__ import annotations

import os
import uuid

from ..errors import ParatrainError
from ..runtime import cuda_count
from .checks import LaunchSpec, check


def torchrun_args(spec: LaunchSpec, script: str, script_args: list[str]) -> list[str]:
    nodes = f"{spec.min_nodes}:{spec.max_nodes}" if spec.min_nodes != spec.max_nodes else str(spec.max_nodes)
    args = [f"--nproc-per-node={spec.nproc}", f"--nnodes={nodes}", f"--max-restarts={spec.max_restarts}"]
    if spec.max_nodes == 1 and spec.master_port is None:
        args.append("--standalone")
    else:
        endpoint = f"{spec.master_addr}:{spec.master_port}"
        conf = [f"is_host={str(spec.node_rank == 0).lower()}", f"join_timeout={int(max(spec.connect_timeout, 30))}"]
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={spec.run_id}",
                 f"--rdzv-conf={','.join(conf)}", f"--node-rank={spec.node_rank}"]
        if spec.min_nodes != spec.max_nodes:
            args.append("--monitor-interval=0.5")
    return args + [script, *script_args]


def worker_env(spec: LaunchSpec) -> dict[str, str]:
    env: dict[str, str] = {}
    if not cuda_count():
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    if spec.backend:
        env["PARATRAIN_BACKEND"] = spec.backend
    if spec.init:
        env["PARATRAIN_INIT"] = spec.init
    if spec.timeout:
        env["PARATRAIN_TIMEOUT"] = str(spec.timeout)
    env["PARATRAIN_CONNECT_TIMEOUT"] = str(spec.connect_timeout)
    return env


def run(spec: LaunchSpec, script: str, script_args: list[str]) -> int:
    check(spec)
    if not os.path.exists(script):
        raise ParatrainError(f"script {script!r} not found")
    os.environ.update(worker_env(spec))
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(torchrun_args(spec, script, script_args))
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        failures = exc.failures
        ranks = sorted(failures)
        print(f"paratrain run: worker rank(s) {ranks} failed; first failure:\n{exc.format_msg()}", flush=True)
        return 1
    return 0


def new_run_id() -> str:
    return uuid.uuid4().hex[:8]
