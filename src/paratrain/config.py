"""The one typed description of a run; `paratrain.setup(**kwargs)` fills it and `validate` checks it once.

Every option that names one of a fixed set of choices is a `Literal`, and `validate` is the only place
that checks values and their combinations (in the manner of torchtitan's `ParallelDims._validate`,
but raising `ParatrainError` with the arithmetic and the fix instead of asserting). Checks that need
the job itself (world size, GPUs) belong to each strategy's `check`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from .errors import ParatrainError, unknown_name

StrategyName = Literal["auto", "single", "dp", "ddp", "fsdp", "mp", "pp", "ddp+pp", "ddp+mp"]
Precision = Literal["32", "bf16", "16"]
Accelerator = Literal["auto", "cpu", "cuda"]
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "auto"]
BalanceMode = Literal["time", "memory", "equal"]
CommHook = Literal["auto", "bf16", "fp16", "powersgd"]
BatchNormMode = Literal["exact", "local"]
ActivationCheckpointing = Literal["none", "selective", "full"]
LossKind = Literal["any", "token_mean"]

STRATEGY_NAMES: tuple[str, ...] = get_args(StrategyName)[1:]
"""Every strategy, in the order documentation lists them ("auto" is not one: it picks one)."""
SCHEDULES: tuple[str, ...] = get_args(Schedule)
BALANCE_MODES: tuple[str, ...] = get_args(BalanceMode)


@dataclass(kw_only=True)
class Config:
    strategy: StrategyName | str = "auto"
    """single, dp, ddp, fsdp, mp, pp, ddp+pp or ddp+mp, or an N-D set such as "fsdp+tp" (any '+'-joined set of
    ddp, fsdp, tp, pp; parallel/dims.py); "auto" is single for one process, and for several ddp, or the
    planner's fastest layout for this world when `run.prepare` is given an example batch (docs/plan.md)."""
    auto_pipelines: bool = False
    """strategy="auto" also weighs pipeline layouts (pp, ddp+pp, tp+pp): the loop must step with
    `run.forward_backward`, since a pipeline cannot run a loop that calls `model(x)` and `run.backward` itself."""
    precision: Precision = "32"
    """"32", "bf16" (autocast) or "16" (autocast with a GradScaler)."""
    accelerator: Accelerator = "auto"
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
    async_save: bool = True
    """`run.save` returns once the state is copied to CPU memory and the checkpoint is written and published in the
    background (checkpoint/background.py); False: it returns when the checkpoint is published."""
    log_dir: str | None = None
    """Where rank 0's `run.log` writes metrics.jsonl and TensorBoard event files; None: <checkpoint_dir>/logs
    (so a resumed run continues its logs), or runs/<date>-<time> without a checkpoint_dir. Made at the first log."""
    progress: bool | None = None
    """Rank 0's progress bar on stderr, advanced by `run.log`: None shows it when stderr is a terminal."""
    profile: bool = False
    """Time every step's data wait, compute, exposed communication and optimizer on each rank, for `run.log`
    (see observe/breakdown.py); costs a clock read (a CUDA event on CUDA) per phase."""
    straggler_threshold: float | None = 0.2
    """Name a rank whose own work per step (waiting for data, forward/backward, optimizer) exceeds the median of
    its data-parallel peers' by more than this fraction (and by 1 ms), while they wait for it, in three windows of
    steps running: rank 0 prints the rank, its host, how much slower and in which phase once, and appends the
    event to metrics.jsonl (observe/stragglers.py). None turns the check off: no timing, no collective."""
    straggler_window: int = 20
    """Optimizer steps per window of that check (a window also lasts at least a second, so its one small
    all-reduce stays a negligible share of a run of short steps)."""
    batchnorm: BatchNormMode = "exact"
    """BatchNorm when a batch is split over workers or micro-batches: "exact" (whole-batch statistics,
    all-reduced over data-parallel workers on any device; refused for micro-batches and traced stages) or
    "local" (each part normalised by its own rows; pipelines still update running statistics once per step).
    See parallel/batchnorm.py."""
    loss: LossKind = "any"
    """What the loss function computes: "any" (paratrain assumes nothing: under context parallelism the outputs are
    gathered into whole sequences for it), or "token_mean" (a mean over the targets' tokens, those equal to -100
    left out, as `cross_entropy(..., ignore_index=-100)`): then each context-parallel rank takes the loss of its own
    tokens, weighted by their count, and no logits are gathered."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """Recompute activations in the backward instead of keeping them: "full" keeps each block's input only,
    "selective" keeps matrix-multiplication outputs; per block (per layer of a pipeline stage), results
    unchanged. See parallel/activation_checkpoint.py."""
    compile: bool | str = False
    """torch.compile each block in place (after activation checkpointing, before FSDP/DDP/TP; per layer of a
    pipeline stage): True for inductor, or a backend name ("aot_eager", ...). See parallel/compile.py."""
    bucket_cap_mb: float | None = None
    """DDP gradient bucket size in MiB (None: torch's 25)."""
    find_unused_parameters: bool = False
    """DDP: allow parameters that take no part in some forward passes (costs a graph walk per step)."""
    static_graph: bool = False
    """DDP: the set of used parameters never changes, so buckets are rebuilt once and reused."""
    gradient_as_bucket_view: bool = False
    """DDP: gradients are views into the communication buckets (saves one copy and its memory)."""
    comm_hook: CommHook | None = None
    """DDP gradient communication: None (torch's), "auto" (the fastest exact setting, measured in `prepare` on
    its example batch: bucket size, bucket views), or a lossy one asked for by name: "bf16"/"fp16"
    compression or "powersgd" (low-rank, with error feedback; GPUs only)."""
    devices: list[str] | None = None
    """Devices of the stages of a single-process model-parallel run (strategy "mp")."""
    devices_per_worker: int = 1
    """Devices each process owns ("ddp+mp")."""
    microbatches: int | Literal["auto"] | None = None
    """Micro-batches per step for pipelined strategies, or "auto" to measure and pick. None (unset): one for `mp` and
    `ddp+mp` (plain model parallelism), and for pipelines across processes the fewest equal micro-batches of the
    batch that the schedule runs (1F1B: one per stage); with schedule="auto", searched as "auto" is."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule for "pp" and "ddp+pp"; "auto" measures the schedules that run this layout (1f1b,
    zero-bubble, gpipe with one stage per worker; interleaved ones with several) with the micro-batch search."""
    balance: list[int] | list[str] | BalanceMode = "time"
    """Layers per stage, or "time"/"memory"/"equal" to balance automatically (`split_points` becomes a list of
    module names here)."""
    split_points: list[str] | None = None
    """Pipeline cuts by name, torchtitan's form: split_points=["layer3"] starts a new stage at the first layer
    named layer3 or inside it (the tutorials' ResNet split); one name fewer than there are stages."""
    stages_per_worker: int = 1
    """Virtual pipeline stages per worker (interleaved and zero-bubble schedules)."""
    pp_size: int | None = None
    """Pipeline stages in a hybrid ddp+pp mesh (default: world size for pp, 2 for ddp+pp)."""
    tp_size: int | None = None
    """Tensor-parallel ranks of an N-D strategy such as "fsdp+tp" (default: 2 beside a data-parallel axis,
    the whole world for "tp" alone). See parallel/dims.py."""
    dp_replicate: int | None = None
    """Replicas of hybrid sharding ("ddp+fsdp"): FSDP shards within each, DDP-style averaging across (default 2)."""
    cp_size: int | None = None
    """Context-parallel ranks of a strategy with "cp" ("cp", "fsdp+cp"): each computes 1/cp_size of every sequence
    (default: 2 beside a data-parallel axis, the whole world for "cp" alone). See parallel/context.py."""
    ep_size: int | None = None
    """Expert-parallel ranks of a strategy with "ep" ("ep", "fsdp+ep"), carved from the data-parallel ones: each
    holds 1/ep_size of every MoE layer's experts (default: all the data-parallel ranks it is carved from)."""
    tp_plan: dict[str, str] | None = None
    """Module name patterns -> "colwise"/"rowwise" for tensor parallelism (default: the model's own plan, e.g.
    a Hugging Face config's base_model_tp_plan, else its attention and MLP blocks found by structure)."""

    @property
    def compiling(self) -> bool:
        return self.compile is not False


def check_choice(kind: str, value: Any, literal: Any) -> None:
    """`value` is one of a Literal's choices, or the error lists them with a close match."""
    if value not in get_args(literal):
        raise unknown_name(kind, str(value), [str(v) for v in get_args(literal)])


def _positive(name: str, value: int | float | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise ParatrainError(f"{name} must be >= {minimum}, got {value}")


def validate(cfg: Config) -> Config:
    """Every value and combination the options alone can get wrong, checked once, each error with its fix."""
    if cfg.strategy not in get_args(StrategyName):
        from .parallel.dims import is_grammar, parse

        if not is_grammar(cfg.strategy):
            check_choice("strategy", cfg.strategy, StrategyName)
        parse(cfg.strategy)  # an N-D strategy: the grammar's words, each once
    if cfg.tp_plan is not None and (not isinstance(cfg.tp_plan, dict) or not cfg.tp_plan):
        raise ParatrainError(f"tp_plan must map module name patterns to 'colwise' or 'rowwise', e.g. "
                             f"{{'blocks.*.attn.q': 'colwise'}}, got {cfg.tp_plan!r}")
    check_choice("precision", cfg.precision, Precision)
    check_choice("accelerator", cfg.accelerator, Accelerator)
    check_choice("schedule", cfg.schedule, Schedule)
    check_choice("batchnorm", cfg.batchnorm, BatchNormMode)
    check_choice("activation_checkpointing", cfg.activation_checkpointing, ActivationCheckpointing)
    check_choice("loss", cfg.loss, LossKind)
    if not isinstance(cfg.compile, bool):  # a backend's name: torch's list (imports torch, which it will use)
        from .parallel.compile import check_backend

        check_backend(cfg.compile)
    if cfg.comm_hook is not None:
        check_choice("comm_hook", cfg.comm_hook, CommHook)
    for name in ("grad_accum", "keep_last", "devices_per_worker", "stages_per_worker", "pp_size", "tp_size",
                 "dp_replicate", "cp_size", "ep_size", "straggler_window"):
        _positive(name, getattr(cfg, name))
    if cfg.timeout_s is not None and cfg.timeout_s <= 0:
        raise ParatrainError(f"timeout_s must be positive, got {cfg.timeout_s}")
    if cfg.bucket_cap_mb is not None and cfg.bucket_cap_mb <= 0:
        raise ParatrainError(f"bucket_cap_mb must be positive, got {cfg.bucket_cap_mb}")
    if cfg.log_dir is not None and (not isinstance(cfg.log_dir, str) or not cfg.log_dir):
        raise ParatrainError(f"log_dir must be a directory path (a non-empty string) or None, got {cfg.log_dir!r}")
    if not isinstance(cfg.profile, bool):
        raise ParatrainError(f"profile must be True or False, got {cfg.profile!r}")
    if not isinstance(cfg.async_save, bool):
        raise ParatrainError(f"async_save must be True or False, got {cfg.async_save!r}")
    threshold = cfg.straggler_threshold
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not threshold > 0):
        raise ParatrainError(f"straggler_threshold must be a positive fraction (0.2: a rank 20% slower than its "
                             f"peers is named) or None to turn the check off, got {threshold!r}")
    if cfg.progress is not None and not isinstance(cfg.progress, bool):
        raise ParatrainError(f"progress must be True, False or None (on a terminal only), got {cfg.progress!r}")
    if cfg.microbatches not in ("auto", None) and (not isinstance(cfg.microbatches, int) or cfg.microbatches < 1):
        raise ParatrainError(f"microbatches must be a positive int or 'auto', got {cfg.microbatches!r}")
    if cfg.split_points is not None:
        if not isinstance(cfg.split_points, list) or not cfg.split_points or any(
                not isinstance(n, str) or not n for n in cfg.split_points):
            raise ParatrainError(f"split_points must list module names to cut before, e.g. ['layer3'], "
                                 f"got {cfg.split_points!r}")
        if not isinstance(cfg.balance, str) or cfg.balance != "time":
            raise ParatrainError(f"give either split_points={cfg.split_points!r} or balance={cfg.balance!r}, "
                                 "not both: both say where the stages start")
        cfg.balance = list(cfg.split_points)
    if isinstance(cfg.balance, str):
        check_choice("balance", cfg.balance, BalanceMode)
    elif cfg.balance and all(isinstance(b, str) for b in cfg.balance):
        pass  # cuts by name, resolved against the model's layers when it is split
    elif not cfg.balance or any(not isinstance(b, int) or b < 1 for b in cfg.balance):
        raise ParatrainError(f"balance {cfg.balance!r} must list at least one layer per stage, e.g. [3, 2], "
                             "or be one of 'time', 'memory', 'equal'")
    if cfg.devices is not None and not cfg.devices:
        raise ParatrainError("devices must list at least one device, e.g. devices=['cuda:0', 'cuda:1']")
    if cfg.schedule != "auto":
        from .parallel.pipeline.schedules import row

        row(cfg.schedule).check_stages(cfg.stages_per_worker)
    if cfg.find_unused_parameters and cfg.static_graph:
        raise ParatrainError("find_unused_parameters=True and static_graph=True contradict each other: a static "
                             "graph uses the same parameters every step; keep one of them")
    return cfg


def make_config(kwargs: dict[str, Any]) -> Config:
    """The validated Config for `setup(**kwargs)`; precision may be given as a number (16, 32)."""
    names = {f.name for f in fields(Config)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ParatrainError(f"unknown setup option(s) {unknown}; known options: {sorted(names)}")
    if "precision" in kwargs:
        kwargs = {**kwargs, "precision": str(kwargs["precision"])}
    if isinstance(kwargs.get("log_dir"), os.PathLike):
        kwargs = {**kwargs, "log_dir": os.fspath(kwargs["log_dir"])}
    return validate(Config(**kwargs))
