"""One layout's run of the mixture-of-experts cases (tests/test_moe.py): each model trained three steps from the
same start as the plain loop, its losses and exported weights written for the test to compare.

    paratrain run --nproc N tests/moe_worker.py LAYOUT[:EP_SIZE] OUT MODEL [MODEL ...]

With MOE_SAVE=DIR a run stops after its first step and saves model, optimizer and loader there (one model); with
MOE_RESUME=DIR it loads them first and trains the rest of the epoch; MOE_CHECKPOINTING=full|selective recomputes
each block's activations in the backward (applied after the layout's tensor, context and expert steps);
MOE_LOSS=token_mean says the loss is a token mean (`setup(loss=...)`).
"""

from __future__ import annotations

import os
import sys

from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
import meta_cases  # noqa: E402
import moe_cases as cases  # noqa: E402

import paratrain  # noqa: E402


def main() -> None:
    layout, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    strategy, _, ep_size = layout.partition(":")
    run = paratrain.setup(strategy=strategy, seed=0, timeout_s=120, ep_size=int(ep_size) if ep_size else None,
                          activation_checkpointing=os.environ.get("MOE_CHECKPOINTING", "none"),
                          loss=os.environ.get("MOE_LOSS", "any"))
    losses: dict[str, list[float]] = {}
    held: dict[str, dict[str, list[int]]] = {}
    tokens: dict[str, int] = {}  # the sequence length each model's embedding saw last: the rank's share (none: a
    # meta-built model's later pipeline stages, which measure their own layers only)
    for name in names:
        model = cases.build(name)
        x, y = cases.data(name)
        embedding = next(m for m in model.modules() if isinstance(m, nn.Embedding))
        embedding.register_forward_hook(lambda m, args, out, name=name: tokens.__setitem__(name, args[0].shape[1]))
        prepared, opt = run.prepare(model, cases.optimizer(model, name), example=x[: cases.GLOBAL_BATCH])
        per_worker = run.per_worker_batch(cases.GLOBAL_BATCH)
        loader = run.prepare_loader(DataLoader(TensorDataset(x, y), batch_size=per_worker))
        losses[name] = []
        state = {"model": prepared, "optimizer": opt, "loader": loader}
        if os.environ.get("MOE_RESUME"):
            assert run.load(state, path=os.environ["MOE_RESUME"])
        for inputs, targets in loader:
            losses[name].append(float(run.forward_backward(prepared, inputs, targets, cases.loss_fn)))
            if name in cases.CLIPPED:
                run.clip_grad_norm_(prepared, cases.CLIP)
            opt.step()
            opt.zero_grad()
            if os.environ.get("MOE_SAVE"):
                run.save(state, path=os.environ["MOE_SAVE"])
                break
        run.export(prepared, os.path.join(out, name))
        held[name] = {**cases.experts_held(name, run.unwrap(prepared)), "tokens": [tokens.get(name, 0)],
                      "tensor": [tensor_sharded(run.unwrap(prepared))]}
    meta_cases.record(run, out, losses, held)
    run.close()


def tensor_sharded(model: nn.Module) -> int:
    """Parameters this rank holds a tensor-parallel slice of (sharded over a mesh dimension named "tp")."""
    count = 0
    for p in model.parameters():
        mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", ())
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        count += any(name == "tp" and place.is_shard() for name, place in zip(names, placements))
    return count


if __name__ == "__main__":
    main()
