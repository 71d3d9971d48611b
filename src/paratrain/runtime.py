"""The one place that reads the launch environment and owns the process group.

Every launcher (torchrun/`paratrain run`, `paratrain.launch`, Slurm's srun, plain `python`) describes
the job through environment variables; this module turns them into a `Placement` and starts or
stops the process group. Nothing else in paratrain reads `os.environ` for launch facts.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from .config import Accelerator, check_choice
from .errors import ParatrainError

if TYPE_CHECKING:  # imported where used: the CLI reads the environment and refuses bad flags without torch
    import torch
    import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    launcher: str = "python"
    """"torchrun" (also `paratrain run`), "launch" (`paratrain.launch`), "slurm" or "python"."""


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    """Leading integer of a variable; Slurm writes repeated counts like "4(x2)"."""
    match = re.match(r"\s*(\d+)", env.get(key) or "")
    return int(match.group(1)) if match else default


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as "gpu[01-04,07],cpu3" (what `scontrol show hostnames` gives first)."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        return nodelist
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def slurm_counts(text: str) -> list[int]:
    """Per-node counts from Slurm's compressed form: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


@dataclass(frozen=True)
class SlurmStep:
    """This process's place in a Slurm allocation. `step` is None outside `srun` (the batch script itself,
    an `salloc` shell): there one process runs on the first node, whatever the allocation's size."""

    job: int
    step: int | None
    node: int
    """SLURM_NODEID: this node's index among the step's nodes."""
    nodes: int
    first_host: str
    tasks_per_node: list[int]
    """Tasks srun started on each node of the step (empty outside srun)."""


