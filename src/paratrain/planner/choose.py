"""`setup(strategy="auto")` with an example batch: the planner's fastest layout for the world a job started in.

Rank 0 measures the user's model on the example (a copy, so weights, BatchNorm statistics and the random stream
are untouched), reads this machine's calibration (measured once and cached, or `PARATRAIN_CLUSTER`), ranks every
layout of exactly this many processes that fits, keeps the first one the engine accepts, and returns the
`setup` options that name it. `api.Run.prepare` broadcasts them and switches to it before wrapping.
"""

from __future__ import annotations

import copy
import hashlib
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._tree import map_tensors, tensors_in
from ..errors import ParatrainError
from . import cluster as clusters
from .cluster import Cluster
from .predict import Prediction

REPEATS = 5
"""Timed repeats per layer and size: with 3, one start in three of the `gpt` workload ranked a pipeline 23%
slower than `ddp` first (benchmarks/auto_choice.py)."""
CLUSTER_ENV = "PARATRAIN_CLUSTER"
CACHE_ENV = "PARATRAIN_CACHE"
Say = Callable[[str], None]


@dataclass(frozen=True)
class Choice:
    setup: dict[str, Any]
    """The `setup(...)` options that run the chosen layout (strategy, degrees, schedule, micro-batches)."""
    line: str
    """The one line printed for the choice."""


