"""Launch input checked before any worker starts, so mistakes fail in a second with the fix named."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from ..errors import ParatrainError
from ..runtime import check_nproc, cuda_count, port_is_free


@dataclass(kw_only=True)
class LaunchSpec:
    nproc: int
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    """Node 0 hosts the rendezvous store; the c10d rendezvous numbers the nodes itself."""
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    backend: str | None = None
    init: str | None = None
    connect_timeout: float = 60.0
    timeout: float | None = None
    """Collective timeout passed to workers (seconds)."""
    run_id: str = "paratrain"
    origin: str = ""
    """Where the node fields came from when not from flags (a Slurm job step), for --dry-run."""
    replica_groups: int = 0
    """R > 0: the job is R replica groups averaging gradients through a torchft lighthouse (launcher/replica_groups)."""
    replica_group: int | None = None
    """This launcher's group (0..R-1); None with R > 0: start all R groups on this machine."""
    lighthouse: str | None = None
    """The lighthouse's HOST:PORT; None on one machine: `paratrain run` starts one."""


def parse_nnodes(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ParatrainError(f"--nnodes {text!r}: use a number N or a range MIN:MAX") from None
    if not 1 <= low <= high:
        raise ParatrainError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return low, high


def check(spec: LaunchSpec, reach_master: bool = True) -> None:
    """Refuse bad input; with `reach_master`, also wait (up to --connect-timeout) for node 0's store."""
    gpus = cuda_count()
    check_nproc(spec.nproc, gpus, "--nproc", "hide the GPUs (CUDA_VISIBLE_DEVICES=)")
    if spec.backend == "nccl" and not gpus:
        raise ParatrainError("--backend nccl needs CUDA GPUs and none are visible; use --backend gloo on CPU")
    if spec.backend not in (None, "gloo", "nccl"):
        raise ParatrainError(f"--backend {spec.backend!r}: use gloo (CPU) or nccl (GPU)")
    if not 0 <= spec.node_rank < spec.max_nodes:
        raise ParatrainError(
            f"--node-rank {spec.node_rank} is out of range for --nnodes {spec.max_nodes}: "
            f"node ranks are 0..{spec.max_nodes - 1}"
        )
    multi = spec.max_nodes > 1
    if multi and spec.master_port is None:
        raise ParatrainError("a multi-node run needs --master-port (the same on every node) and --master-addr")
    hosts_store = spec.node_rank == 0  # told so (is_host): waiting for its own store would never end
    local = hosts_store and _is_local(spec.master_addr)
    if spec.master_port is not None and local and not port_is_free(spec.master_port, _bind_addr(spec)):
        raise ParatrainError(
            f"--master-port {spec.master_port} is already in use on this machine; choose another port "
            "(or omit --master-port on a single machine to get a free one)"
        )
    if multi and not hosts_store and reach_master:
        wait_for_master(spec.master_addr, spec.master_port or 0, spec.connect_timeout)


def _bind_addr(spec: LaunchSpec) -> str:
    return "0.0.0.0" if spec.master_addr not in ("127.0.0.1", "localhost") else "127.0.0.1"


def _is_local(addr: str) -> bool:
    if addr in ("127.0.0.1", "localhost", "::1"):
        return True
    try:
        return socket.gethostbyname(addr) in ("127.0.0.1", socket.gethostbyname(socket.gethostname()))
    except OSError:
        return False


def wait_for_master(addr: str, port: int, timeout: float) -> None:
    """Block until the master's rendezvous port accepts connections, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, timeout)):
                return
        except OSError as exc:
            last = exc
            time.sleep(0.2)
    raise ParatrainError(
        f"cannot reach the master at {addr}:{port} within {timeout:.0f}s ({last}); start node 0 first, and "
        "check --master-addr/--master-port and firewalls (or raise --connect-timeout)"
    )
