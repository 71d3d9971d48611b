"""The training benchmarks/goodput.py measures: the `mini` GPT decoder (paratrain.measure.gpt) on synthetic tokens,
the same script whether it runs as replica groups (`paratrain run --replica-groups 2`) or as one ddp job that
resumes from its checkpoints (`paratrain run --nproc 2 --max-restarts K`, `--save-every N`).

Rank 0 of each group (of the job) appends one line per committed step to LEDGER/steps-NAME.jsonl (the global step
index, the time, its pid), and every worker its pid to LEDGER/pids-NAME-rankR.txt when it starts, which is where
the benchmark finds the processes it kills. It trains until it is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.measure.gpt import GPT, SIZES, NextTokenLoss, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ledger", required=True)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N committed steps (0: never)")
    p.add_argument("--size", default="mini", choices=sorted(SIZES))
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--samples", type=int, default=4096)
    args = p.parse_args()
    ledger = Path(args.ledger)
    ledger.mkdir(parents=True, exist_ok=True)

    run = paratrain.setup(strategy="ddp", seed=0, checkpoint_dir=args.checkpoint_dir)
    groups = run.replica_groups
    name = f"group{groups.launch.index}" if groups is not None else "job"
    with open(ledger / f"pids-{name}-rank{run.rank}.txt", "a") as f:
        f.write(f"{os.getpid()}\n")

    cfg = SIZES[args.size]
    inputs, targets = tokens(args.samples, cfg, seed=1)
    loader = run.prepare_loader(DataLoader(TensorDataset(inputs, targets),
                                           batch_size=run.per_worker_batch(args.global_batch), shuffle=True))
    model = GPT(cfg)
    model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    recovered = groups is not None and groups.recovered > 0  # took a live group's state: newer than any checkpoint
    if args.checkpoint_dir and not recovered:
        run.load(state)
    steps_per_epoch = args.samples // args.global_batch
    loss_fn = NextTokenLoss()
    while True:
        for x, y in loader:
            run.forward_backward(model, x, y, loss_fn)
            redone = groups.redone if groups is not None else 0
            optimizer.step()
            optimizer.zero_grad()
            if groups is not None and groups.redone != redone:
                continue  # dropped: the reduction between groups failed; the loader yields the batch again
            state["step"] = loader.epoch * steps_per_epoch + loader.consumed // args.global_batch  # its position
            if run.rank == 0:
                line = {"step": state["step"] - 1, "t": time.time(), "pid": os.getpid(),
                        "redone": groups.redone if groups is not None else 0}
                with open(ledger / f"steps-{name}.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
            if args.save_every and state["step"] % args.save_every == 0:
                run.save(state)


if __name__ == "__main__":
    main()
