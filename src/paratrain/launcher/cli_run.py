"""`paratrain run`: torchrun's elastic agent with paratrain's defaults and up-front checks.

The agent (rendezvous, restarts, error files) is torch's own: we translate flags into a
`torch.distributed.run` invocation. What we add is the layer users trip over: a free port when none
is given, one thread per CPU worker, a deterministic store host for multi-node runs on one machine,
and clear errors before anything starts.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from typing import TYPE_CHECKING

from .. import file_store
from ..errors import ParatrainError
from ..runtime import cuda_count, torchrun_variables, warm_modules
from . import _lifeline, _warm_run, lighthouse, replica_groups
from .checks import LaunchSpec, check
from .cluster import TORCHRUN_VARIABLES
from .failures import Failure, describe

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

_CONSUMED = [*TORCHRUN_VARIABLES, "RDZV_ENDPOINT"]
"""torchrun's variables that `cluster.from_torchrun` turned into flags."""

_LAST_CALL_S = 3
"""Seconds an elastic rendezvous waits for more nodes once --nnodes MIN have joined."""


def torchrun_args(spec: LaunchSpec, script: str, script_args: list[str]) -> list[str]:
    nodes = f"{spec.min_nodes}:{spec.max_nodes}" if spec.min_nodes != spec.max_nodes else str(spec.max_nodes)
    args = [f"--nproc-per-node={spec.nproc}", f"--nnodes={nodes}", f"--max-restarts={spec.max_restarts}"]
    if spec.max_nodes == 1 and spec.master_port is None:
        args.append("--standalone")
    else:
        endpoint = f"{spec.master_addr}:{spec.master_port}"
        conf = [f"is_host={str(spec.node_rank == 0).lower()}", f"join_timeout={int(max(spec.connect_timeout, 30))}"]
        if spec.min_nodes != spec.max_nodes:
            # torch's defaults (a lost node noticed after 3 x 5 s keep-alives, then 30 s of "last call" for
            # more nodes) make every elastic restart cost ~45 s; a few seconds suit jobs of a few nodes.
            conf += [f"last_call_timeout={_LAST_CALL_S}", "keep_alive_interval=1", "keep_alive_max_attempt=3"]
        # No --node-rank: the c10d rendezvous numbers the nodes itself, and torch warns that it ignores one.
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={spec.run_id}",
                 f"--rdzv-conf={','.join(conf)}"]
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
    env["PARATRAIN_REPORTS_FAILURES"] = "1"  # a worker's ParatrainError is printed once, in our summary
    # torchrun shares its rendezvous TCPStore with the workers by default, without a per-restart key
    # prefix: restarted workers then read the previous generation's gloo/NCCL addresses and fail to
    # connect or hang (pytorch/pytorch#135712). A fresh store per rendezvous round keeps restarts clean.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.update(replica_groups.worker_env(spec))
    return env


def check_init(spec: LaunchSpec) -> None:
    """A bad `--init` fails here, once, instead of in every worker after torch has been imported N times."""
    if not spec.init:
        return
    if not spec.init.startswith(("file://", "tcp://", "env://")):
        raise ParatrainError(f"--init {spec.init!r} not understood; use file:///PATH, tcp://HOST:PORT or env://")
    store_path = file_store.path_of(spec.init)
    if store_path is None:
        return
    if spec.max_restarts:
        raise ParatrainError(
            f"--init {spec.init} cannot be combined with --max-restarts {spec.max_restarts}: restarted workers "
            "would find the store file of the workers that failed; drop --init to use the agent's TCP store"
        )
    # Other nodes' workers may already be using the file in a multi-node run: only a dead run's file is refused.
    file_store.preflight(store_path, expect_idle=False)


