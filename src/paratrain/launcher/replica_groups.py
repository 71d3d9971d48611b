"""`paratrain run --replica-groups R`: R copies of a job that survive each other's failures.

Each replica group is an ordinary `paratrain run` (torchrun's agent, its own rendezvous and port, its own
`--max-restarts`), training the whole model (laid out over its workers: ddp, fsdp, tp, pp) on its rows of every
global batch. Between groups, a torchft
lighthouse says each step which groups are alive; their gradients are averaged over those (faults/replica_groups).
A group that dies is restarted by its own agent while the others keep training; it rejoins by copying the state
of a live group, so a lost worker costs seconds of one group, not a restart of the job from a checkpoint.

    paratrain run --replica-groups 2 --nproc N          one machine: this process
      ├── lighthouse (torchft's, loopback, free port)     holds no training state
      ├── paratrain run --replica-group 0 ... ──▶ agent ──▶ N workers
      └── paratrain run --replica-group 1 ... ──▶ agent ──▶ N workers

On a cluster each group is started where it runs (`--replica-group I --lighthouse HOST:PORT`, one Slurm job
step or Kubernetes job per group) and `paratrain lighthouse` serves the lighthouse.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from ..errors import ParatrainError
from . import _lifeline, lighthouse
from ._procs import _pump
from .checks import LaunchSpec


def check(spec: LaunchSpec) -> None:
    """Refuse replica-group flags that cannot work, before torch is imported."""
    if spec.replica_groups < 1:
        raise ParatrainError(f"--replica-groups {spec.replica_groups}: use 1 or more groups")
    lighthouse.require_torchft(f"--replica-groups {spec.replica_groups}")
    if spec.replica_group is not None and not 0 <= spec.replica_group < spec.replica_groups:
        raise ParatrainError(f"--replica-group {spec.replica_group} is out of range for --replica-groups "
                             f"{spec.replica_groups}: groups are 0..{spec.replica_groups - 1}")
    if spec.replica_group is not None and spec.lighthouse is None:
        raise ParatrainError(f"--replica-group {spec.replica_group} needs --lighthouse HOST:PORT (start one with "
                             "`paratrain lighthouse --port PORT`), or omit --replica-group to start every group here")
    if spec.replica_group is None and spec.max_nodes > 1:
        raise ParatrainError(
            f"--replica-groups {spec.replica_groups} over {spec.max_nodes} nodes: start each group where it runs "
            "with --replica-group I --lighthouse HOST:PORT (docs/fault-tolerance.md#replica-groups)")
    if spec.init:
        raise ParatrainError(f"--init {spec.init} cannot be combined with --replica-groups: every group needs a "
                             "rendezvous of its own; drop --init")
    if spec.lighthouse is not None:
        lighthouse.normalize(spec.lighthouse)


def worker_env(spec: LaunchSpec) -> dict[str, str]:
    """What tells a worker its group (read by `runtime.read_replica_group`)."""
    if spec.replica_group is None or spec.lighthouse is None:
        return {}
    return {"PARATRAIN_REPLICA_GROUP": str(spec.replica_group), "PARATRAIN_REPLICA_GROUPS": str(spec.replica_groups),
            "PARATRAIN_LIGHTHOUSE": lighthouse.normalize(spec.lighthouse),
            "RUST_LOG": os.environ.get("RUST_LOG", "warn")}  # torchft's manager logs every step at INFO


def group_command(spec: LaunchSpec, group: int, address: str, script: str, script_args: list[str]) -> list[str]:
    """One group's `paratrain run`, with the flags that apply to each group."""
    flags = [f"--nproc={spec.nproc}", f"--max-restarts={spec.max_restarts}", f"--replica-group={group}",
             f"--replica-groups={spec.replica_groups}", f"--lighthouse={address}",
             f"--connect-timeout={spec.connect_timeout:g}"]
    if spec.backend:
        flags.append(f"--backend={spec.backend}")
    if spec.timeout:
        flags.append(f"--timeout={spec.timeout:g}")
    return [sys.executable, "-m", "paratrain.cli", "run", *flags, script, *script_args]


def run_all(spec: LaunchSpec, script: str, script_args: list[str], dry_run: bool = False) -> int:
    """Start the lighthouse (unless given) and every group on this machine; exit 0 when every group finished."""
    check(spec)
    if dry_run:
        address = spec.lighthouse or "127.0.0.1:PORT"
        lines = [f"# paratrain run would start a lighthouse on {address} (unless given) and {spec.replica_groups} "
                 "replica groups:"]
        lines += [shlex.join(group_command(spec, g, address, script, script_args))
                  for g in range(spec.replica_groups)]
        print("\n".join(lines), flush=True)
        return 0
    own = None
    if spec.lighthouse is None:
        own = lighthouse.start("127.0.0.1", 0, min_groups=1)
        address = own.address.removeprefix("http://")
    else:
        address = lighthouse.normalize(spec.lighthouse).removeprefix("http://")
        lighthouse.wait_until_reachable(address, spec.connect_timeout)
    try:
        return _supervise(spec, address, script, script_args)
    finally:
        if own is not None:
            own.shutdown()


def _supervise(spec: LaunchSpec, address: str, script: str, script_args: list[str]) -> int:
    env = {**os.environ, _lifeline.AGENT_VARIABLE: str(os.getpid())}  # each group's launcher dies with this one
    groups: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    stopped: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopped.append(signum)
        for proc in groups:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # its agent passes it on to the workers and waits for them

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for group in range(spec.replica_groups):
            argv = group_command(spec, group, address, script, script_args)
            proc = subprocess.Popen([argv[0], "-u", _lifeline.ENTRY, *argv[1:]], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            groups.append(proc)
            for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                assert stream is not None
                pump = threading.Thread(target=_pump, args=(stream, name, f"[group{group}] "), daemon=True)
                pump.start()
                pumps.append(pump)
        told: set[int] = set()
        while any(p.poll() is None for p in groups):
            for group, proc in enumerate(groups):
                code = proc.poll()
                if code not in (None, 0) and group not in told and not stopped:
                    told.add(group)
                    print(f"paratrain run: replica group {group} ended with code {code} (its restarts used up); "
                          "the other groups train on", flush=True)
            time.sleep(0.1)
    finally:
        for proc in groups:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in groups:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pump in pumps:
            pump.join(timeout=2)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped:
        return 128 + stopped[0]
    codes = [p.returncode for p in groups]
    failed = [g for g, c in enumerate(codes) if c != 0]
    if failed:
        print(f"paratrain run: replica group(s) {', '.join(map(str, failed))} of {len(groups)} failed "
              f"(codes {', '.join(str(codes[g]) for g in failed)})", flush=True)
        return 1
    return 0
