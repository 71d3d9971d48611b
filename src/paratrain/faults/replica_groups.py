"""Replica groups in the worker: gradients averaged between groups by torchft, each step only among the living.

Inside a group the strategy runs as it does alone (DDP over the group's N workers, or FSDP2 shards, tensor-parallel
pieces, pipeline stages: `check_strategy`). Every group lays the model out alike, so rank l of each holds the same
piece and the work between groups is per rank (faults/shards.py). Between groups, torchft's `Manager` holds a
fault-tolerant gloo process group of rank l of every group, rebuilt whenever the set of live groups changes.
One optimizer step, on every worker of every group:

    loader: begin()  ── the step's quorum (lighthouse): P live groups, this group's place r among them;
                        a group that is behind first copies a live group's state (model, optimizer, loader
                        position, micro-step, RNG): torchft's live recovery, no disk read
            rows     ── the global batch cut into P*D shares (D the group's data-parallel ranks); this worker takes
                        share r*D + d, weighted so that the average over all P*D shares is the global batch's
                        mean (data/plan.py)
    backward         ── DDP averages over the group's workers (FSDP2 reduce-scatters to each rank's shard)
    optimizer.step(): reduce()  ── Manager.allreduce: this rank's gradient pieces averaged over the P groups (one
                                   flat buffer per dtype)
                      commit()  ── should_commit: the step is applied only if the whole reduction succeeded;
                                   otherwise the gradients are dropped and the loader yields the same global
                                   batch again, cut over whoever is alive then

So the summed gradient of a step is the same whether 1 or R groups took part, and a step is never half-reduced.
torchft's own DistributedDataParallel wrapper is not used: its communication hook fails on the survivor when a
peer is SIGKILLed; the Manager's allreduce / should_commit reports the failure instead.
"""

from __future__ import annotations

import math
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
from ..parallel.tensor import local_part
from ..runtime import Placement, ReplicaGroupLaunch
from . import shards

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


WHOLE = ("single", "dp", "ddp")
"""Layouts whose every rank holds a whole replica."""
INSIDE_AXES = ("ddp", "fsdp", "tp", "pp")
"""Axes of a layout inside a group whose ranks each average their own pieces with the same rank of the other
groups: replicas, FSDP shards (HSDP across groups), tensor-parallel pieces and pipeline stages."""
MEASURED_BALANCE = ("time", "memory")
"""Pipeline balances each group would measure on its own: two groups could cut the model at different layers."""
NOT_BUILT = {
    "mp": "a pipeline over one process's devices is not built for replica groups",
    "cp": "context parallelism inside a group is not built for replica groups",
    "ep": "the experts' router statistics would be reduced over one group's rows, not the global batch's",
}
"""Why a layout (a preset, or a word of the grammar) cannot run inside a replica group."""


def check_strategy(strategy: Strategy, config: Config, launch: ReplicaGroupLaunch) -> None:
    """Each rank averages its own gradient pieces with the same rank of the other groups: the layout inside a group
    must give every rank one whole replica or one fixed piece of it (ddp, fsdp, tp, pp and their mixes)."""
    reason = _not_built(strategy.name)
    if reason is not None:
        raise ParatrainError(
            f"strategy={strategy.name!r} with --replica-groups {launch.count}: {reason}; use strategy='ddp' or "
            "'fsdp' inside each group (also beside 'tp', as 'fsdp+tp'; or 'single' with --nproc 1)"
        )
    if "pp" in strategy.name.split("+") and config.balance in MEASURED_BALANCE:
        raise ParatrainError(
            f"strategy={strategy.name!r} with --replica-groups {launch.count} and balance={config.balance!r}: each "
            "group would measure its own stage split, and rank l of two groups must hold the same layers; give "
            "balance='equal', the layers per stage (balance=[3, 2]) or split_points"
        )
    if config.precision == "16":
        raise ParatrainError(
            f"precision='16' with --replica-groups {launch.count}: each group's GradScaler would skip steps on its "
            "own; use precision='bf16' or '32'"
        )


def _not_built(name: str) -> str | None:
    """Why `name` cannot run inside a group, or None."""
    if name in WHOLE:
        return None
    words = name.split("+")
    for word in words:
        if word in NOT_BUILT:
            return NOT_BUILT[word]
    unknown = [w for w in words if w not in INSIDE_AXES]
    return f"{'+'.join(unknown)} is not built for replica groups" if unknown else None


def _check_equal_shares(loader: ShardedLoader, groups: int) -> None:
    """A pipeline's replicas take equal rows: its global batch must split evenly over every number of live groups
    (1..R) times the group's replicas and accumulation steps, or a step after a group is lost could not be cut."""
    layout, batch = loader.layout, loader.global_batch
    if not layout.equal_shares or batch is None:
        return
    parts = [p * layout.replicas * layout.grad_accum for p in range(1, groups + 1)]
    uneven = [p for p in parts if batch % p]
    if uneven:
        need = math.lcm(*parts)
        raise ParatrainError(
            f"global batch {batch} with a pipeline in each of {groups} replica groups: its replicas take equal rows, "
            f"and {batch} cannot be cut into {uneven[0]} equal shares (groups alive x replicas x accumulation); use "
            f"a global batch that is a multiple of {need}")


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
        _check_equal_shares(loader, self.launch.count)
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
        return {"models": [shards.model_state(m) for m in self._models],
                "optimizers": [shards.optimizer_state(o) for o in self._optimizers],
                "loaders": [x.state_dict() for x in self._loaders], "micro": self._micro(), "rng": rng.capture()}

    def _load(self, state: dict[str, Any]) -> None:
        if len(state["models"]) != len(self._models) or len(state["loaders"]) != len(self._loaders):
            raise ParatrainError(
                f"replica group {self.launch.index} prepared {len(self._models)} model(s) and {len(self._loaders)} "
                f"training loader(s) but the group it recovers from has {len(state['models'])} and "
                f"{len(state['loaders'])}; every group must run the same script")
        for model, values in zip(self._models, state["models"]):
            shards.load_model_state(model, values)
        for optimizer, values in zip(self._optimizers, state["optimizers"]):
            shards.load_optimizer_state(optimizer, values)
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
        for same in buckets.values():  # each rank its own pieces: rank l of every group holds the same shards
            grads = [_grad_piece(p) for p in same]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if not self.manager.allreduce(flat).wait():
                return  # reported to the manager: should_commit says no
            offset = 0
            for p, g in zip(same, grads):
                part = flat[offset : offset + g.numel()].view_as(g)
                offset += g.numel()
                if p.grad is not None:
                    g.copy_(part)  # g is the gradient's own storage (its local piece under fsdp or tp)
                elif bool(part.any()):  # a parameter only other groups' rows reached
                    p.grad = shards.like(part.clone(), p)

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


def _grad_piece(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `p`'s gradient (its storage, written back in place), or zeros where it has none."""
    if p.grad is not None:
        return local_part(p.grad.detach())
    return torch.zeros_like(local_part(p.detach()))
