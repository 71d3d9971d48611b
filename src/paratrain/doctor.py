"""`paratrain doctor`: what this machine offers for distributed training, and one-line fixes for problems."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .runtime import DEFAULT_NPROC_TEXT, default_nproc, port_is_free

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


@dataclass
class Finding:
    name: str
    value: str
    problem: str | None = None
    """One-line fix when this finding is a problem."""


def examine(master_port: int = 29500) -> list[Finding]:
    found = [
        Finding("python", platform.python_version()),
        Finding("torch", torch.__version__),
        Finding("cpu cores", str(os.cpu_count())),
    ]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) or "none"
    found.append(Finding("cuda gpus", f"{gpus} ({names})"))
    if not dist.is_available():
        found.append(Finding("torch.distributed", "missing", "install a torch build with distributed support"))
        return found
    gloo = dist.is_gloo_available()
    found.append(Finding("gloo", str(gloo), None if gloo else "install a torch build with gloo (CPU workers need it)"))
    nccl = dist.is_nccl_available()
    nccl_text = f"{nccl} (version {'.'.join(map(str, torch.cuda.nccl.version()))})" if nccl and gpus else str(nccl)
    nccl_fix = "install a CUDA build of torch for GPU workers" if gpus and not nccl else None
    found.append(Finding("nccl", nccl_text, nccl_fix))
    found.append(Finding("ddp backend", "nccl" if gpus else "gloo"))
    default = f"{default_nproc()} per machine ({DEFAULT_NPROC_TEXT}; --nproc N to change)"
    found.append(Finding("default workers", default))
    for var in _LAUNCH_VARS:
        if var in os.environ:
            found.append(Finding(f"env {var}", os.environ[var]))
    threads = os.environ.get("OMP_NUM_THREADS")
    workers = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if threads and not gpus and int(threads) * workers > (os.cpu_count() or 1):
        found.append(Finding("threads", threads, "set OMP_NUM_THREADS=1 for CPU workers (paratrain run does)"))
    port_free = port_is_free(master_port)
    found.append(Finding(f"port {master_port}", "free" if port_free else "in use",
                         None if port_free else "pass --master-port with a free port, or omit it to get one"))
    return found


def report(master_port: int = 29500) -> int:
    findings = examine(master_port)
    width = max(len(f.name) for f in findings)
    for f in findings:
        print(f"{f.name:<{width}}  {f.value}")
    problems = [f for f in findings if f.problem]
    for f in problems:
        print(f"PROBLEM {f.name}: {f.problem}")
    print("ok: nothing to fix" if not problems else f"{len(problems)} problem(s) found")
    return 1 if problems else 0
