"""A training loop that survives being killed: checkpoint every N steps with `run.save(state)`, resume
with `run.load(state)`. Killed and restarted (by `paratrain run --max-restarts`, or by hand) it ends
with exactly the weights an uninterrupted run reaches, and trains on every sample once per epoch.

    paratrain run --nproc 2 --max-restarts 3 examples/resumable.py --checkpoint-dir ckpt

On SIGTERM (preemption) it saves at the next step boundary and stops; run it again to continue.
It also runs with a different number of workers than the run that saved (same global batch).

Testing aids: `--ledger DIR` makes every rank append what each step trained on to DIR/rank-R.jsonl,
and `--fault KIND:RANK@STEP,...` (RANK * for any) injects failures, each at most once per ledger directory:
kill (SIGKILL after the step, once the checkpoints saved before it are written: they are written in the
background), kill-node (SIGKILL the launcher, then this worker, as kill), kill-in-save
(SIGKILL while saving the checkpoint of that step),
hang (sleep forever before the next collective), term (SIGTERM to this worker) and term-launcher
(SIGTERM to the launcher, as a scheduler's preemption does).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain


def _launcher_pid() -> int:
    """The agent that started us: `paratrain run` names itself (its warm workers are forked by a template, so
    their parent is not the agent); under torchrun it is our parent."""
    return int(os.environ.get("PARATRAIN_AGENT_PID") or os.getppid())


class Ledger:
    """Append-only JSON lines per rank; each line says which generation (start of a process group) wrote it."""

    def __init__(self, folder: str | None, rank: int, generation: int) -> None:
        self.file = None
        self.generation = generation
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(folder) / f"rank-{rank}.jsonl", "a", buffering=1)

    def write(self, **record: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"gen": self.generation, "t": time.time(), **record}) + "\n")
            self.file.flush()


class _KillWhenPickled:
    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        return (int, ())


class Faults:
    """Failures injected at chosen (rank, step) points, each fired once: a marker file remembers it."""

    def __init__(self, spec: str, folder: str | None, rank: int, ledger: Ledger,
                 settle: Callable[[], object] = lambda: None) -> None:
        self.settle = settle
        """Waits for the checkpoint being written in the background: a kill then leaves it complete, so where
        the run resumes follows from the kill's step alone."""
        self.events = []
        for item in filter(None, spec.split(",")):
            kind, _, where = item.partition(":")
            who, _, step = where.partition("@")
            self.events.append((kind, -1 if who == "*" else int(who), int(step)))
        if self.events and not folder:
            raise SystemExit("--fault needs --ledger DIR (where it remembers which faults already fired)")
        self.folder, self.rank, self.ledger = Path(folder or "."), rank, ledger
        self.step = 0

    def _due(self, kind: str) -> bool:
        for i, (k, who, step) in enumerate(self.events):
            marker = self.folder / f"fault-{i}-{k}"
            if k == kind and who in (self.rank, -1) and step == self.step and not marker.exists():
                marker.touch()
                self.ledger.write(event="fault", kind=kind, step=step)
                return True
        return False

    def after_step(self, step: int) -> None:
        self.step = step
        if self._due("kill"):
            self.settle()
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("kill-node"):
            self.settle()
            os.kill(_launcher_pid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("term"):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._due("term-launcher"):
            os.kill(_launcher_pid(), signal.SIGTERM)
        if self._due("hang"):
            while True:
                time.sleep(3600)

    # Part of the checkpointed state, so that `run.save` calls state_dict() in the middle of saving.
    def state_dict(self) -> dict[str, Any]:
        if not self._due("kill-in-save"):
            return {}
        if self.rank == 0:
            return {"bomb": _KillWhenPickled()}  # dies in run.save: copied (async_save) or pickled into shared.pt
        os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def build(samples: int, dropout: float, hidden: int) -> tuple[TensorDataset, nn.Module]:
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(samples, 8, generator=g), torch.randn(samples, 4, generator=g)
    data = TensorDataset(torch.arange(samples), x, y)
    model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 4))
    return data, model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=72)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--hidden", type=int, default=32, help="width of the hidden layer (model and checkpoint size)")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipelines: micro-batches per step (default: the fewest the schedule runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.1,
                   help="masks come from each rank's generator: use 0 to compare runs on different world sizes")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--out", default=None, help="rank 0 writes final model/optimizer/scheduler state here")
    p.add_argument("--ledger", default=None, help="directory for per-rank records of the samples each step used")
    p.add_argument("--fault", default="", help="testing aid: KIND:RANK@STEP[,...]")
    args = p.parse_args(argv)

    pipeline = {"microbatches": args.microbatches} if args.microbatches else {}
    run = paratrain.setup(strategy=args.strategy, seed=args.seed, checkpoint_dir=args.checkpoint_dir,
                          keep_last=args.keep_last, **pipeline)
    generation = int(run.all_reduce(torch.tensor(time.time_ns()), op="max"))
    ledger = Ledger(args.ledger, run.rank, generation)
    faults = Faults(args.fault, args.ledger, run.rank, ledger, settle=run.wait_for_save)

    data, model = build(args.samples, args.dropout, args.hidden)
    loader = run.prepare_loader(DataLoader(data, batch_size=run.per_worker_batch(args.global_batch), shuffle=True))
    example = data.tensors[1][: run.per_worker_batch(args.global_batch)]  # pipelines measure their layers on it
    model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2), example=example)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    loss_fn = nn.MSELoss()

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0}
    if faults.events:
        state["faults"] = faults
    resumed = run.load(state)
    ledger.write(event="start", step=state["step"], resumed=resumed, world=run.world_size)

    staged = any(word in ("pp", "mp") for word in args.strategy.split("+"))  # model cut into stages
    stopped = False
    while loader.epoch < args.epochs and not stopped:
        for idx, x, y in loader:
            optimizer.zero_grad()
            x, y = x.to(run.device), y.to(run.device)
            if staged:  # a pipeline runs forward and backward together, as a schedule
                run.forward_backward(model, x, y, loss_fn)
            else:
                run.backward(loss_fn(model(x), y))
            optimizer.step()
            scheduler.step()
            state["step"] += 1
            ledger.write(step=state["step"], epoch=loader.epoch, idx=idx.tolist())
            faults.after_step(state["step"])
            stopped = run.should_stop
            if state["step"] % args.every == 0 or stopped:
                run.save(state)
            if stopped:
                run.print(f"stopping at step {state['step']} on request; checkpoint saved")
                break

    if not stopped and args.out:
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()  # FSDP: collective
                   for k, v in run.unwrap(model).state_dict().items()}
        final = {"model": weights, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "step": state["step"]}
        if staged and run.world_size > 1:  # each pipeline rank holds its stage
            torch.save(final, f"{args.out}.rank-{run.rank}")
        elif run.is_main:
            torch.save(final, args.out)
    ledger.write(event="end", step=state["step"], stopped=stopped)
    run.print(f"done at step {state['step']}")
    run.close()


if __name__ == "__main__":
    main()
