"""One layout's run of the meta-device cases (tests/test_meta_build.py): each model built on the meta device, given
to run.prepare with its modules' own initialisation (exported at once) and with init_from (trained, then exported).

    paratrain run --nproc N tests/meta_worker.py LAYOUT CHECKPOINTS OUT
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
import meta_cases as cases  # noqa: E402

import paratrain  # noqa: E402


def main() -> None:
    layout, checkpoints, out = sys.argv[1], sys.argv[2], sys.argv[3]
    run = paratrain.setup(strategy=layout, seed=0, timeout_s=120)
    x, y = cases.data()
    losses: dict[str, list[float]] = {}
    held: dict[str, int] = {}
    for name in cases.models(layout):
        # the zoo's GPT computes a mask buffer no initialiser recomputes: parameters alone go to the meta device
        build = paratrain.empty_init if name == "gpt" else lambda: torch.device("meta")
        with build():
            model = cases.build(name)
        prepared = run.prepare(model, example=x[: cases.GLOBAL_BATCH])
        held[name] = cases.held_bytes(run.unwrap(prepared))  # what this rank stores: its share, not the model
        run.export(prepared, os.path.join(out, name, "init"))

        with build():
            model = cases.build(name)
        prepared, opt = run.prepare(model, cases.optimizer(model), example=x[: cases.GLOBAL_BATCH],
                                    init_from=cases.FILES[name](checkpoints))
        per_worker = run.per_worker_batch(cases.GLOBAL_BATCH)
        loader = run.prepare_loader(DataLoader(TensorDataset(x, y), batch_size=per_worker))
        losses[name] = []
        for inputs, targets in loader:
            loss = run.forward_backward(prepared, inputs, targets, cases.loss_fn)
            opt.step()
            opt.zero_grad()
            losses[name].append(float(loss))
        run.export(prepared, os.path.join(out, name, "trained"), max_shard_size=40_000)
    cases.record(run, out, losses, held)
    run.close()


if __name__ == "__main__":
    main()