def cache_path(kind: str) -> Path:
    """Where this machine's calibration is kept: one file per host, core count, device kind and torch."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "paratrain")
    key = f"{platform.node()}|{os.cpu_count()}|{kind}|{torch.__version__}"
    return root / f"cluster-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def machine(kind: str, say: Say) -> Cluster:
    """`PARATRAIN_CLUSTER` (a preset or a spec file), else this machine's cached calibration, else measured now
    and cached (once per machine: 10-30 s on CPU)."""
    named = os.environ.get(CLUSTER_ENV)
    if named:
        return clusters.load(named)
    path = cache_path(kind)
    if path.exists():
        try:
            cached = clusters.load(str(path))
        except ParatrainError:
            cached = None  # a cache from another version of the format: measure again
        fitted = set(cached.collectives) if cached is not None else set()
        if cached is not None and (not fitted or fitted >= set(clusters.COLLECTIVES)):
            return cached
        path.unlink(missing_ok=True)  # or one made before every collective was measured
    say(f"paratrain: strategy auto measures this machine once ({path}; set {CLUSTER_ENV} to use another spec)")
    path.parent.mkdir(parents=True, exist_ok=True)
    _calibrate(kind, path)
    return clusters.load(str(path))


_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
_CALIBRATE = ("import sys; from paratrain.planner import calibrate, calibrate_gpu, cluster; "
              "m = calibrate_gpu.measure if sys.argv[1] == 'cuda' else calibrate.measure; "
              "cluster.write(m(), __import__('pathlib').Path(sys.argv[2]))")


def _calibrate(kind: str, path: Path, timeout: float = 300.0) -> None:
    """The calibration in a process of its own, outside this job: it starts its own workers and process group,
    which must not read this job's rank, world or rendezvous."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith(("TORCHELASTIC_", "SLURM_", "PARATRAIN_LAUNCHER"))}
    try:
        done = subprocess.run([sys.executable, "-c", _CALIBRATE, kind, str(path)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ParatrainError(f"measuring this machine took over {timeout:.0f} s; set {CLUSTER_ENV} to a spec "
                             "file (paratrain plan --cluster local --out DIR writes one)") from None
    if done.returncode or not path.exists():
        tail = done.stdout.strip().splitlines()[-1:] or ["no output"]
        raise ParatrainError(f"measuring this machine failed ({tail[0]}); set {CLUSTER_ENV} to a spec file")


def for_world(cluster: Cluster, world: int, nodes: int) -> Cluster:
    """The cluster as the job sees it: `world` devices over `nodes` nodes."""
    if nodes > 1 and world % nodes == 0:
        return replace(cluster, nodes=nodes, devices_per_node=world // nodes)
    return replace(cluster, nodes=1, devices_per_node=world)


def rows(example: Any) -> int:
    found = [t.shape[0] for t in tensors_in(example) if t.dim() > 0]
    if not found:
        raise ParatrainError("strategy='auto' reads the batch size from the example's first dimension, but the "
                             "example holds no tensor with one; pass one batch of model inputs as example=")
    return int(found[0])


def resized(example: Any, size: int) -> Any:
    """The example with `size` rows: its first rows, or its rows repeated (timing needs shapes, not values)."""
    n = rows(example)

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != n:
            return t
        return t[:size] if size <= n else t.repeat(-(-size // n), *([1] * (t.dim() - 1)))[:size]

    return map_tensors(cut, example)


class _StandInLoss(nn.Module):
    """A loss for timing only (the user's is not known here): over the last dimension of each floating output a
    log-sum-exp, which costs what a cross-entropy over logits costs (a language model's loss is a real share
    of its last stage), then the mean."""

    def forward(self, output: Any, target: Any = None) -> torch.Tensor:
        values = [(torch.logsumexp(t.float(), -1) if t.dim() > 1 else t.float()).mean()
                  for t in tensors_in(output) if t.is_floating_point()]
        if not values:
            raise ParatrainError("strategy='auto' times the model's backward, but its output holds no floating "
                                 "tensor; name the strategy instead")
        return torch.stack(values).sum()


def optimizer_name(optimizer: torch.optim.Optimizer | None) -> str:
    """The planner's optimizer class for its state and step cost."""
    if optimizer is None:
        return "sgd"
    if isinstance(optimizer, torch.optim.SGD):
        return "momentum" if optimizer.defaults.get("momentum") else "sgd"
    return "adam"


def ranked(predictions: list[Prediction], world: int, grad_accum: int, pipelines: bool) -> list[Prediction]:
    """The layouts this job can switch to, fastest first: all `world` processes, one device each (not `single`, not
    `mp`), the accumulation the script asked for (it sized its loader with it), pipelines only for a loop that runs
    them."""
    return [p for p in predictions if p.fits and p.layout.processes == world and p.layout.devices == world
            and p.layout.grad_accum == grad_accum and (pipelines or not p.layout.pipelined)]


def reason(best: Prediction, runner_up: Prediction | None) -> str:
    """Where the pick wins its step time over the runner-up, in words."""
    if runner_up is None:
        return "the only layout of this world that fits"
    gaps = {"less exposed communication": runner_up.exposed_comm_s - best.exposed_comm_s,
            "less compute on the busiest worker": runner_up.compute_s - best.compute_s,
            "a shorter optimizer step": runner_up.optimizer_s - best.optimizer_s,
            "less per-call overhead": runner_up.overhead_s - best.overhead_s}
    why = max(gaps, key=lambda k: gaps[k])
    return f"{why}, {gaps[why] * 1e3:.1f} ms" if gaps[why] > 0 else "a smaller pipeline bubble"


def describe(best: Prediction, runner_up: Prediction | None, seconds: float) -> str:
    runner = f"; runner-up {runner_up.layout.label} {runner_up.step_s:.4f} s" if runner_up else ""
    return (f"paratrain: strategy auto -> {best.layout.label} (predicted {best.step_s:.4f} s/step{runner}; "
            f"{reason(best, runner_up)}; planned in {seconds:.1f} s)")


def plan(model: nn.Module, example: Any, optimizer: torch.optim.Optimizer | None, *, world: int, nodes: int,
         global_batch: int, precision: str, grad_accum: int, pipelines: bool, device: torch.device,
         accepts: Callable[[dict[str, Any]], str | None], say: Say = print,
         real: Callable[[nn.Module], nn.Module] | None = None) -> Choice:
    """The fastest layout for this world; `accepts(setup_options)` is the engine's refusal (None: it runs). A model
    built on the meta device is measured a layer at a time, each made real by `real` (`profile.measure`)."""
    from . import search
    from .command import micro_sizes
    from .profile import measure

    started = time.perf_counter()
    cluster = for_world(machine(device.type, say), world, nodes)
    name = optimizer_name(optimizer)
    sizes = micro_sizes(global_batch, limit=6)
    # the user's model keeps its weights, statistics and gradients; a meta model's layers are copied as timed
    probe = model if real is not None else copy.deepcopy(model).to(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        profile = measure(probe, lambda b: (map_tensors(lambda t: t.to(device), resized(example, b)), None),
                          _StandInLoss(), sizes,
                          name=type(model).__name__, precision=precision, optimizer=name, repeats=REPEATS,
                          device=device, real=real)
    del probe
    found = ranked(search.layouts(profile, cluster, global_batch, precision=precision, optimizer=name,
                                  devices=world), world, grad_accum, pipelines)
    runnable: list[tuple[Prediction, dict[str, Any]]] = []
    refused: list[str] = []
    for p in found:
        options = p.layout.setup_kwargs(cluster)
        options.pop("precision", None)
        why = accepts(options)
        if why is None:
            runnable.append((p, options))
            if len(runnable) == 2:
                break
        else:
            refused.append(f"{p.layout.label}: {why}")
    if not runnable:
        detail = "; ".join(refused[:3]) or "no layout of this world fits its memory"
        raise ParatrainError(f"strategy='auto' found no layout for {world} processes ({detail}); name a strategy")
    best, options = runnable[0]
    runner_up = runnable[1][0] if len(runnable) > 1 else None
    return Choice(setup=options, line=describe(best, runner_up, time.perf_counter() - started))
