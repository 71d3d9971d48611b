"""The tutorials' toy model (Linear-ReLU-Linear, MSE) trained with paratrain.

Runs unchanged as `python examples/toy.py`, `paratrain run --nproc 2 examples/toy.py` or
`torchrun --nproc-per-node 2 examples/toy.py`; the global batch stays the same, so the final
weights do too (up to float rounding). `--strategy auto` lets the planner pick the layout.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--precision", default="32")
    parser.add_argument("--save-weights", default=None, help="write final weights here (rank 0)")
    parser.add_argument("--forward-backward", action="store_true",
                        help="step with run.forward_backward, which every layout runs (pipelines too)")
    args = parser.parse_args()

    run = paratrain.setup(strategy=args.strategy, grad_accum=args.grad_accum, precision=args.precision, seed=0,
                          auto_pipelines=args.forward_backward)
    data = TensorDataset(torch.randn(96, 10, generator=torch.Generator().manual_seed(1)),
                         torch.randn(96, 5, generator=torch.Generator().manual_seed(2)))
    loader = run.prepare_loader(DataLoader(data, batch_size=run.per_worker_batch(args.global_batch), shuffle=True))
    model = ToyModel()
    # the example (model inputs) lets strategy="auto" measure the model and choose the layout; other strategies
    # need none for this model
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), example=data[:4][0])
    loss_fn = nn.MSELoss()
    for epoch in range(args.epochs):
        total = torch.zeros(())
        for x, y in loader:
            optimizer.zero_grad()
            if args.forward_backward:
                loss = run.forward_backward(model, x, y, loss_fn)
            else:
                loss = loss_fn(model(x.to(run.device)), y.to(run.device))
                run.backward(loss)
            optimizer.step()
            total += loss.detach().cpu()
        mean = run.all_reduce(total / len(loader), op="mean")
        run.print(f"epoch {epoch} loss {mean.item():.6f}")
    if args.save_weights:  # every rank: sharded weights (fsdp, tp) are gathered whole, which is collective
        state = run.unwrap(model).state_dict()
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in state.items()}
        if run.is_main:  # under a pipeline, rank 0 holds the first stage
            torch.save(state, args.save_weights)
    run.close()

if __name__ == "__main__":
    main()
