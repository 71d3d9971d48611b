"""Replica groups in the worker: gradients averaged between groups by torchft, each step only among the living.

Inside a group the strategy runs as it does alone (DDP over the group's N workers). Between groups, torchft's
`Manager` holds a fault-tolerant gloo process group that it rebuilds whenever the set of live groups changes.
One optimizer step, on every worker of every group:

    loader: begin()  ── the step's quorum (lighthouse): P live groups, this group's place r among them;
                        a group that is behind first copies a live group's state (model, optimizer, loader
                        position, micro-step, RNG): torchft's live recovery, no disk read
            rows     ── the global batch cut into P*N shares; this worker takes share r*N + l, weighted so
                        that the average over all P*N shares is the global batch's mean (data/plan.py)
    backward         ── DDP averages over the group's N workers
    optimizer.step(): reduce()  ── Manager.allreduce: the average over the P groups (one flat buffer per dtype)
                      commit()  ── should_commit: the step is applied only if the whole reduction succeeded;
                                   otherwise the gradients are dropped and the loader yields the same global
                                   batch again, cut over whoever is alive then

So the summed gradient of a step is the same whether 1 or R groups took part, and a step is never half-reduced.
torchft's own DistributedDataParallel wrapper is not used: its communication hook fails on the survivor when a
peer is SIGKILLed; the Manager's allreduce / should_commit reports the failure instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import collectives
from ..checkpoint import rng
from ..errors import ParatrainError
from ..launcher.lighthouse import INSTALL, require_torchft, wait_until_reachable
from ..runtime import Placement, ReplicaGroupLaunch

if TYPE_CHECKING:
    from ..config import Config
    from ..data import ShardedLoader
    from ..strategies.base import Strategy

MAX_REDOS = 50
"""Consecutive failed steps after which the worker gives up (a fault that does not heal)."""

START_WAIT_S = 30.0
"""At the job's start (no group has trained yet), how long the first groups wait for the others to join before
training without them (they join later, recovering from a live group)."""

_POLL_S = 0.1


def check_strategy(strategy: Strategy, config: Config, launch: ReplicaGroupLaunch) -> None:
    """Replica groups average whole gradients between groups: each rank must hold its model's whole gradient."""
    if strategy.sharded_state or strategy.microbatched:
        raise ParatrainError(
            f"strategy={strategy.name!r} with --replica-groups {launch.count}: replica groups average whole "
            f"gradients between groups, but {strategy.name!r} splits the model over its ranks (no rank holds a "
            "whole replica); use strategy='ddp' inside each group (or 'single' with --nproc 1)"
        )
    if config.precision == "16":
        raise ParatrainError(
            f"precision='16' with --replica-groups {launch.count}: each group's GradScaler would skip steps on its "
            "own; use precision='bf16' or '32'"
        )


