"""`paratrain.setup()` and the `Run` it returns: the whole user-facing surface of a training script."""

from __future__ import annotations

import atexit
import builtins
import contextlib
import dataclasses
import functools
import logging
import os
import random
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from . import checkpoint, collectives, grad_clip, runtime, strategies, weights
from .agreement import NONE, Refusals
from .config import Config, make_config, validate
from .data import ShardedLoader, claim_weight
from .data.plan import ONE, Weight
from .errors import ParatrainError
from .faults import StopRequest, Watch
from .faults.replica_groups import ReplicaGroups, check_strategy
from .memstats import give_back_freed
from .observe import Breakdown, MetricLog, StragglerWatch
from .parallel.expert.router_stats import Rows
from .parallel.microbatch import batch_size
from .parallel.parallelize import parallelize
from .parallel.random_calls import RandomCalls
from .parallel.randomness import set_rows_before, set_seed
from .parallel.step_state import StepState, activate
from .parallel.step_state import active as active_state
from .precision import make_scaler
from .step import PreparedOptimizer, Step, rebind
from .strategies.base import Context, LossFn, Strategy


class Run:
    """One process's view of a training job; made by `paratrain.setup`."""

    def __init__(self, config: Config, strategy: Strategy, ctx: Context, watch: Watch, stop: StopRequest,
                 auto: bool = False, refusals: Refusals = NONE) -> None:
        self.config = config
        self.strategy = strategy
        self.ctx = ctx
        self.step = Step(config.grad_accum, strategy.set_gradient_sync)
        self.scaler = make_scaler(config.precision, ctx.device.type)
        self._watch = watch
        self._stop = stop
        self._stop_seen: tuple[int, bool] | None = None
        self._saves = 0
        self._loaders: weakref.WeakSet[ShardedLoader] = weakref.WeakSet()
        """Training loaders: the batch the latest one yielded sets how much the next micro-step's loss counts."""
        self._loader_prepared = False
        """A training loader was prepared. forward_backward decides by this, not by the loaders still alive: a
        loader dropped after its first batch is collected when each process's garbage collector runs, and ranks
        that disagreed on it would disagree on the row-count exchange (a collective) and wait on each other."""
        self._sharded: weakref.WeakSet[ShardedLoader] = weakref.WeakSet()
        """Every prepared loader (evaluation ones too): re-shared if strategy="auto" switches layout."""
        self._auto = auto
        """strategy="auto" on several processes, not chosen yet: `prepare` asks the planner (given an example)."""
        self._joining = False
        self._optimizers: list[torch.optim.Optimizer] = []
        """The prepared optimizers, whose fp16 gradients clip_grad_norm_ unscales first."""
        self.timing = Breakdown(ctx.device, enabled=config.profile)
        """The per-rank step breakdown (`setup(profile=True)` or `paratrain.profile(run)`); see observe/breakdown.py."""
        _, replicas = strategy.data_shard(ctx)
        self._metrics = MetricLog(rank=self.rank, world_size=self.world_size, ranks_per_replica=self.world_size //
                                  replicas, device=ctx.device, timing=self.timing,
                                  all_reduce_sum=functools.partial(collectives.all_reduce, op="sum", device=ctx.device),
                                  log_dir=config.log_dir, checkpoint_dir=config.checkpoint_dir,
                                  progress=config.progress)
        self._stragglers = StragglerWatch(
            rank=self.rank, world_size=self.world_size, threshold=config.straggler_threshold,
            window=config.straggler_window, timing=self.timing,
            all_reduce_sum=functools.partial(collectives.all_reduce, op="sum", device=ctx.device),
            guard=watch.op_scope, layout=lambda: self.strategy.data_shard(self.ctx), beats=watch.read,
            report=self._metrics.event)
        """Names a rank slower than its peers, once, on rank 0 (observe/stragglers.py); fed after each micro-step."""
        self._global_batch: int | None = None
        self._built: list[tuple[nn.Module, nn.Module]] = []
        """(prepared model, the user's model) pairs: `export` writes in the user's names and config."""
        self._refusals = refusals
        """Each prepare and the first micro-step end in an agreement: one rank's refusal is every rank's."""
        self._first_step_agreed = False
        self.replica_groups: ReplicaGroups | None = None
        """Under `paratrain run --replica-groups`: this group's link to the others (faults/replica_groups.py)."""
        self._writer = checkpoint.Writer(config.timeout_s or runtime.default_timeout_s())
        """The checkpoint being written in the background (`setup(async_save=True)`), one at a time."""

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
        return self.step.count > 0 and self.step.at_boundary

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
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                example: Any = None, init_from: str | os.PathLike[str] | None = None) -> Any:
        """Put the model in its final form for the strategy (placed, wrapped, sharded or split into stages)
        and point the optimizer at its parameters; returns (model, optimizer), or the model alone.

        `example` is one batch of model inputs: pipelines need it to trace a model that is not an
        nn.Sequential and to measure layers for balance="time"/"memory"; with strategy="auto" on several
        processes the planner measures the model on it and picks the layout (docs/plan.md).

        A model built on the meta device (`with torch.device("meta"):` or `paratrain.empty_init()`) is split
        first, then each rank gets storage for its share only, filled from `init_from` (a save_pretrained
        directory, a .safetensors file or a torch.save'd state dict, read a slice at a time) or else from the
        modules' own initialisation, the same values under every layout for one seed (docs/usage.md).

        A refusal on one rank is raised on every rank (`paratrain.agreement`)."""
        with self._refusals.phase("prepare"):
            return self._prepare(model, optimizer, example, init_from)

    def _prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, example: Any,
                 init_from: str | os.PathLike[str] | None) -> Any:
        activate(self.step.state)  # this run's micro-step state, whatever another run in the process did
        meta = weights.has_meta(model)
        source = weights.source_for(model, self.config.seed, init_from) if meta or init_from is not None else None
        if self._auto:  # a meta model is measured a layer at a time, each made real with its initial values
            self._choose_layout(model, optimizer, example,
                                weights.real_layer(model, source, self.device) if meta and source is not None else None)
        if source is not None and (not meta or not self.strategy.sharded_state):
            weights.materialize(model, source, self.device, everything=init_from is not None)
            meta = False  # whole on this rank, as the layout holds it
        before = dict(model.named_parameters(remove_duplicate=False))  # a tied weight under each of its names
        replica, replicas = self.strategy.data_shard(self.ctx)  # what a forward sees, for router statistics
        parts = self.config.grad_accum * (2 if self.strategy.microbatched else 1)
        self.step.state.rows = Rows(replica, replicas, parts, self.ctx.dims.replica_groups())
        self.step.state.random_calls = calls = RandomCalls(model)
        if meta and source is not None:  # split on the meta device, then this rank's share made real
            with weights.sourced(model, source, self.device):  # a forward while splitting: weights.streamed
                wrapped = parallelize(model, self.strategy, self.ctx, example, calls, self.print)
            replaced = weights.materialize(self.strategy.unwrap(wrapped), source, self.device)
            weights.settle(wrapped, replaced)
            give_back_freed()
        else:
            wrapped = parallelize(model, self.strategy, self.ctx, example, calls, self.print)
        self._built.append((wrapped, model))
        self.step.track(wrapped)
        self.timing.track(wrapped)
        self._metrics.start(None, self.step.count)  # step time and rates count from here, not from setup
        # Weights are built; from here on torch's generator differs per data-parallel replica, and only there: the
        # ranks of one tensor-parallel group (and of one pipeline) see the same rows, so a random op outside
        # paratrain's layout-independent draws (`randomness`) draws the same numbers on each of them, and weights
        # the group replicates stay identical.
        _seed(self.config.seed + 1 + self.strategy.data_shard(self.ctx)[0])
        if optimizer is None:
            return wrapped
        rebind(optimizer, before, dict(self.strategy.unwrap(wrapped).named_parameters()))
        self._optimizers.append(optimizer)
        groups = self.replica_groups
        prepared = PreparedOptimizer(optimizer, self.step, self.scaler, self.timing.phase, self._refusals,
                                     gate=groups.commit if groups is not None else None)
        if groups is not None:  # last: a group joining a running job may take a live group's state here
            groups.attach(self.strategy.unwrap(self._built[-1][0]), optimizer)
        return wrapped, prepared

    def _choose_layout(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, example: Any,
                       real: Callable[[nn.Module], nn.Module] | None = None) -> None:
        """strategy="auto": rank 0 asks the planner, every rank switches to its answer (one broadcast)."""
        self._auto = False
        if example is None:
            self.print(f"paratrain: strategy auto -> {self.strategy.name} ({self.world_size} processes); to have the "
                       "planner choose the layout, give run.prepare(model, optimizer, example=batch)")
            return
        from .planner import choose

        box: list[Any] = [None]
        if self.rank == 0:
            placement = self.ctx.placement
            try:
                picked = choose.plan(
                    model, example, optimizer, world=self.world_size,
                    nodes=max(1, self.world_size // max(1, placement.local_world_size)),
                    global_batch=self._global_batch or choose.rows(example) * self.world_size,
                    precision=self.config.precision, grad_accum=self.config.grad_accum,
                    pipelines=self.config.auto_pipelines, device=self.device,
                    accepts=self._refusal, say=self.print, real=real)
                box[0] = (picked.setup, picked.line)
            except Exception as e:  # ddp is right for every model: fall back to it, saying why
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                box[0] = (None, f"paratrain: strategy auto -> {self.strategy.name} ({self.world_size} processes; the "
                                f"planner could not plan this model: {first})")
        collectives.broadcast_objects(box)
        options, line = box[0]
        if options is not None:
            self._switch(options)
        self.print(line)

    def _layout(self, options: Mapping[str, Any]) -> tuple[Config, Strategy, Context]:
        config = validate(dataclasses.replace(self.config, **options))
        strategy = strategies.get(config.strategy)
        ctx = dataclasses.replace(self.ctx, config=config)
        strategy.check(ctx)
        return config, strategy, ctx

    def _refusal(self, options: Mapping[str, Any]) -> str | None:
        try:
            self._layout(options)
        except ParatrainError as e:
            return str(e)
        return None

    def _switch(self, options: Mapping[str, Any]) -> None:
        """Become the chosen layout: before any model is wrapped, with loaders re-shared to the same global batch."""
        self.config, self.strategy, self.ctx = self._layout(options)
        self.step.sync_with(self.strategy.set_gradient_sync)
        replica, replicas = self.strategy.data_shard(self.ctx)
        self._metrics.ranks_per_replica = self.world_size // replicas
        for loader in self._sharded:
            loader.relayout(replica, replicas, self.strategy.scheduled)

    def prepare_loader(self, loader: DataLoader, *, evaluation: bool = False) -> ShardedLoader:
        """Shard `loader` over data-parallel replicas (its batch_size is per worker), honouring its sampler and
        loading options or refusing them by name. With evaluation=True each sample goes to exactly one rank and
        none is repeated, so all-reduced sums are exact. Collective when the loader has a custom sampler."""
        replica, replicas = self.strategy.data_shard(self.ctx)
        prepared = ShardedLoader(loader, replica, replicas, self.config.seed, evaluation=evaluation,
                                 grad_accum=self.config.grad_accum, equal_shares=self.strategy.scheduled,
                                 device=self.device)
        self._sharded.add(prepared)
        prepared.timing = self.timing
        prepared.step_state = self.step.state  # its batches set this run's rows for the dropout masks
        if not evaluation:
            self._loaders.add(prepared)
            self._loader_prepared = True
            self._global_batch = prepared.global_batch  # for run.log's samples/s
            if self.replica_groups is not None:
                self.replica_groups.attach_loader(prepared)
        return prepared

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the strategy's wrapper (for state dicts and evaluation)."""
        return self.strategy.unwrap(model)

    # -- the step -------------------------------------------------------------------------------
    def _scaled_backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), divided over the accumulation window and scaled for fp16."""
        self.timing.backward_starts()  # where the slow-rank watch splits own work from waiting (observe/stragglers.py)
        if self.config.grad_accum > 1:
            loss = loss / self.config.grad_accum
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def backward(self, loss: torch.Tensor) -> None:
        """Ends a micro-step the user's loop ran `model(x)` for: backward with accumulation and fp16 loss
        scaling; gradients are synchronised only on the last micro-step of a window. A short batch's loss is
        weighted by this rank's rows (see paratrain/data/plan.py)."""
        activate(self.step.state)
        weight = claim_weight(self._loaders)
        with (self._first_step(), self._watch.op_scope("backward"), self.step.micro(),  # DDP syncs in here
              self.timing.micro_step()):
            self._scaled_backward(loss if weight.loss == 1.0 else loss * weight.loss)
        self._stragglers.after_micro_step(self.step, joining=self._joining)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` for the prepared `model` under any strategy: the norm is the whole
        model's gradient's (over pipeline stages, FSDP shards, tensor-parallel pieces; replicas agree), every
        rank scales by the same factor, and fp16 gradients are unscaled first. Call it where torch's would go:
        after the window's last backward, before `optimizer.step()`. Returns the norm before clipping."""
        if self.scaler is not None:
            for optimizer in self._optimizers:
                self.scaler.unscale_(optimizer)
        if self.replica_groups is not None:  # the norm of the gradient averaged over the groups
            self.replica_groups.reduce()
        return grad_clip.clip_grad_norm_(model, max_norm, norm_type, error_if_nonfinite)

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """One micro-step for any strategy (pipelines included): returns the global-batch mean loss on every rank
        (weighted by rows when the batch is split unevenly, through the loss function every strategy calls).
        Under torch.no_grad() nothing is trained: it is `evaluate(model, inputs, targets, loss_fn)`."""
        if not torch.is_grad_enabled():
            return self.evaluate(model, inputs, targets, loss_fn)  # type: ignore[no-any-return]
        activate(self.step.state)
        weight = claim_weight(self._loaders) if self._loader_prepared else self._hand_sliced(inputs)
        with (self._first_step(), self._watch.op_scope("forward_backward"), self.step.micro(model),
              self.timing.micro_step()):
            loss = self.strategy.forward_backward(model, inputs, targets, weight.scale(loss_fn), self._scaled_backward,
                                                  self.ctx)
        self._stragglers.after_micro_step(self.step, joining=self._joining)
        return loss if weight.window == 1.0 else loss / weight.window

    def _first_step(self) -> contextlib.AbstractContextManager[None]:
        """The first micro-step paratrain sees ends in an agreement (a refusal in its forward is every rank's);
        later ones agree on nothing."""
        if self._first_step_agreed:
            return contextlib.nullcontext()
        self._first_step_agreed = True
        return self._refusals.phase("the first step")

    def _hand_sliced(self, inputs: Any) -> Weight:
        """With no sharded loader, the loop sliced the global batch itself: the replicas' row counts are
        exchanged (one small all-reduce a micro-step) so that uneven slices (8, 8 and 5 rows) count by rows, as
        the loader's shares do, and dropout masks follow each slice's global rows. Inside `run.join` the
        ranks no longer step together, so slices count equally there, as under torch's Join."""
        replica, replicas = self.strategy.data_shard(self.ctx)
        rows = batch_size(inputs)
        if replicas == 1 or self._joining or not collectives.active():
            set_rows_before(replica * rows, self.step.state)
            return ONE
        counts = torch.zeros(replicas, dtype=torch.int64)
        counts[replica] = rows
        with self._watch.op_scope("row counts"):
            counts = collectives.all_reduce(counts, op="max", device=self.device).cpu()
        set_rows_before(int(counts[:replica].sum()), self.step.state)
        if int(counts.min()) == int(counts.max()):
            return ONE
        return Weight(loss=rows * replicas / int(counts.sum()))

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any = None, loss_fn: LossFn | None = None) -> Any:
        """A batch's outputs, or given `targets` and `loss_fn` its mean loss over every rank's rows, without
        training: the model in eval mode (restored after) and no gradients. Any strategy; collective.
        Pipelines return outputs on the last stage (None on the other ranks); the loss comes back everywhere."""
        activate(self.step.state)
        was = model.training
        model.eval()
        try:
            with torch.no_grad(), self._watch.op_scope("evaluate"):
                return self.strategy.evaluate(model, inputs, targets, loss_fn, self.ctx)
        finally:
            model.train(was)

    @contextlib.contextmanager
    def join(self, model: nn.Module) -> Iterator[None]:
        """Let ranks with fewer batches finish early without deadlocking the others (uneven inputs)."""
        from torch.distributed.algorithms.join import Join

        if not collectives.active():
            yield
            return
        self._joining = True
        try:
            with Join([model]):  # type: ignore[list-item]
                yield
        finally:
            self._joining = False

    # -- communication --------------------------------------------------------------------------
    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        with self._watch.op_scope("all_reduce"), self.timing.phase("comm"):
            return collectives.all_reduce(value, op=op, device=self.device)

    def barrier(self) -> None:
        with self._watch.op_scope("barrier"), self.timing.phase("comm"):
            collectives.barrier()

    @property
    def should_stop(self) -> bool:
        """True on every rank once any rank got SIGTERM (preemption): save and leave the loop. Collective
        (read it at the same point on every rank, e.g. once per step); reading it once makes SIGTERM wait for it."""
        self._stop.polled = True
        if self._stop_seen is not None and self._stop_seen[0] == self.step.count:
            return self._stop_seen[1]  # asked again within the same step: same answer, no second collective
        with self._watch.op_scope("should_stop"), self.timing.phase("comm"):
            flag = bool(collectives.all_reduce(float(self._stop.requested), op="max", device=self.device) > 0)
        self._stop_seen = (self.step.count, flag)
        self._stop.answered = self._stop.answered or flag
        return flag

    # -- metrics --------------------------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, Any] | None = None, /, *, reduce: str | Mapping[str, str] = "mean",
            total_steps: int | None = None, **values: Any) -> dict[str, Any]:
        """Average (or sum: reduce="sum" or {"name": "sum"}) numbers over ranks in one small all-reduce; rank 0
        appends them to <log_dir>/metrics.jsonl and TensorBoard and advances its progress bar (ETA from
        `total_steps`, remembered once given). Names that are not identifiers go in `metrics` ({"val/acc": a}).
        Collective: every rank calls it at the same steps with the same names. Returns the record written."""
        with self._watch.op_scope("log"):
            return self._metrics.log(step, {**(metrics or {}), **values}, reduce, total_steps, self.step.count,
                                     self._global_batch)

    @property
    def log_dir(self) -> Path:
        """Where rank 0 writes `run.log`'s metrics.jsonl and TensorBoard files (`setup(log_dir=...)`)."""
        return self._metrics.folder

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
            with self._metrics.outside():  # above the progress bar, if one is shown
                builtins.print(*args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------
    def _root(self, path: str | Path | None) -> Path:
        root = path or self.config.checkpoint_dir
        if root is None:
            raise ParatrainError("no checkpoint directory: pass setup(checkpoint_dir=...) or save(state, path=...)")
        return Path(root)

    def save(self, state: dict[str, Any], path: str | Path | None = None) -> Path:
        """Checkpoint `state` atomically (collective: every rank calls it) and return the path it has once published.

        By default (`setup(async_save=True)`) it returns once the state is copied to CPU memory: the next optimizer
        step may change the weights, and the checkpoint is written, fsynced and published in the background. It
        first waits for the previous one (raising its error, if it failed); `wait_for_save()` waits without saving.
        With async_save=False it returns when the checkpoint is published. Either way a crash before publication
        leaves the previous checkpoint complete and `latest` on it."""
        background = self.config.async_save
        with self._watch.op_scope("save"):
            self._writer.wait()  # the previous one first: published, or its error raised here
            step = state.get("step")
            step = int(step) if isinstance(step, int) or (torch.is_tensor(step) and step.numel() == 1) else self._saves
            self._saves = step + 1
            extra = {"step": step, "micro": self.step.count, "strategy": self.strategy.name,
                     "scaler": self.scaler.state_dict() if self.scaler else None, "world_size": self.world_size}
            group = self._writer.group() if background else None  # collective, the first time
            staged = checkpoint.stage(
                self._root(path), step, state, rank=self.rank, world_size=self.world_size,
                unwrap=self.strategy.unwrap, sharded_state=self.strategy.sharded_state, extra=extra,
                copy=self._writer.copy if background else lambda value: value,
            )
            write = functools.partial(checkpoint.write, staged, rank=self.rank, keep=self.config.keep_last,
                                      group=group)
            if background:
                self._writer.start(staged.final.name, write)  # gives the write's freed memory back when done
            else:
                write()
                give_back_freed()
        return staged.final

    def wait_for_save(self) -> Path | None:
        """Block until the checkpoint being written in the background is published and return its path (None when
        none is in flight); raise CheckpointError naming it if it failed on any rank. Not a collective: each rank
        waits for its own part, and the ranks' writes agree among themselves. `run.load`, the next `run.save` and
        `run.close` wait too."""
        return self._writer.wait()  # not a collective: no place in the heartbeat's sequence of them

    def load(self, state: dict[str, Any], path: str | Path | None = None) -> bool:
        """Restore the newest complete checkpoint (or `path`) into `state` in place; False on a fresh start.

        `path` may name one checkpoint (its step-N directory: loaded or CheckpointError) or a directory of
        them (the newest complete one, skipping broken ones with a warning). Collective."""
        given = Path(path) if path is not None else None
        with self._watch.op_scope("load"):
            self._writer.wait()  # the checkpoint being written may be the one to load
            one = given is not None and (checkpoint.is_checkpoint_dir(given) or not given.is_dir())
            target = given if one else checkpoint.find(self._root(path), self.rank)
            if target is None:
                return False
            extra = checkpoint.load(target, state, rank=self.rank, world_size=self.world_size,
                                    unwrap=self.strategy.unwrap, map_location=self.device,
                                    sharded_state=self.strategy.sharded_state, verified=not one)
        give_back_freed()
        self.step.restore(int(extra.get("micro", 0)))
        self._saves = int(extra.get("step", -1)) + 1  # unnamed saves continue the numbering
        self._metrics.start(int(extra.get("step", 0)), self.step.count)  # the logs continue from this step
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self.print(f"paratrain: resumed from {target}")
        return True

    def export(self, model: nn.Module, path: str | os.PathLike[str], *, max_shard_size: int = 2 * 1024**3,
               adapters_only: bool | None = None) -> Path:
        """Write the prepared `model`'s whole weights to `path` as Hugging Face does (safetensors files of at most
        `max_shard_size` bytes with an index, the config of a transformers model), from any layout: no rank
        gathers the model. Collective. Load it with `from_pretrained(path)`, `init_from=path` or
        `load_state_dict`. Each rank writes the blocks it holds where they lie in the files (they must share the
        folder, as they share checkpoints). A LoRA model (peft) writes its adapters only, as `save_pretrained` does
        (`adapter_model.safetensors`, `adapter_config.json`: `PeftModel.from_pretrained(base, path)`), unless
        `adapters_only=False` (the whole model, in its own names)."""
        pair = next(((prepared, user) for prepared, user in self._built if model in (prepared, user)), None)
        if pair is None:
            raise ParatrainError("run.export takes the model run.prepare returned; prepare it first")
        with self._watch.op_scope("export"):
            folder = weights.export(self.strategy.unwrap(pair[0]), pair[1], path, self.rank, max_shard_size,
                                    adapters_only)
        give_back_freed()
        return folder

    def close(self) -> None:
        """Wait for the checkpoint being written (raising its error, after the rest is closed), then end the run."""
        try:
            self._writer.close()
        finally:
            self._close()

    def _close(self) -> None:
        self._metrics.close()
        self._watch.stop()
        self._stop.uninstall()
        runtime.destroy_process_group()
        if active_state() is self.step.state:  # the model used after the run is outside any run's layout
            activate(StepState())


def setup(**kwargs: Any) -> Run:
    """Read the launch environment, start the process group the strategy needs, and return the `Run`. A refusal
    on one rank (an option, a device it lacks) is raised on every rank, before any waits in the group's rendezvous."""
    runtime.install_error_file_hook()  # first: a bad option is then reported by the launcher like any error
    placement = runtime.read_placement()
    groups = runtime.read_replica_group()
    refusals = _refusals_for(placement, kwargs)
    with refusals.phase("setup"):
        config = make_config(kwargs)
        auto = config.strategy == "auto"
        if auto:
            config.strategy = "ddp" if placement.world_size > 1 else "single"
        strategy = strategies.get(config.strategy)
        device = runtime.pick_device(config.accelerator, placement.local_rank, max(1, config.devices_per_worker))
        ctx = Context(config=config, placement=placement, device=device, gpus=runtime.cuda_count())
        strategy.check(ctx)
        if groups is not None:
            check_strategy(strategy, config, groups)
        grouped = strategy.needs_process_group or placement.world_size > 1 or groups is not None
        backend = runtime.pick_backend(config.backend, device) if grouped else ""
    timeout = config.timeout_s or runtime.default_timeout_s()
    if grouped:
        runtime.init_process_group(placement, backend, config.init, timeout, device, refusals.store)
        atexit.register(runtime.destroy_process_group)
    watch = Watch.start(placement.rank, placement.world_size, timeout)
    atexit.register(watch.stop)  # before the process group goes (atexit runs last-registered first)
    stop = StopRequest(grace_s=timeout)
    stop.install()
    run = Run(config, strategy, ctx, watch, stop, auto=auto and placement.world_size > 1, refusals=refusals)
    if auto and placement.world_size == 1:
        run.print("paratrain: strategy auto -> single (1 process)")
    if groups is not None:
        run.replica_groups = ReplicaGroups.start(groups, placement, *strategy.data_shard(ctx), timeout,
                                                 runtime.connect_timeout_s(), run.step.restore, lambda: run.step.count,
                                                 device)
        atexit.register(run.replica_groups.close)
    _seed(config.seed)
    set_seed(config.seed, run.step.state)
    activate(run.step.state)
    return run


def _refusals_for(placement: runtime.Placement, kwargs: Mapping[str, Any]) -> Refusals:
    """Where the ranks agree on their setup: the rendezvous store, opened before the options are checked (as
    given, so a rank whose options are refused still reaches it)."""
    timeout, init = kwargs.get("timeout_s"), kwargs.get("init")
    return Refusals.at_rendezvous(
        placement, init if isinstance(init, str) else None,
        float(timeout) if isinstance(timeout, int | float) and timeout > 0 else runtime.default_timeout_s())


def _seed(seed: int) -> None:
    """Same seed on every rank, so every rank builds identical initial weights (as one process would)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
