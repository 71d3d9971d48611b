"""`paratrain.setup()` and the `Run` it returns: the whole user-facing surface of a training script."""

from __future__ import annotations

import atexit
import builtins
import contextlib
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from . import checkpoint, collectives, runtime, strategies
from .config import Config, make_config
from .data import ShardedLoader
from .errors import ParatrainError
from .faults import INACTIVE, StopRequest, Watch
from .optim import PreparedOptimizer, Steps, rebind
from .precision import apply_autocast, make_scaler
from .strategies.base import Context, LossFn, Strategy


class Run:
    """One process's view of a training job; made by `paratrain.setup`."""

    def __init__(self, config: Config, strategy: Strategy, ctx: Context) -> None:
        self.config = config
        self.strategy = strategy
        self.ctx = ctx
        self._steps = Steps(config.grad_accum)
        self.scaler = make_scaler(config.precision, ctx.device.type)
        self._sync_ctx: contextlib.AbstractContextManager[Any] | None = None
        self._saves = 0
        self._watch: Watch = INACTIVE
        self._stop = StopRequest(grace_s=config.timeout_s or runtime.default_timeout_s())
        self._stop_seen: tuple[int, bool] | None = None
        self._rebind_later: tuple[Any, dict[str, nn.Parameter], nn.Module] | None = None
        """Pipelines split the model at their first step; the optimizer is re-pointed once after it."""

    # -- where am I -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.placement.rank

    @property
    def world_size(self) -> int:
        return self.ctx.placement.world_size

    @property
    def local_rank(self) -> int:
        return self.ctx.placement.local_rank

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sync_step(self) -> bool:
        """True after the backward that completes an accumulation window (when the optimizer steps)."""
        return self._steps.micro > 0 and self._steps.at_boundary

    def per_worker_batch(self, global_batch: int) -> int:
        """The loader batch size for a global batch, checked to divide evenly over replicas and accumulation."""
        _, replicas = self.strategy.data_shard(self.ctx)
        parts = replicas * self.config.grad_accum
        if global_batch < parts or global_batch % parts:
            raise ParatrainError(
                f"global batch {global_batch} cannot be split evenly over {replicas} data-parallel worker(s) x "
                f"{self.config.grad_accum} accumulation step(s) = {parts} parts; use a global batch that is a "
                f"multiple of {parts} (e.g. {max(parts, global_batch // parts * parts)})"
            )
        return global_batch // parts

    # -- preparing objects ----------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Wrap the model for the strategy (and the optimizer for accumulation/AMP); returns (model, optimizer)."""
        before = dict(model.named_parameters())
        wrapped = self.strategy.wrap(model, self.ctx)
        wrapped = apply_autocast(wrapped, self.config.precision, self.device.type)
        wrapped.register_forward_pre_hook(self._enter_micro_step)
        _seed(self.config.seed + 1 + self.rank)  # weights are built; from here on randomness differs per rank
        if optimizer is None:
            return wrapped
        rebind(optimizer, before, dict(self.strategy.unwrap(wrapped).named_parameters()))
        self._rebind_later = (optimizer, before, wrapped)
        return wrapped, PreparedOptimizer(optimizer, self._steps, self.scaler)

    def prepare_loader(self, loader: DataLoader, *, evaluation: bool = False) -> ShardedLoader:
        """Shard `loader` over data-parallel replicas (its batch_size is per worker). With evaluation=True each
        sample goes to exactly one rank and none is repeated, so all-reduced sums are exact."""
        replica, replicas = self.strategy.data_shard(self.ctx)
        return ShardedLoader(loader, replica, replicas, self.config.seed, evaluation=evaluation)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the strategy's wrapper (for state dicts and evaluation)."""
        return self.strategy.unwrap(model)

    # -- the step -------------------------------------------------------------------------------
    def _enter_micro_step(self, module: nn.Module, args: Any) -> None:
        if self._sync_ctx is None and torch.is_grad_enabled() and module.training:
            self._sync_ctx = self.strategy.sync_context(module, self._steps.next_syncs)
            self._sync_ctx.__enter__()

    def _leave_micro_step(self) -> None:
        if self._sync_ctx is not None:
            ctx, self._sync_ctx = self._sync_ctx, None
            ctx.__exit__(None, None, None)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() with accumulation scaling, fp16 loss scaling and gradient sync only when due."""
        if self.config.grad_accum > 1:
            loss = loss / self.config.grad_accum
        try:
            with self._watch.op_scope("backward"):  # DDP all-reduces gradients inside backward
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
        finally:
            self._leave_micro_step()
            self._steps.micro += 1

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """One micro-step for any strategy (pipelines included): returns the global-batch mean loss on every rank."""
        with self._watch.op_scope("forward_backward"):
            loss = self.strategy.forward_backward(model, inputs, targets, loss_fn, self.backward)
        if self._rebind_later is not None:
            optimizer, before, wrapped = self._rebind_later
            self._rebind_later = None
            rebind(optimizer, before, dict(self.strategy.unwrap(wrapped).named_parameters()))
        self._leave_micro_step()
        return loss

    @contextlib.contextmanager
    def join(self, model: nn.Module) -> Iterator[None]:
        """Let ranks with fewer batches finish early without deadlocking the others (uneven inputs)."""
        from torch.distributed.algorithms.join import Join

        if not collectives.active():
            yield
            return
        with Join([model]):  # type: ignore[list-item]
            yield

    # -- communication --------------------------------------------------------------------------
    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        with self._watch.op_scope("all_reduce"):
            return collectives.all_reduce(value, op=op, device=self.device)

    def barrier(self) -> None:
        with self._watch.op_scope("barrier"):
            collectives.barrier()

    @property
    def should_stop(self) -> bool:
        """True on every rank once any rank got SIGTERM (preemption): save and leave the loop. Collective
        (read it at the same point on every rank, e.g. once per step); reading it once makes SIGTERM wait for it."""
        self._stop.polled = True
        if self._stop_seen is not None and self._stop_seen[0] == self._steps.micro:
            return self._stop_seen[1]  # asked again within the same step: same answer, no second collective
        with self._watch.op_scope("should_stop"):
            flag = bool(collectives.all_reduce(float(self._stop.requested), op="max", device=self.device) > 0)
        self._stop_seen = (self._steps.micro, flag)
        self._stop.answered = self._stop.answered or flag
        return flag

    @property
    def logger(self) -> logging.Logger:
        """A logger that writes on rank 0 only (other ranks log warnings and errors)."""
        logger = logging.getLogger(f"paratrain.run.rank{self.rank}")
        if not self.is_main:
            logger.setLevel(logging.WARNING)
        return logger

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main:
            kwargs.setdefault("flush", True)
            builtins.print(*args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------
    def _root(self, path: str | Path | None) -> Path:
        root = path or self.config.checkpoint_dir
        if root is None:
            raise ParatrainError("no checkpoint directory: pass setup(checkpoint_dir=...) or save(state, path=...)")
        return Path(root)

    def save(self, state: dict[str, Any], path: str | Path | None = None) -> Path:
        """Write a complete checkpoint atomically (collective: every rank calls it)."""
        step = state.get("step")
        step = int(step) if isinstance(step, int) or (torch.is_tensor(step) and step.numel() == 1) else self._saves
        self._saves = step + 1
        extra = {"step": step, "micro": self._steps.micro, "scaler": self.scaler.state_dict() if self.scaler else None,
                 "strategy": self.strategy.name, "world_size": self.world_size}
        with self._watch.op_scope("save"):
            return checkpoint.save(
                self._root(path), step, state, rank=self.rank, world_size=self.world_size,
                unwrap=self.strategy.unwrap, sharded_state=getattr(self.strategy, "sharded_state", False),
                keep=self.config.keep_last, extra=extra,
            )

    def load(self, state: dict[str, Any], path: str | Path | None = None) -> bool:
        """Restore the newest complete checkpoint (or `path`) into `state` in place; False on a fresh start.

        `path` may name one checkpoint (its step-N directory: loaded or CheckpointError) or a directory of
        them (the newest complete one, skipping broken ones with a warning). Collective."""
        from .checkpoint import manager, store

        given = Path(path) if path is not None else None
        with self._watch.op_scope("load"):
            one = given is not None and (store.is_checkpoint_dir(given) or not given.is_dir())
            target = given if one else manager.find(self._root(path), self.rank)
            if target is None:
                return False
            extra = checkpoint.load(target, state, rank=self.rank, world_size=self.world_size,
                                    unwrap=self.strategy.unwrap, map_location=self.device, verified=not one)
        self._steps.micro = int(extra.get("micro", 0))
        self._saves = int(extra.get("step", -1)) + 1  # unnamed saves continue the numbering
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self.print(f"paratrain: resumed from {target}")
        return True

    def close(self) -> None:
        self._watch.stop()
        self._stop.uninstall()
        runtime.destroy_process_group()


def setup(**kwargs: Any) -> Run:
    """Read the launch environment, start the process group the strategy needs, and return the `Run`."""
    runtime.install_error_file_hook()  # first: a bad option is then reported by the launcher like any error
    config = make_config(kwargs)
    placement = runtime.read_placement()
    if config.strategy == "auto":
        config.strategy = "ddp" if placement.world_size > 1 else "single"
    strategy = strategies.get(config.strategy)
    device = runtime.pick_device(config.accelerator, placement.local_rank, max(1, config.devices_per_worker))
    ctx = Context(config=config, placement=placement, device=device)
    strategy.check(ctx)
    if strategy.needs_process_group or placement.world_size > 1:
        backend = runtime.pick_backend(config.backend, device)
        timeout = config.timeout_s or runtime.default_timeout_s()
        runtime.init_process_group(placement, backend, config.init, timeout, device)
        atexit.register(runtime.destroy_process_group)
    run = Run(config, strategy, ctx)
    run._watch = Watch.start(placement.rank, placement.world_size, config.timeout_s or runtime.default_timeout_s())
    atexit.register(run._watch.stop)  # before the process group goes (atexit runs last-registered first)
    run._stop.install()
    _seed(config.seed)
    return run


def _seed(seed: int) -> None:
    """Same seed on every rank, so every rank builds identical initial weights (as one process would)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