class ReplicaGroups:
    """This worker's link to the other groups: the step's quorum, the cross-group average and the commit."""

    def __init__(self, launch: ReplicaGroupLaunch, manager: Any, replica: int, replicas: int,
                 restore_micro: Callable[[int], None], micro: Callable[[], int],
                 device: torch.device | None = None) -> None:
        self.launch = launch
        self.device = device
        self.manager = manager
        self.replica, self.replicas = replica, replicas
        """This worker's data-parallel place inside its group."""
        self._restore_micro, self._micro = restore_micro, micro
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._loaders: list[ShardedLoader] = []
        self._held = False
        """A quorum is held for the step in progress (begun, not yet committed or dropped)."""
        self._reduced = False
        self._redos = 0
        self.recovered = 0
        """Times this worker took a live group's state."""
        self.redone = 0
        """Steps dropped because the reduction between groups failed (each trained again)."""

    @classmethod
    def start(cls, launch: ReplicaGroupLaunch, placement: Placement, replica: int, replicas: int, timeout_s: float,
              connect_timeout_s: float, restore_micro: Callable[[int], None], micro: Callable[[], int],
              device: torch.device | None = None) -> ReplicaGroups:
        """Join the lighthouse with torchft's Manager over this group's store (rank 0 serves the group's manager)."""
        require_torchft(f"replica group {launch.index} of {launch.count}")
        wait_until_reachable(launch.lighthouse, connect_timeout_s)
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError as exc:
            raise ParatrainError(f"replica groups need torchft, which failed to import ({exc}); {INSTALL}") from None
        if placement.master_port is None:
            raise ParatrainError("replica groups need the group's store (MASTER_ADDR/MASTER_PORT); start them with "
                                 "`paratrain run --replica-groups`")
        timeout = timedelta(seconds=timeout_s)
        box: list[ReplicaGroups] = []
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda state: box[0]._load(state),
            state_dict=lambda: box[0]._state(), min_replica_size=1, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timedelta(seconds=connect_timeout_s), rank=placement.rank,
            world_size=placement.world_size, store_addr=placement.master_addr, store_port=placement.master_port,
            lighthouse_addr=launch.lighthouse, replica_id=f"paratrain_group_{launch.index}", init_sync=False)
        box.append(cls(launch, manager, replica, replicas, restore_micro, micro, device))
        return box[0]

    # -- what moves to a group that rejoins -----------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """A prepared model (the user's module) and its optimizer; the group joins once a loader is prepared too."""
        self._models.append(model)
        if optimizer is not None:
            self._optimizers.append(optimizer)
        self._join_when_ready()

    def attach_loader(self, loader: ShardedLoader) -> None:
        """The training loader: it asks `begin` for this step's rows and advances only on a commit."""
        loader.replica_steps = self
        self._loaders.append(loader)
        self._join_when_ready()

    def _join_when_ready(self) -> None:
        """The first quorum as soon as everything that moves is known: a group joining a running job takes a live
        group's state here, before the script reads `loader.epoch`."""
        if not (self._optimizers and self._loaders) or self._held or self.manager.current_step() != 0:
            return
        self.begin()
        for _ in range(int(START_WAIT_S / _POLL_S)):  # a fixed count: every rank of the group asks as often
            if self.manager.current_step() > 0 or self.manager.num_participants() >= self.launch.count:
                return  # joined a running job (recovered), or every group is here
            time.sleep(_POLL_S)  # the job is starting: wait for the groups still importing torch
            self._held = False
            self.begin()

    def _state(self) -> dict[str, Any]:
        return {"models": [m.state_dict() for m in self._models],
                "optimizers": [o.state_dict() for o in self._optimizers],
                "loaders": [x.state_dict() for x in self._loaders], "micro": self._micro(), "rng": rng.capture()}

    def _load(self, state: dict[str, Any]) -> None:
        if len(state["models"]) != len(self._models) or len(state["loaders"]) != len(self._loaders):
            raise ParatrainError(
                f"replica group {self.launch.index} prepared {len(self._models)} model(s) and {len(self._loaders)} "
                f"training loader(s) but the group it recovers from has {len(state['models'])} and "
                f"{len(state['loaders'])}; every group must run the same script")
        for model, values in zip(self._models, state["models"]):
            model.load_state_dict(values)
        for optimizer, values in zip(self._optimizers, state["optimizers"]):
            optimizer.load_state_dict(values)
        for loader, values in zip(self._loaders, state["loaders"]):
            loader.load_state_dict(values)
        self._restore_micro(int(state["micro"]))
        rng.restore(state["rng"])
        self.recovered += 1

    # -- one step -------------------------------------------------------------------------------
    def begin(self) -> tuple[int, int]:
        """The step's quorum (once per step; may recover this worker's state first): this worker's share of the
        global batch as (share, shares)."""
        if not self._held:
            self._group_alive()
            self.manager.start_quorum()
            self._held, self._reduced = True, False
        rank = self.manager.participating_rank()
        groups = max(1, self.manager.num_participants())
        rank = 0 if rank is None else rank  # not placed (the quorum failed): the step will not commit
        return rank * self.replicas + self.replica, groups * self.replicas

    def reduce(self) -> None:
        """Average the gradients over the step's groups (once per step: `run.clip_grad_norm_` may come first)."""
        if self._reduced:
            return
        self._require_loader()
        self._reduced = True
        params = list({id(p): p for o in self._optimizers for g in o.param_groups for p in g["params"]}.values())
        buckets: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            buckets.setdefault((p.device, p.dtype), []).append(p)
        for same in buckets.values():
            grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in same]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if not self.manager.allreduce(flat).wait():
                return  # reported to the manager: should_commit says no
            offset = 0
            for p, g in zip(same, grads):
                part = flat[offset : offset + g.numel()].view_as(g)
                offset += g.numel()
                if p.grad is not None:
                    p.grad.copy_(part)
                elif bool(part.any()):  # a parameter only other groups' rows reached
                    p.grad = part.clone()

    def commit(self) -> bool:
        """Whether the optimizer may step: True once every group's reduction succeeded; False drops the step."""
        self._require_loader()
        self.reduce()
        self._group_alive()
        ok = bool(self.manager.should_commit())
        self._held = self._reduced = False
        for loader in self._loaders:
            loader.step_done(ok)
        if ok:
            self._redos = 0
            return True
        self.redone += 1
        self._redos += 1
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self._redos > MAX_REDOS:
            raise ParatrainError(
                f"replica group {self.launch.index}: {self._redos} steps in a row could not be reduced between "
                f"groups ({self.manager.errored()}); check the other groups' logs and the lighthouse")
        return False

    def _group_alive(self) -> None:
        """A tiny collective inside the group before each wait in torchft: a peer of this group that died makes it
        fail at once (its connection closed), so the agent restarts the group now. torchft's own waits for the
        group's ranks (quorum, should_commit) run in native code that neither notices a dead peer nor lets the
        agent's SIGTERM in until their timeout."""
        collectives.all_reduce(0.0, op="sum", device=self.device)

    def _require_loader(self) -> None:
        if not self._loaders:
            raise ParatrainError(
                "replica groups need the training loader prepared with run.prepare_loader(loader): it gives each "
                "group its rows of every global batch, and trains a dropped step's rows again")

    def close(self) -> None:
        self.manager.shutdown(wait=False)
