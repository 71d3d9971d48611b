"""The one typed description of a run; `paratrain.setup(**kwargs)` fills it and validates it once."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .errors import ParatrainError

Precision = Literal["32", "bf16", "16"]
_PRECISIONS = ("32", "bf16", "16")


@dataclass(kw_only=True)
class Config:
    strategy: str = "auto"
    """Name from the strategy registry: single, dp, ddp, fsdp, mp, pp, ddp+pp, ddp+mp; "auto" is single
    for one process and ddp for several."""
    precision: str = "32"
    """"32", "bf16" (autocast) or "16" (autocast with a GradScaler)."""
    accelerator: str = "auto"
    """"auto" (CUDA when present), "cpu" or "cuda"."""
    backend: str | None = None
    """Process-group backend; None picks nccl for CUDA, gloo otherwise."""
    init: str | None = None
    """Process-group init method: None (env/torchrun), "tcp://host:port" or "file:///path"."""
    timeout_s: float | None = None
    """Seconds any collective may wait before the run fails with the missing ranks named (default 600)."""
    seed: int = 0
    """Seed for model init (same on all ranks) and per-rank randomness (seed + rank)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step; gradients are synchronised only on the last."""
    checkpoint_dir: str | None = None
    """Directory for `save`/`load`; `load` resumes from its newest complete checkpoint."""
    keep_last: int = 3
    """Checkpoints kept in checkpoint_dir; older ones are removed after a successful save."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (data-parallel strategies)."""
    bucket_cap_mb: float | None = None
    """DDP gradient bucket size."""
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    comm_hook: str | None = None
    """DDP communication hook: None, "bf16" or "fp16" (gradient compression)."""
    devices: list[str] | None = None
    """Devices of the stages of a single-process model-parallel run (strategy "mp")."""
    devices_per_worker: int = 1
    """Devices each process owns ("ddp+mp")."""
    microbatches: int | str = 1
    """Micro-batches per step for pipelined strategies, or "auto" to measure and pick."""
    schedule: str = "1f1b"
    """Pipeline schedule for "pp": gpipe, 1f1b, interleaved-1f1b, zero-bubble."""
    balance: list[int] | str = "time"
    """Layers per stage, or "time"/"memory"/"equal" to balance automatically."""
    stages_per_worker: int = 1
    """Virtual pipeline stages per worker (interleaved schedules)."""
    pp_size: int | None = None
    """Pipeline stages in a hybrid ddp+pp mesh (default: world size for pp, 2 for ddp+pp)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Strategy-specific options not covered above."""

    def __post_init__(self) -> None:
        if self.precision not in _PRECISIONS:
            raise ParatrainError(
                f"precision {self.precision!r} is not supported; use one of {', '.join(_PRECISIONS)}"
            )
        if self.grad_accum < 1:
            raise ParatrainError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.accelerator not in ("auto", "cpu", "cuda"):
            raise ParatrainError(f"accelerator must be auto, cpu or cuda, got {self.accelerator!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ParatrainError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.keep_last < 1:
            raise ParatrainError(f"keep_last must be >= 1, got {self.keep_last}")


def make_config(kwargs: dict[str, Any]) -> Config:
    names = {f.name for f in fields(Config)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ParatrainError(f"unknown setup option(s) {unknown}; known options: {sorted(names)}")
    if "precision" in kwargs:
        kwargs = {**kwargs, "precision": str(kwargs["precision"])}
    return Config(**kwargs)