def read_slurm(env: dict[str, str] | None = None) -> SlurmStep | None:
    env = dict(os.environ if env is None else env)
    if "SLURM_JOB_ID" not in env:
        return None
    in_step = "SLURM_STEP_ID" in env
    nodes = _int(env, "SLURM_STEP_NUM_NODES" if in_step else "SLURM_JOB_NUM_NODES", 0) or _int(env, "SLURM_NNODES", 1)
    nodelist = env.get("SLURM_STEP_NODELIST" if in_step else "SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    return SlurmStep(
        job=_int(env, "SLURM_JOB_ID", 0),
        step=_int(env, "SLURM_STEP_ID", 0) if in_step else None,
        node=_int(env, "SLURM_NODEID", 0),
        nodes=nodes,
        first_host=first_slurm_host(nodelist) if nodelist else "127.0.0.1",
        tasks_per_node=slurm_counts(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
        if in_step else [],
    )


def torchrun_variables(env: dict[str, str] | None = None) -> dict[str, str]:
    """torchrun's own settings (PET_NNODES, PET_NODE_RANK, ...: each flag's variable), without the prefix."""
    source = os.environ if env is None else env
    return {k[len("PET_"):]: v for k, v in source.items() if k.startswith("PET_")}


def slurm_port(job: int, step: int = 0) -> int:
    """The rendezvous port of a Slurm job step: the same on every node, different between most jobs and steps."""
    return 10000 + (job + 7919 * step) % 20000


def read_placement(env: dict[str, str] | None = None) -> Placement:
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else env.get("PARATRAIN_LAUNCHER", "env")
        return Placement(
            rank=_int(env, "RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
            node_rank=_int(env, "GROUP_RANK", 0),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 0) or None,
            launcher=launcher,
        )
    slurm = read_slurm(env)
    # Only srun's tasks are ranks: the batch script sees SLURM_NTASKS too, but runs once, on the first node.
    if slurm is not None and slurm.step is not None and _int(env, "SLURM_NTASKS", 1) > 1:
        on_node = slurm.tasks_per_node[slurm.node] if slurm.node < len(slurm.tasks_per_node) else 1
        return Placement(
            rank=_int(env, "SLURM_PROCID", 0),
            world_size=_int(env, "SLURM_NTASKS", 1),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            local_world_size=on_node,
            node_rank=slurm.node,
            master_addr=env.get("MASTER_ADDR") or slurm.first_host,
            master_port=_int(env, "MASTER_PORT", 0) or slurm_port(slurm.job, slurm.step),
            launcher="slurm",
        )
    return Placement()


@dataclass(frozen=True)
class ReplicaGroupLaunch:
    """This worker's replica group (`paratrain run --replica-groups R`): groups train the same model on their
    rows of each global batch and average gradients through a torchft lighthouse; each restarts on its own."""

    index: int
    count: int
    lighthouse: str
    """The lighthouse's address, http://HOST:PORT."""


def read_replica_group(env: Mapping[str, str] | None = None) -> ReplicaGroupLaunch | None:
    """The replica group `paratrain run` put this worker in (PARATRAIN_REPLICA_GROUP(S), PARATRAIN_LIGHTHOUSE)."""
    env = os.environ if env is None else env
    count = _int(env, "PARATRAIN_REPLICA_GROUPS", 0)
    if count < 1:
        return None
    index = _int(env, "PARATRAIN_REPLICA_GROUP", 0)
    lighthouse = env.get("PARATRAIN_LIGHTHOUSE", "")
    if not lighthouse or not 0 <= index < count:
        raise ParatrainError(
            f"PARATRAIN_REPLICA_GROUPS={count} needs PARATRAIN_REPLICA_GROUP in 0..{count - 1} (got {index}) and "
            f"PARATRAIN_LIGHTHOUSE (got {lighthouse!r}); start groups with `paratrain run --replica-groups`"
        )
    return ReplicaGroupLaunch(index, count, lighthouse)


def env_flag(name: str) -> str | None:
    """paratrain's own settings passed by its launchers (PARATRAIN_*)."""
    return os.environ.get(f"PARATRAIN_{name}")


def warm_modules() -> tuple[str, ...]:
    """Modules a warm template imports before forking `paratrain.launch` workers (PARATRAIN_WARM_WORKERS, a
    comma-separated list such as "torch,transformers"); empty: each worker starts as a new process."""
    return tuple(m.strip() for m in (env_flag("WARM_WORKERS") or "").split(",") if m.strip())


def default_timeout_s() -> float:
    value = env_flag("TIMEOUT")
    return float(value) if value else DEFAULT_TIMEOUT_S


_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Device nodes of NVIDIA, AMD (ROCm) and WSL GPUs: where none exists no GPU can be visible, and the CLI
need not import torch (seconds) to count zero."""


def cuda_count() -> int:
    if not any(os.path.exists(path) for path in _GPU_DEVICE_FILES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


DEFAULT_NPROC_TEXT = "one per visible GPU, or 1 on a machine without GPUs"
"""What `default_nproc` does, in words for `--help` and `paratrain doctor`."""


def default_nproc() -> int:
    """Workers per machine when none are asked for. On CPU, workers share the cores, and whether several
    beat one depends on the work per step (docs/benchmarks.md), so more than one is the user's choice."""
    return cuda_count() or 1


def pick_device(accelerator: str, local_rank: int, per_worker: int = 1) -> torch.device:
    """The first device of this worker: a worker owning `per_worker` GPUs (ddp+mp) starts at local_rank*k."""
    import torch
    if accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available()):
        n = cuda_count()
        if n == 0:
            raise ParatrainError("accelerator='cuda' but no CUDA GPU is visible; use accelerator='cpu'")
        first = local_rank * per_worker
        if first + per_worker > n:
            workers = max(1, n // per_worker)
            raise ParatrainError(
                f"local rank {local_rank} needs GPUs {first}..{first + per_worker - 1} but only {n} are visible "
                f"({per_worker} per worker). Start at most {workers} worker(s) per machine "
                f"(paratrain run --nproc {workers})"
            )
        torch.cuda.set_device(first)
        return torch.device("cuda", first)
    return torch.device("cpu")


def mp_devices(requested: list[str] | None, device: torch.device, gpus: int) -> list[torch.device]:
    """Stage devices of a one-process pipeline ("mp"): as requested; else every visible GPU (two stages on
    the one GPU when there is only one, the tutorials' split); on CPU two stages on "cpu"."""
    import torch
    if device.type != "cuda":
        return [torch.device("cpu")] * (len(requested) if requested else 2)
    if requested:
        return [torch.device(d) for d in requested]
    return [torch.device("cuda", i) for i in range(gpus)] if gpus > 1 else [device, device]


def worker_devices(per_worker: int, device: torch.device) -> list[torch.device]:
    """The devices a "ddp+mp" worker owns: `per_worker` GPUs from its first one (or "cpu" each)."""
    import torch
    if device.type != "cuda":
        return [torch.device("cpu")] * per_worker
    first = device.index or 0
    return [torch.device("cuda", first + i) for i in range(per_worker)]


def pick_backend(requested: str | None, device: torch.device) -> str:
    backend = requested or env_flag("BACKEND") or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ParatrainError("backend 'nccl' needs CUDA GPUs; on CPU use backend='gloo' (the default)")
    if backend not in ("gloo", "nccl", "mpi", "cpu:gloo,cuda:nccl"):
        raise ParatrainError(f"unknown backend {backend!r}; use gloo (CPU) or nccl (GPU)")
    return backend


def _store_for(placement: Placement, init: str | None, timeout: timedelta) -> dist.Store | None:
    """Build the rendezvous store ourselves so an unreachable master fails fast with a clear message."""
    import torch.distributed as dist
    init = init or env_flag("INIT")
    if init is not None:
        if init.startswith("file://"):
            return _file_store(init, placement.world_size)
        if init.startswith("tcp://"):
            host, _, port = init[len("tcp://") :].rpartition(":")
            return _tcp_store(host, int(port), placement, timeout)
        if init != "env://":
            raise ParatrainError(f"init {init!r} not understood; use env://, tcp://HOST:PORT or file:///PATH")
    if placement.world_size == 1 and placement.master_port is None:
        return dist.HashStore()
    if placement.launcher == "torchrun":
        return None  # torchrun hands its agent's store to env:// init
    if placement.master_port is None:
        raise ParatrainError("MASTER_PORT is not set; launch with `paratrain run` or set MASTER_ADDR/MASTER_PORT")
    return _tcp_store(placement.master_addr, placement.master_port, placement, timeout)


def connect_timeout_s() -> float:
    """Seconds to wait for a server this process needs (the master's store, a lighthouse) before failing."""
    value = env_flag("CONNECT_TIMEOUT")
    return float(value) if value else DEFAULT_CONNECT_TIMEOUT_S


_TCP_STORES: dict[tuple[str, int], dist.Store] = {}
_GENERATION = [0]


def _tcp_store(host: str, port: int, placement: Placement, timeout: timedelta) -> dist.Store:
    """One TCPStore per master address for the life of the process; each process group started on it
    gets its own key prefix, so a script may call setup()/close() several times."""
    import torch.distributed as dist
    key = (host, port)
    if key not in _TCP_STORES:
        _TCP_STORES[key] = _connect_tcp_store(host, port, placement, timeout)
    _GENERATION[0] += 1
    return dist.PrefixStore(f"paratrain/{_GENERATION[0]}", _TCP_STORES[key])


def _connect_tcp_store(host: str, port: int, placement: Placement, timeout: timedelta) -> dist.Store:
    import torch.distributed as dist
    connect = min(connect_timeout_s(), timeout.total_seconds())
    try:
        return dist.TCPStore(
            host,
            port,
            world_size=placement.world_size,
            is_master=placement.rank == 0 and not _launcher_hosts_store(host, port),
            timeout=timedelta(seconds=connect),
            wait_for_workers=False,
        )
    except Exception as exc:  # torch raises RuntimeError/DistNetworkError/TimeoutError here
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if placement.rank == 0:
            raise ParatrainError(
                f"rank 0 cannot listen on {host}:{port} ({text}); the port is probably in use: "
                "choose another MASTER_PORT / --master-port, or omit it to get a free one"
            ) from None
        raise ParatrainError(
            f"rank {placement.rank} cannot reach the master at {host}:{port} within {connect:.0f}s ({text}); "
            "start rank 0 first and check MASTER_ADDR/--master-addr and firewalls"
        ) from None


def _launcher_hosts_store(host: str, port: int) -> bool:
    """`paratrain.launch` (like torchrun's agent) hosts the store itself, so its port is never raced for; it
    says so the way torch's env:// init understands, and rank 0 then connects as a client too."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_ADDR") == host
            and os.environ.get("MASTER_PORT") == str(port))


def _file_store(init: str, world_size: int) -> dist.Store:
    """A stale file from a crashed run is told from live peers' by a lock; see `file_store`."""
    from . import file_store

    return file_store.open_store(file_store.path_of(init) or init, world_size)


def open_store(placement: Placement, init: str | None, timeout_s: float) -> dist.Store:
    """The rendezvous store the process group starts on, opened before it: the ranks agree on their setup
    through it first (`paratrain.agreement`), so a rank that refuses is not waited for in the group's rendezvous."""
    import torch.distributed as dist
    timeout = timedelta(seconds=timeout_s)
    store = _store_for(placement, init, timeout)
    if store is None:  # torchrun's agent store, reached as env:// init reaches it
        store, _, _ = next(dist.rendezvous("env://", placement.rank, placement.world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = dist.PrefixStore("default_pg", store)
    return store


def init_process_group(
    placement: Placement, backend: str, init: str | None, timeout_s: float, device: torch.device,
    store: dist.Store | None = None,
) -> None:
    """Start the default process group on `store` (`open_store`'s when None)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    if store is None:
        store = open_store(placement, init, timeout_s)
    kwargs: dict[str, object] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(store=store, rank=placement.rank, world_size=placement.world_size, **kwargs)  # type: ignore[arg-type]
    # gloo connects every pair during init, but a rank returns once its own pairs answer: one that then
    # fails fast (a refusal in prepare) and destroys the group can close a pair its peer is still reading
    # ("connectFullMesh failed ... Connection closed by peer"). Nobody leaves init before everyone has.
    dist.barrier()


def destroy_process_group() -> None:
    """Ends the process group. Models wrapped in DDP that only a reference cycle keeps (a finished training
    function's run and model) are collected first: freed after the group, at interpreter exit, their
    reducer's gloo threads can outlive the runtime and abort the process ("terminate called without an
    active exception")."""
    import torch.distributed as dist

    writes = sys.modules.get("paratrain.checkpoint.background")
    if writes is not None:  # a checkpoint written in the background is published (or fails) before its group goes
        writes.finish_all()
    if dist.is_initialized():
        import gc

        from .collectives import settle

        try:
            settle()  # a step's loss reduction nobody read finishes before its group goes
        except Exception:  # noqa: BLE001 - a peer already gone: its error is reported elsewhere, not here
            pass
        gc.collect()
        dist.destroy_process_group()
    from . import file_store

    file_store.release()  # after the process group, so torch's FileStore has let go of its file first


def install_error_file_hook() -> None:
    """Record uncaught exceptions to torchrun's error file (what `@record` does) so the launcher names the rank.
    Under `paratrain run`, on the last attempt, a ParatrainError is then left for the launcher to print, once
    for all ranks that raised it (`launcher.failures`); other errors still print their traceback here."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or getattr(sys, "_paratrain_hook", False):
        return
    import json
    import time
    import traceback

    previous = sys.excepthook
    # The agent prints its summary only when it gives up; while restarts remain, an error is told here or never.
    last_attempt = _int(os.environ, "TORCHELASTIC_RESTART_COUNT", 0) >= _int(os.environ, "TORCHELASTIC_MAX_RESTARTS", 0)
    told_by_launcher = env_flag("REPORTS_FAILURES") == "1" and last_attempt

    def hook(kind, value, tb):  # type: ignore[no-untyped-def]
        # torch's ErrorHandler.record_exception reads the traceback from sys.exc_info(), which is empty in
        # an excepthook ("NoneType: None" in the launcher's summary); write the same record with the real one.
        try:
            record = {"message": {"message": f"{kind.__name__}: {value}", "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
                "timestamp": str(int(time.time())), "time": time.time()}}}
            with open(path, "w") as f:
                json.dump(record, f)
        except Exception:  # the launcher then reports the exit code; the traceback is printed here
            told = False
        else:
            told = told_by_launcher and isinstance(value, ParatrainError)
        if not told:
            previous(kind, value, tb)

    sys.excepthook = hook
    sys._paratrain_hook = True  # type: ignore[attr-defined]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_nproc(nproc: int, gpus: int, flag: str = "nproc", cpu_fix: str = "accelerator='cpu'") -> None:
    """One worker per GPU: more workers than visible GPUs would share devices (nccl refuses, or deadlocks)."""
    if nproc < 1:
        raise ParatrainError(f"{flag} must be >= 1, got {nproc}")
    if gpus and nproc > gpus:
        raise ParatrainError(
            f"{flag}={nproc} but only {gpus} GPU(s) are visible: one worker per GPU allows at most {flag}={gpus}; "
            f"use {flag}<={gpus}, or {cpu_fix} to run {nproc} CPU workers"
        )


def worker_count(nproc: int | None, accelerator: str) -> int:
    """How many workers a launch starts: as asked, else one per visible GPU, else 1; checked against the GPUs
    (none count with accelerator='cpu')."""
    check_choice("accelerator", accelerator, Accelerator)
    gpus = 0 if accelerator == "cpu" else cuda_count()
    if accelerator == "cuda" and not gpus:
        raise ParatrainError("accelerator='cuda' but no CUDA GPU is visible; use accelerator='cpu' (or 'auto')")
    nproc = nproc if nproc is not None else (gpus or 1)
    check_nproc(nproc, gpus)
    return nproc