def run(spec: LaunchSpec, script: str, script_args: list[str], dry_run: bool = False) -> int:
    if not os.path.exists(script):
        raise ParatrainError(f"script {script!r} not found")
    if spec.replica_groups and spec.replica_group is None:  # every group on this machine, each its own agent
        return replica_groups.run_all(spec, script, script_args, dry_run)
    if spec.replica_groups:
        replica_groups.check(spec)
    check(spec, reach_master=False)  # bad input refused before torch is imported
    check_init(spec)
    if spec.lighthouse is not None and not dry_run:
        lighthouse.wait_until_reachable(spec.lighthouse, spec.connect_timeout)
    if not dry_run:
        # torch (seconds) before waiting for node 0: once node 0's store is up, this node joins at once
        # instead of after an import that an elastic rendezvous's last call (3 s) may not wait for
        import torch.distributed.run  # noqa: F401

        check(spec, reach_master=True)
    if dry_run:
        print(dry_run_text(spec, script, script_args), flush=True)
        return 0
    os.environ.update(worker_env(spec))
    # Each worker is tied to this process (the agent) and dies with it, even by SIGKILL (see `_lifeline`); a
    # script that must signal its launcher reads the variable, since a warm worker's parent is its template.
    os.environ[_lifeline.AGENT_VARIABLE] = str(os.getpid())
    for name in _CONSUMED:
        # Now flags: torchrun's parser would read them again (PET_NODE_RANK, which c10d ignores with a warning).
        os.environ.pop(f"PET_{name}", None)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    warm = _warm_run.start(warm_modules())
    if warm is not None:  # the agent starts a small client per worker; the client has the worker forked
        os.environ[_warm_run.SOCKET_VARIABLE] = warm.path
        script, script_args = _warm_run.CLIENT, [script, *script_args]
    else:  # the agent starts a small program per worker that ties itself to the agent, then execs the script
        script, script_args = _lifeline.ENTRY, [script, *script_args]
    args = torchrun.parse_args(torchrun_args(spec, script, script_args))
    try:
        torchrun.run(args)
    except SignalException as exc:  # preempted: the agent has passed the signal on and waited for the workers
        print(f"paratrain run: stopped by signal {exc.sigval.name}; workers that poll run.should_stop saved a "
              "checkpoint first", flush=True)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        world = spec.nproc * spec.max_nodes if spec.min_nodes == spec.max_nodes else None
        print(f"paratrain run: {describe(map(_failure, exc.failures.items()), world)}", flush=True)
        return 1
    finally:
        if warm is not None:
            warm.close()
    return 0


def dry_run_text(spec: LaunchSpec, script: str, script_args: list[str]) -> str:
    """The exact agent invocation, as a command to paste into a shell; the rest of the environment is inherited."""
    present = torchrun_variables()
    unset = [arg for name in _CONSUMED if name in present for arg in ("-u", f"PET_{name}")]
    env = [f"{k}={v}" for k, v in sorted(worker_env(spec).items())]
    agent = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(spec, script, script_args)]
    command = ["env", *unset, *env, *agent]
    where = f" ({spec.origin})" if spec.origin else ""
    return f"# paratrain run would start{where}:\n{shlex.join(command)}"


def _failure(item: tuple[int, ProcessFailure]) -> Failure:
    """One rank's report from torchrun's error file (see `runtime.install_error_file_hook`), else its exit code."""
    rank, failure = item
    data = failure.error_file_data.get("message")
    if isinstance(data, dict):
        extra = data.get("extraInfo", {})
        when = float(extra.get("time", extra.get("timestamp", failure.timestamp)))
        return Failure(rank, str(data.get("message")), str(extra.get("py_callstack") or data.get("message")), when)
    if failure.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM):  # the agent ends the others after a failure
        ended = "stopped by the launcher after the first failure (SIGTERM)"
    elif failure.exitcode < 0:
        ended = f"ended by signal {failure.signal_name()} without a Python error"
    else:
        ended = f"exited with code {failure.exitcode} without a Python error"
    return Failure(rank, ended, ended, float(failure.timestamp))

