"""A small training run for tests/test_replica_groups.py: the same file trains as one process (the reference) or
as one worker of a replica group, and records what the tests check. `--strategy` is the layout inside each group
(ddp by default; fsdp, tp, pp, fsdp+tp...; `--balance` for a pipeline's split).

Failures it injects on itself, each once (a marker file in --out remembers it):

  --kill G@S[:PHASE]   group G's worker SIGKILLs itself at global step S, in PHASE: `reduce` (the default: after
                       the backward, so its peers are left inside the reduction between groups), `forward` (a
                       forward hook), `backward` (a backward hook) or `optimizer` (an optimizer-step pre-hook:
                       the step has committed everywhere, its own update is not applied)
  --rejoin-kill WHEN   the restarted worker of that group dies again while it rejoins: `recovery` (while it loads
                       the live group's state) or `first-step` (the forward of its first step after recovering)
  --kill-all S         every group's worker dies in the forward of global step S: no live group is left, so
                       every group restarts from the newest checkpoint of --save-every

What it records in --out: `pids-NAME-rankR.txt` (one line per start of the worker), `steps-NAME-rankR.jsonl` (one
line per committed step: its global index, the sample ids this worker trained, the time) and, at the end,
`weights-NAME-rankR.pt` and `report-NAME-rankR.json`. NAME is `groupG`, or `single` without replica groups.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import paratrain

PHASES = ("reduce", "forward", "backward", "optimizer")
FINAL_STEPS, FINAL_PACE_S = 8, 2.0
"""While a killed group is away, a survivor takes each of the run's last 8 steps at most every 2 s, so that the
group rejoins a running job (and recovers from it) instead of finding it finished; it keeps asking for quorums,
so the group joins the first one after it is back."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="ddp", help="the layout inside each group")
    parser.add_argument("--balance", default=None, help="a pipeline's balance (pp inside each group)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--kill", default=None, help="G@S[:PHASE]: group G's worker dies at step S (once)")
    parser.add_argument("--rejoin-kill", choices=("recovery", "first-step"), default=None)
    parser.add_argument("--kill-all", type=int, default=None, help="every group's worker dies at step S (once)")
    parser.add_argument("--save-every", type=int, default=0, help="group 0 checkpoints every N committed steps")
    parser.add_argument("--pace", type=float, default=0.0,
                        help="seconds a survivor waits after each step while a killed group is away (FINAL_PACE_S "
                             "for the last FINAL_STEPS)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    layout = {"strategy": args.strategy} | ({"balance": args.balance} if args.balance else {})
    run = paratrain.setup(**layout, seed=3, grad_accum=args.grad_accum,
                          checkpoint_dir=str(out / "ckpt") if args.save_every else None)
    groups = run.replica_groups
    group = groups.launch.index if groups is not None else -1
    name = f"group{group}" if groups is not None else "single"
    pids = out / f"pids-{name}-rank{run.rank}.txt"
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\n")
    generation = len(pids.read_text().split()) - 1  # 0 for the first start, 1 after one restart...

    g = torch.Generator().manual_seed(11)
    n = args.samples
    data = TensorDataset(torch.arange(n), torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    loader = run.prepare_loader(DataLoader(data, batch_size=run.per_worker_batch(args.global_batch), shuffle=True))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    raw = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps_per_epoch = n // args.global_batch

    def done() -> int:
        """Global batches committed: the loader's position once a step has committed."""
        return loader.epoch * steps_per_epoch + loader.consumed // args.global_batch

    kill_group, kill_step, phase = _parse_kill(args.kill)
    victim = groups is not None and group == kill_group  # every rank of the killed group
    final = 1 + (args.rejoin_kill is not None)
    """The killed group's generation that rejoins for good."""
    now: dict[str, Any] = {"step": -1, "ids": [], "recovered_at_start": False}

    def die(marker: str) -> None:
        (out / marker).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)

    def due(where: str) -> bool:
        if victim and run.rank == 0 and generation == 0 and phase == where and now["step"] == kill_step:
            return not (out / "killed").exists()
        if args.kill_all is not None and groups is not None and where == "forward" and generation == 0:
            return now["step"] == args.kill_all and not (out / f"killed-all-{name}").exists()
        return False

    def on_forward(*_: Any) -> None:
        if due("forward"):
            die(f"killed-all-{name}" if args.kill_all is not None else "killed")
        if victim and run.rank == 0 and generation == 1 and args.rejoin_kill == "first-step" and \
                now["recovered_at_start"]:
            die("killed-again")

    def on_backward(*_: Any) -> None:
        if due("backward"):
            die("killed")

    def on_commit(*_: Any) -> None:  # an optimizer-step pre-hook: the step committed (a dropped one never steps)
        if now["step"] < 0:  # no batch trained yet: torch's sharded checkpoint load stepping at lr 0 to build state
            return
        line = {"step": done() - 1, "ids": now["ids"], "t": time.time(), "gen": generation,
                "groups": groups.manager.num_participants() if groups is not None else 1}
        with open(out / f"steps-{name}-rank{run.rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        now["ids"] = []  # the next window's rows
        if due("optimizer"):
            die("killed")

    model[0].register_forward_hook(on_forward)
    model[2].register_full_backward_hook(on_backward)
    raw.register_step_pre_hook(on_commit)  # before any other pre-hook: the record is written before a kill
    if victim and run.rank == 0 and generation == 1 and args.rejoin_kill == "recovery":
        model.register_load_state_dict_post_hook(lambda *_: die("killed-again"))  # the live state arriving
    example = data.tensors[1][: loader.batch_size]  # tp checks its sharded blocks on it, pp splits by it
    model, optimizer = run.prepare(model, raw, example=example)  # a group that rejoins a running job recovers here
    recovered = bool(groups is not None and groups.recovered)
    now["recovered_at_start"] = recovered
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    resumed = None
    if args.save_every and not recovered and run.load(state):  # no live group to take the state from
        resumed = state["step"]
    if victim and recovered and generation == final:
        (out / "rejoined").write_text(str(os.getpid()))

    last = args.epochs * steps_per_epoch - 1
    paced, trained = 0, 0
    while loader.epoch < args.epochs:
        for ids, x, y in loader:
            now["step"] = done()  # this step's index under replica groups (their position moves on a commit)
            now["ids"] += ids.tolist()  # every micro-batch of the window (grad_accum > 1)
            run.forward_backward(model, x, y, torch.nn.MSELoss())
            if due("reduce"):
                die("killed")
            redone = groups.redone if groups is not None else 0
            optimizer.step()
            optimizer.zero_grad()
            if groups is not None and groups.redone != redone:
                now["ids"] = []  # dropped: the window's rows come again
            if groups is None or groups.redone == redone:  # committed (a dropped step comes again)
                state["step"], trained = done(), trained + 1
                if args.save_every and group <= 0 and state["step"] % args.save_every == 0:
                    run.save(state)
                if groups is not None and not victim and away(out):  # train on, slower, while it restarts
                    slow = last - state["step"] < FINAL_STEPS
                    time.sleep(FINAL_PACE_S if slow else args.pace)
                    paced += slow
    run.wait_for_save()
    weights = whole(run.unwrap(model))
    torch.save(weights, out / f"weights-{name}-rank{run.rank}.pt")
    report: dict[str, Any] = {"steps": trained, "pid": os.getpid(), "generation": generation,
                              "resumed": resumed, "paced": paced, "held": held(run.unwrap(model)),
                              "whole": sum(v.numel() for v in weights.values())}
    if groups is not None:
        report |= {"recovered": groups.recovered, "redone": groups.redone}
    (out / f"report-{name}-rank{run.rank}.json").write_text(json.dumps(report))
    run.close()


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole weights on every rank of its group (FSDP shards and tensor-parallel pieces gathered)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def held(model: torch.nn.Module) -> int:
    """The parameter elements this rank holds: less than the whole model's under a sharded layout."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def _parse_kill(spec: str | None) -> tuple[int, int, str]:
    if not spec:
        return -1, -1, ""
    where, _, phase = spec.partition(":")
    group, step = (int(v) for v in where.split("@"))
    if (phase or "reduce") not in PHASES:
        raise SystemExit(f"--kill {spec}: the phase is one of {', '.join(PHASES)}")
    return group, step, phase or "reduce"


def away(out: Path) -> bool:
    """A group was killed and has not rejoined yet."""
    return (out / "killed").exists() and not (out / "rejoined").exists()


if __name__ == "__main__":
    main()
